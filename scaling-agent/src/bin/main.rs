//! `scaling-agent`: parses configuration, sets up tracing and clients, watches the queues until SIGTERM
//! (or prints one snapshot as JSON with `--once`).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use shared::config::{Aws, FleetArgs, LogArgs};

/// Billing fleet scaling agent: watches queue depths and publishes work-detected triggers.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    settings: scaling_agent::Settings,
    /// Print one snapshot of the queue depths as JSON and exit.
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    log: LogArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    shared::shutdown::serve(cli.log.log_json, |shutdown| start(cli, shutdown)).await
}

async fn start(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let aws = Aws::load().await;
    let watched = scaling_agent::Watched {
        work: aws.queue(&cli.fleet.work_queue).await.context("opening the work queue")?,
        work_dlq: aws.queue(&cli.fleet.work_dlq()).await.context("opening the work dead-letter queue")?,
        results: aws.queue(&cli.fleet.results_queue).await.context("opening the results queue")?,
    };
    if cli.once {
        println!("{}", serde_json::to_string_pretty(&scaling_agent::snapshot(&watched).await?)?);
        return Ok(());
    }
    scaling_agent::run(cli.settings, watched, cli.fleet.trigger_bus(), shutdown).await?;
    Ok(())
}
