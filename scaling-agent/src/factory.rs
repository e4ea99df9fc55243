//! The backend factory: the `--backend` flag and the flags of each backend, and building the backend
//! they choose (none, process, docker, keda) for the agent's fleet.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fleet_io::config::FleetArgs;
use fleet_io::pem::PemFile;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, BackendError, NoneBackend, ProcessBackend, ProcessSpec};
use crate::docker::{DockerBackend, TargetsOnly};
use crate::keda::{KedaBackend, KedaTls};
use crate::Settings;

/// Which backend starts and stops processor instances.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum BackendKind {
    /// Decide and report only.
    None,
    /// Processors as child processes of the agent (`--processor-bin`).
    Process,
    /// The compose service's containers, through the Docker Engine API (`DOCKER_HOST` or the local
    /// socket).
    Docker,
    /// Serve KEDA's external scaler gRPC protocol (`--keda-addr`); KEDA scales the Deployment.
    Keda,
}

/// The backend and its flags.
#[derive(Debug, clap::Args)]
pub struct BackendArgs {
    /// What starts and stops processors.
    #[arg(long, env = "AGENT_BACKEND", value_enum, default_value = "none")]
    pub backend: BackendKind,
    /// Process backend: the processor binary [default: `processor` next to this binary].
    #[arg(long, env = "AGENT_PROCESSOR_BIN")]
    pub processor_bin: Option<PathBuf>,
    /// Process backend: instance N serves its state endpoint on this port + N (unset: none).
    #[arg(long, env = "AGENT_PROCESSOR_HTTP_BASE")]
    pub processor_http_base: Option<u16>,
    /// Process backend: instance N appends its output to `processor-N.log` in this directory.
    #[arg(long, env = "AGENT_PROCESSOR_LOG_DIR")]
    pub processor_log_dir: Option<PathBuf>,
    /// A stopping processor gets this long to drain before it is killed, seconds (its own drain is
    /// `PROCESSOR_DRAIN_SECS`, 30 by default).
    #[arg(long, env = "AGENT_DRAIN_SECS", default_value_t = 35)]
    pub drain_secs: u64,
    /// Docker backend: the compose project [default: the one of the container the agent runs in].
    #[arg(long, env = "AGENT_DOCKER_PROJECT")]
    pub docker_project: Option<String>,
    /// Docker backend: the compose service to scale.
    #[arg(long, env = "AGENT_DOCKER_SERVICE", default_value = "processor")]
    pub docker_service: String,
    /// Docker backend (and the none backend in a compose project): keep a Prometheus file_sd file here
    /// listing the compose service's running containers (`name:port` of each one's
    /// LISTENER_HTTP_ADDR), rewritten atomically whenever the set changes [default: none written].
    #[arg(long, env = "AGENT_PROMETHEUS_TARGETS_FILE", value_name = "FILE")]
    pub prometheus_targets_file: Option<PathBuf>,
    /// Docker backend: host files (absolute, as the Docker Engine sees them; comma-separated) that a
    /// new container keeps when its template binds them read-only onto /run/secrets/ (compose
    /// secrets: the processors' role key, deploy/.keys/processor.key). Every other bind or mount is
    /// left out [default: none kept].
    #[arg(long, env = "AGENT_DOCKER_SECRET_FILES", value_name = "FILE,...")]
    pub docker_secret_files: Option<String>,
    /// Keda backend: the external scaler's gRPC address.
    #[arg(long, env = "AGENT_KEDA_ADDR", default_value = "0.0.0.0:9090")]
    pub keda_addr: std::net::SocketAddr,
    /// Keda backend: serve TLS with this PEM certificate chain (with --keda-tls-key).
    #[arg(long, env = "AGENT_KEDA_TLS_CERT", value_name = "FILE", requires = "keda_tls_key", value_parser = PemFile::read)]
    pub keda_tls_cert: Option<PemFile>,
    /// Keda backend: the PEM private key of --keda-tls-cert.
    #[arg(long, env = "AGENT_KEDA_TLS_KEY", value_name = "FILE", requires = "keda_tls_cert", value_parser = PemFile::read)]
    pub keda_tls_key: Option<PemFile>,
    /// Keda backend: require a client certificate signed by this PEM CA (KEDA's `tlsClientCert`).
    #[arg(long, env = "AGENT_KEDA_TLS_CLIENT_CA", value_name = "FILE", requires = "keda_tls_cert", value_parser = PemFile::read)]
    pub keda_tls_client_ca: Option<PemFile>,
}

impl BackendArgs {
    /// The KEDA endpoint's TLS material (read when the flags were parsed).
    pub fn keda_tls(&self) -> Option<KedaTls> {
        let (Some(cert), Some(key)) = (&self.keda_tls_cert, &self.keda_tls_key) else { return None };
        let bytes = |f: &PemFile| f.pem().as_bytes().to_vec();
        Some(KedaTls { cert_pem: bytes(cert), key_pem: bytes(key), client_ca_pem: self.keda_tls_client_ca.as_ref().map(bytes) })
    }

