//! `controller`: parses configuration, sets up tracing and clients, runs the controller until SIGTERM.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use fleet_io::config::{Aws, FleetArgs, LogArgs};

/// Billing fleet controller: aggregates chunk results per job into the S3 warehouse.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    settings: controller::Settings,
    #[command(flatten)]
    log: LogArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    fleet_io::shutdown::serve(cli.log.log_json, |shutdown| start(cli, shutdown)).await
}

async fn start(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let aws = Aws::load().await.with_policy(cli.fleet.call_policy());
    let results = aws.queue(&cli.fleet.results_queue).await.context("opening the results queue")?;
    let work_dlq = aws.queue(&cli.fleet.work_dlq()).await.context("opening the work dead-letter queue")?;
    let results_dlq = aws.queue(&cli.fleet.results_dlq()).await.context("opening the results dead-letter queue")?;
    let store = aws.store(&cli.fleet.bucket);
    let work = aws.queue(&cli.fleet.work_queue).await.context("opening the work queue")?;
    use fleet_io::queue::Queue;
    let keys = [results.name(), work_dlq.name(), results_dlq.name()].map(fleet_io::trigger::work_key).to_vec();
    let triggers = cli.fleet.subscribe(keys, &shutdown);
    controller::run(
        cli.settings,
        controller::Deps { results, work_dlq, results_dlq, store, work: Some(work), triggers, publish: cli.fleet.trigger_bus() },
        shutdown,
    )
    .await?;
    Ok(())
}
