//! `promtool check metrics` on a service's `/metrics` exposition, for the services' metric tests and
//! the compose test (deploy/e2e/tests/compose.rs).
//!
//! The services serve OpenMetrics (`application/openmetrics-text`), which Prometheus asks for and
//! reads as such. `promtool check metrics` (2.x) parses the classic text format only, where a
//! counter's family carries the `_total` of its samples: fed OpenMetrics unchanged it reports
//! "no help text" for every counter sample (its `# HELP`/`# TYPE` name the family without `_total`)
//! and stops at an `info` or `stateset` type. [`classic_text`] rewrites an exposition the way
//! Prometheus itself reads it (counter families named with `_total`; `# EOF` and `# UNIT` dropped);
//! everything else reaches promtool as served.
//!
//! Without promtool on `PATH` the check says so once and passes, unless `FLEET_REQUIRE_STACK` is set
//! (deploy/test.sh installs it with Debian's `prometheus` package, and sets that).

use std::collections::HashSet;
use std::io::Write;
use std::process::{Command, Stdio};

/// An OpenMetrics exposition in the classic text format, as Prometheus reads it (see the module's
/// documentation).
pub fn classic_text(openmetrics: &str) -> String {
    let counters: HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, t)| t.trim() == "counter")
        .map(|(name, _)| name)
        .collect();
    let mut out = String::new();
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta.and_then(|(p, rest)| rest.split_once(' ').map(|(name, tail)| (p, name, tail))) {
            Some((p, name, tail)) if counters.contains(name) && !name.ends_with("_total") => out.push_str(&format!("{p}{name}_total {tail}")),
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Metric names (families, as in `# TYPE`) of an exposition, with the sample names a query can use
/// (a counter's `_total`, a histogram's `_bucket`, `_sum`, `_count`).
pub fn metric_names(openmetrics: &str) -> HashSet<String> {
    let mut names = HashSet::new();
    for line in openmetrics.lines() {
        if let Some((name, _)) = line.strip_prefix("# TYPE ").and_then(|l| l.split_once(' ')) {
            names.insert(name.to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Whether promtool is on `PATH`. When it is not: with `FLEET_REQUIRE_STACK` set this panics;
/// otherwise it says so once per test binary, and the caller skips its check.
pub fn available() -> bool {
    let found = Command::new("promtool").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !found {
        let why = "promtool is not on PATH: the `promtool check metrics` checks are skipped (deploy/test.sh installs Debian's prometheus package)";
        assert!(std::env::var_os("FLEET_REQUIRE_STACK").is_none(), "FLEET_REQUIRE_STACK is set but {why}");
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            let _ = writeln!(std::io::stderr(), "note: {why}");
        });
    }
    found
}

/// `promtool check metrics` on `exposition` (OpenMetrics, as served): `Ok` when it is clean,
/// otherwise its findings. Call [`available`] first.
pub fn check_metrics(exposition: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("promtool: {e}"))?;
    let text = classic_text(exposition);
    // promtool reads all of stdin before it writes: no deadlock with piped output.
    child.stdin.take().expect("piped").write_all(text.as_bytes()).map_err(|e| format!("writing to promtool: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("promtool: {e}"))?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("promtool check metrics ({}): {}", out.status, said.trim()))
    }
}

/// Asserts that `promtool check metrics` is clean on `exposition` (`what` names it in the failure);
/// skipped (see [`available`]) without promtool.
pub fn assert_clean(what: &str, exposition: &str) {
    if available() {
        if let Err(e) = check_metrics(exposition) {
            panic!("{what}: {e}\n--- exposition ---\n{exposition}");
        }
    }
}
