//! Prometheus file-based service discovery for the docker backend: the processor containers it runs,
//! written as a `file_sd_configs` file whenever the set of running containers changes, so Prometheus
//! finds the containers the agent adds (and drops those it removes) without the Docker socket.
//!
//! The file is a JSON list with one target group per container, sorted by name:
//! `[{"targets": ["billing-fleet-processor-1:9101"], "labels": {"service": "processor", "container":
//! "billing-fleet-processor-1"}}]`. The host is the container's name, which Docker's DNS resolves on
//! the compose network; the port is the one of its `LISTENER_HTTP_ADDR` (its state endpoint, where
//! `/metrics` is), read once per container. A container without it serves no metrics and is left out.
//!
//! Written atomically: a temporary file in the same directory, then a rename over the old one, so
//! Prometheus (which watches the directory) never reads half a file. Off unless
//! `--prometheus-targets-file` (`AGENT_PROMETHEUS_TARGETS_FILE`) names the file.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The environment variable whose port is a processor's state endpoint (`/metrics`).
pub const HTTP_ADDR_ENV: &str = "LISTENER_HTTP_ADDR";

/// The targets file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TargetsError {
    #[error("could not write the Prometheus targets file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
}

/// One scrape target: a container by name and the port of its state endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    pub container: String,
    pub port: u16,
}

/// The file_sd document for `service`'s `targets`: one group per container, sorted by name, the
/// labels `service` and `container` on each.
pub fn render(service: &str, targets: &[Target]) -> String {
    let mut sorted = targets.to_vec();
    sorted.sort();
    sorted.dedup();
    let groups: Vec<serde_json::Value> = sorted
        .iter()
        .map(|t| {
            serde_json::json!({
                "targets": [format!("{}:{}", t.container, t.port)],
                "labels": { "service": service, "container": t.container },
            })
        })
        .collect();
    // A list of plain JSON values always serializes.
    let mut out = serde_json::to_string_pretty(&groups).unwrap_or_else(|_| "[]".to_string());
    out.push('\n');
    out
}

/// The port of the state endpoint in a container's environment (`LISTENER_HTTP_ADDR=host:port`).
pub fn http_port(env: &[String]) -> Option<u16> {
    let addr = env.iter().find_map(|e| e.strip_prefix(HTTP_ADDR_ENV)?.strip_prefix('='))?;
    addr.rsplit_once(':')?.1.parse().ok().filter(|p| *p != 0)
}

/// Writes `content` to `path` atomically: into a temporary file beside it (mode 0644: Prometheus
/// reads it as another user), flushed to disk, then renamed over `path`.
pub fn write_atomic(path: &Path, content: &str) -> Result<(), TargetsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| TargetsError::Write { path: path.to_path_buf(), source };
    let name = path.file_name().ok_or_else(|| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name")))?;
    // A dot file with another extension: Prometheus's `*.json` pattern never matches it.
    let tmp = path.with_file_name(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(err)
}

/// The targets file of one compose service: rewritten when its set of targets changes.
pub struct TargetsFile {
    path: PathBuf,
    service: String,
    /// What the file holds now (`None`: not written yet, or the last write failed).
    written: Mutex<Option<String>>,
}

impl TargetsFile {
    pub fn new(path: PathBuf, service: String) -> TargetsFile {
        TargetsFile { path, service, written: Mutex::new(None) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the file when `targets` differ from what it holds. Returns whether it was written; a
    /// failed write is tried again at the next update.
    pub fn update(&self, targets: &[Target]) -> Result<bool, TargetsError> {
        let content = render(&self.service, targets);
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        if written.as_deref() == Some(content.as_str()) {
            return Ok(false);
        }
        *written = None;
        write_atomic(&self.path, &content)?;
        *written = Some(content);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(container: &str, port: u16) -> Target {
        Target { container: container.into(), port }
    }

    #[test]
    fn the_file_lists_each_container_as_a_group_with_its_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("processors.json");
        let file = TargetsFile::new(path.clone(), "processor".into());
        assert!(file.update(&[t("billing-fleet-processor-2", 9101), t("billing-fleet-processor-1", 9101)]).unwrap());
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            doc,
            serde_json::json!([
                { "targets": ["billing-fleet-processor-1:9101"], "labels": { "service": "processor", "container": "billing-fleet-processor-1" } },
                { "targets": ["billing-fleet-processor-2:9101"], "labels": { "service": "processor", "container": "billing-fleet-processor-2" } },
            ])
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644, "Prometheus reads it as another user");

        // The same set (in another order): not written again. A changed one: written, and nothing
        // but the file is left in the directory (the temporary file was renamed over it).
        assert!(!file.update(&[t("billing-fleet-processor-1", 9101), t("billing-fleet-processor-2", 9101)]).unwrap());
        assert!(file.update(&[t("billing-fleet-processor-1", 9101)]).unwrap());
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc.as_array().unwrap().len(), 1);
        assert!(file.update(&[]).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), "[]", "no container: an empty list, not a stale one");
        let names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["processors.json".to_string()]);
    }

    #[test]
    fn a_failed_write_is_an_error_naming_the_file_and_is_tried_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("processors.json");
        let file = TargetsFile::new(path.clone(), "processor".into());
        let e = file.update(&[t("p-1", 9101)]).expect_err("written into a directory that does not exist");
        assert!(e.to_string().contains("missing-dir/processors.json"), "{e}");
        std::fs::create_dir(dir.path().join("missing-dir")).unwrap();
        assert!(file.update(&[t("p-1", 9101)]).unwrap(), "the same targets after a failure are written");
        assert!(std::fs::read_to_string(&path).unwrap().contains("p-1:9101"));
    }

    #[test]
    fn the_port_is_the_state_endpoints() {
        let env = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(http_port(&env(&["PATH=/bin", "LISTENER_HTTP_ADDR=0.0.0.0:9101"])), Some(9101));
        assert_eq!(http_port(&env(&["LISTENER_HTTP_ADDR=[::]:9200"])), Some(9200));
        assert_eq!(http_port(&env(&["LISTENER_HTTP_ADDR_X=0.0.0.0:1", "PATH=/bin"])), None, "another variable");
        assert_eq!(http_port(&env(&["LISTENER_HTTP_ADDR=0.0.0.0:0"])), None, "port 0 is no fixed port");
        assert_eq!(http_port(&env(&["LISTENER_HTTP_ADDR="])), None);
    }
}