    /// Builds the backend these flags choose, for the agent's fleet (`fleet`) and settings (`settings`).
    pub async fn build(&self, fleet: &FleetArgs, settings: &Settings, shutdown: &CancellationToken) -> Result<Arc<dyn Backend>, BackendError> {
        let cli = self;
        if let (Some(path), BackendKind::Process | BackendKind::Keda) = (&cli.prometheus_targets_file, cli.backend) {
            tracing::warn!(path = %path.display(), backend = ?cli.backend, "--prometheus-targets-file lists compose containers (docker and none backends): nothing is written with this one");
        }
        Ok(match cli.backend {
            BackendKind::None => match &cli.prometheus_targets_file {
                // Through the Docker Engine, for the file only: nothing is started or stopped.
                Some(path) => Arc::new(TargetsOnly::new(
                    NoneBackend::new(settings.min_instances),
                    DockerBackend::connect(cli.docker_project.clone(), cli.docker_service.clone(), Some(path.clone())).await?,
                )),
                None => Arc::new(NoneBackend::new(settings.min_instances)),
            },
            BackendKind::Docker => {
                Arc::new(
                    DockerBackend::connect(cli.docker_project.clone(), cli.docker_service.clone(), cli.prometheus_targets_file.clone())
                        .await?
                        // (Empty, as compose passes an unset one: none.)
                        .keep_secret_files(cli.docker_secret_files.iter().flat_map(|f| f.split(',')).filter(|f| !f.is_empty()).map(PathBuf::from).collect()),
                )
            }
            BackendKind::Keda => {
                let policy = settings.policy();
                let keda = KedaBackend::new(policy.min, policy.per_instance_within_sla(), format!("{}-sla-backlog", fleet.work_queue));
                keda.serve(cli.keda_addr, cli.keda_tls(), shutdown.clone())
                    .await
                    .map_err(|e| BackendError::Config(format!("serving the KEDA external scaler on {}: {e}", cli.keda_addr)))?;
                keda
            }
            BackendKind::Process => {
                let program = match &cli.processor_bin {
                    Some(p) => p.clone(),
                    None => std::env::current_exe().map_err(|e| BackendError::Config(format!("locating this binary: {e}")))?.with_file_name("processor"),
                };
                if !program.is_file() {
                    return Err(BackendError::Config(format!("process backend: no processor binary at {} (set --processor-bin)", program.display())));
                }
                if let Some(dir) = &cli.processor_log_dir {
                    std::fs::create_dir_all(dir).map_err(|e| BackendError::Config(format!("creating {}: {e}", dir.display())))?;
                }
                // The processors work on the agent's fleet (names as flags; the AMQP URL, which may hold
                // a password, through the environment rather than the command line).
                let f = fleet;
                let args = [
                    ("--bucket", f.bucket.clone()),
                    ("--work-queue", f.work_queue.clone()),
                    ("--work-dlq", f.work_dlq()),
                    ("--work-shards", f.work_shards.to_string()),
                    ("--results-queue", f.results_queue.clone()),
                    ("--results-partitions", f.results_partitions.to_string()),
                    ("--trigger-exchange", f.trigger_exchange.clone()),
                ]
                .into_iter()
                .flat_map(|(k, v)| [k.to_string(), v])
                .collect();
                Arc::new(ProcessBackend::new(ProcessSpec {
                    program,
                    args,
                    envs: [("AMQP_URL".to_string(), f.amqp_url.clone())]
                        .into_iter()
                        .chain(f.amqp_ca.as_ref().map(|ca| ("AMQP_CA_FILE".to_string(), ca.path().to_string())))
                        .collect(),
                    http_base: cli.processor_http_base,
                    log_dir: cli.processor_log_dir.clone(),
                    drain: Duration::from_secs(cli.drain_secs),
                }))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        backend: BackendArgs,
    }

    /// The KEDA endpoint's TLS files are read when the flags are parsed: a missing or non-PEM file is
    /// refused then, by name, and Debug never prints the key.
    #[test]
    fn keda_tls_files_are_read_and_checked_at_parse_time() {
        let dir = std::env::temp_dir().join(format!("agent-keda-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").unwrap();
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nSECRETKEYBYTES\n-----END PRIVATE KEY-----\n").unwrap();
        let plain = dir.join("plain.txt");
        std::fs::write(&plain, "not a certificate").unwrap();
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("agent").chain(args.iter().copied())).map(|c| c.backend);

        let (c, k) = (cert.to_str().unwrap(), key.to_str().unwrap());
        let ok = parse(&["--keda-tls-cert", c, "--keda-tls-key", k]).unwrap();
        let tls = ok.keda_tls().expect("TLS configured");
        assert!(tls.key_pem.starts_with(b"-----BEGIN PRIVATE KEY"));
        assert!(tls.client_ca_pem.is_none());
        assert!(!format!("{ok:?}").contains("SECRETKEYBYTES"), "Debug prints the key");
        assert!(parse(&[]).unwrap().keda_tls().is_none());

        let missing = dir.join("nope.pem");
        let e = parse(&["--keda-tls-cert", missing.to_str().unwrap(), "--keda-tls-key", k]).expect_err("a missing file accepted").to_string();
        assert!(e.contains("nope.pem") && e.contains("--keda-tls-cert"), "{e}");
        let e = parse(&["--keda-tls-cert", c, "--keda-tls-key", k, "--keda-tls-client-ca", plain.to_str().unwrap()])
            .expect_err("a non-PEM CA accepted")
            .to_string();
        assert!(e.contains("plain.txt: no PEM block in it"), "{e}");
        assert!(parse(&["--keda-tls-cert", c]).is_err(), "a certificate without its key accepted");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
