//! `processor`: parses configuration, sets up tracing and clients, runs the processor until SIGTERM.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use fleet_io::config::Aws;
use processor::cli::Cli;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    fleet_io::shutdown::serve(cli.log.log_json, |shutdown| start(cli, shutdown)).await
}

async fn start(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let aws = Aws::load().await.with_policy(cli.fleet.call_policy());
    let (work, work_dlq) = aws.work_queues(&cli.fleet, aws.policy).await.context("opening the work queue, its shards and their dead-letter queues")?;
    let (results, _) = aws.results_queues(&cli.fleet, aws.policy).await.context("opening the results queue and its partitions")?;
    let store = aws.store(&cli.fleet.bucket);
    let triggers = cli.fleet.subscribe(fleet_io::trigger::work_keys(&[work.as_ref()]), &shutdown);
    let publish = cli.fleet.trigger_bus();
    let signing_key = cli.fleet.signing_key.clone();
    processor::run(cli.settings, processor::Deps { work, work_dlq: Some(work_dlq), results, store, triggers, publish, signing_key }, shutdown).await?;
    Ok(())
}
