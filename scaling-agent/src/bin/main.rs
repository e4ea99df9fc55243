//! `scaling-agent`: parses configuration, sets up tracing, clients and the scaling backend, runs the
//! agent until SIGTERM (or prints one snapshot of the queue depths as JSON with `--once`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use fleet_io::config::{Aws, FleetArgs, LogArgs};
use fleet_io::trigger::{report_key, ALL_WORK};
use scaling_agent::backend::{Backend, NoneBackend, ProcessBackend, ProcessSpec};
use scaling_agent::docker::DockerBackend;
use scaling_agent::keda::KedaBackend;

/// Which backend starts and stops processor instances.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum BackendKind {
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

/// Billing fleet scaling agent: watches queue depths and instance reports, scales processor instances
/// to the SLA, and publishes work-detected triggers.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    settings: scaling_agent::Settings,
    /// What starts and stops processors.
    #[arg(long, env = "AGENT_BACKEND", value_enum, default_value = "none")]
    backend: BackendKind,
    /// Process backend: the processor binary [default: `processor` next to this binary].
    #[arg(long, env = "AGENT_PROCESSOR_BIN")]
    processor_bin: Option<PathBuf>,
    /// Process backend: instance N serves its state endpoint on this port + N (unset: none).
    #[arg(long, env = "AGENT_PROCESSOR_HTTP_BASE")]
    processor_http_base: Option<u16>,
    /// Process backend: instance N appends its output to `processor-N.log` in this directory.
    #[arg(long, env = "AGENT_PROCESSOR_LOG_DIR")]
    processor_log_dir: Option<PathBuf>,
    /// A stopping processor gets this long to drain before it is killed, seconds (its own drain is
    /// `PROCESSOR_DRAIN_SECS`, 30 by default).
    #[arg(long, env = "AGENT_DRAIN_SECS", default_value_t = 35)]
    drain_secs: u64,
    /// Docker backend: the compose project [default: the one of the container the agent runs in].
    #[arg(long, env = "AGENT_DOCKER_PROJECT")]
    docker_project: Option<String>,
    /// Docker backend: the compose service to scale.
    #[arg(long, env = "AGENT_DOCKER_SERVICE", default_value = "processor")]
    docker_service: String,
    /// Keda backend: the external scaler's gRPC address.
    #[arg(long, env = "AGENT_KEDA_ADDR", default_value = "0.0.0.0:9090")]
    keda_addr: std::net::SocketAddr,
    /// Print one snapshot of the queue depths as JSON and exit.
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// Replay a simulated day of seed 004's workload at several volumes under this agent's policy, a
    /// KEDA-like default and a fixed fleet; print SLA misses, instance-hours, requests and cost.
    Simulate(scaling_agent::simulate::SimArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Cmd::Simulate(args)) = &cli.command {
        print!("{}", scaling_agent::simulate::report_table(args));
        return ExitCode::SUCCESS;
    }
    fleet_io::shutdown::serve(cli.log.log_json, |shutdown| start(cli, shutdown)).await
}

async fn backend(cli: &Cli, shutdown: &tokio_util::sync::CancellationToken) -> anyhow::Result<Arc<dyn Backend>> {
    Ok(match cli.backend {
        BackendKind::None => Arc::new(NoneBackend::new(cli.settings.min_instances)),
        BackendKind::Docker => Arc::new(DockerBackend::connect(cli.docker_project.clone(), cli.docker_service.clone()).await?),
        BackendKind::Keda => {
            let policy = cli.settings.policy();
            let keda = KedaBackend::new(policy.min, policy.per_instance_within_sla(), format!("{}-sla-backlog", cli.fleet.work_queue));
            keda.serve(cli.keda_addr, shutdown.clone()).await.with_context(|| format!("serving the KEDA external scaler on {}", cli.keda_addr))?;
            keda
        }
        BackendKind::Process => {
            let program = match &cli.processor_bin {
                Some(p) => p.clone(),
                None => std::env::current_exe().context("locating this binary")?.with_file_name("processor"),
            };
            anyhow::ensure!(program.is_file(), "process backend: no processor binary at {} (set --processor-bin)", program.display());
            if let Some(dir) = &cli.processor_log_dir {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            // The processors work on the agent's fleet (names as flags; the AMQP URL, which may hold
            // a password, through the environment rather than the command line).
            let f = &cli.fleet;
            let args = [
                ("--bucket", f.bucket.clone()),
                ("--work-queue", f.work_queue.clone()),
                ("--work-dlq", f.work_dlq()),
                ("--results-queue", f.results_queue.clone()),
                ("--trigger-exchange", f.trigger_exchange.clone()),
            ]
            .into_iter()
            .flat_map(|(k, v)| [k.to_string(), v])
            .collect();
            Arc::new(ProcessBackend::new(ProcessSpec {
                program,
                args,
                envs: vec![("AMQP_URL".into(), f.amqp_url.clone())],
                http_base: cli.processor_http_base,
                log_dir: cli.processor_log_dir.clone(),
                drain: Duration::from_secs(cli.drain_secs),
            }))
        }
    })
}

async fn start(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let aws = Aws::load().await.with_policy(cli.fleet.call_policy());
    let watched = scaling_agent::Watched {
        work: aws.queue(&cli.fleet.work_queue).await.context("opening the work queue")?,
        work_dlq: aws.queue(&cli.fleet.work_dlq()).await.context("opening the work dead-letter queue")?,
        results: aws.queue(&cli.fleet.results_queue).await.context("opening the results queue")?,
        results_dlq: aws.queue(&cli.fleet.results_dlq()).await.context("opening the results dead-letter queue")?,
    };
    if cli.once {
        println!("{}", serde_json::to_string_pretty(&scaling_agent::snapshot(&watched).await?)?);
        return Ok(());
    }
    let backend = backend(&cli, &shutdown).await?;
    let subscription = cli.fleet.subscribe(vec![ALL_WORK.to_string(), report_key(watched.work.name())], &shutdown);
    let deps = scaling_agent::Deps { watched, publish: cli.fleet.trigger_bus(), subscription, backend };
    scaling_agent::run(cli.settings, deps, shutdown).await?;
    Ok(())
}
