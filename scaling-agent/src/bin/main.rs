//! `scaling-agent`: parses configuration, sets up tracing, clients and the scaling backend
//! (`scaling_agent::factory`), runs the
//! agent until SIGTERM (or prints one snapshot of the queue depths as JSON with `--once`).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use fleet_io::config::Aws;
use fleet_io::trigger::{instance_report_key, ALL_WORK};
use scaling_agent::cli::{Cli, Cmd};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Cmd::Simulate(args)) = &cli.command {
        let days = scaling_agent::simulate::run_all(args);
        print!("{}", scaling_agent::simulate::table(args, &days));
        if let Some(path) = &args.svg {
            if let Err(e) = scaling_agent::simulate_svg::draw(args, &days, path) {
                eprintln!("scaling-agent simulate: cannot write the picture: {e}");
                return ExitCode::from(1);
            }
            eprintln!("drawn into {}", path.display());
        }
        return ExitCode::SUCCESS;
    }
    fleet_io::shutdown::serve(cli.log.log_json, |shutdown| start(cli, shutdown)).await
}

async fn start(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let aws = Aws::load().await.with_policy(cli.fleet.call_policy());
    let (work, work_dlq) = aws.work_queues(&cli.fleet, aws.policy).await.context("opening the work queue, its shards and their dead-letter queues")?;
    // Every partition of the results queue, as one queue each (depths summed, triggers on each).
    let (results, results_dlq) =
        aws.results_queues(&cli.fleet, aws.policy).await.context("opening the results queue, its partitions and their dead-letter queues")?;
    let watched = scaling_agent::Watched { work: work.clone(), work_dlq, results, results_dlq };
    if cli.once {
        println!("{}", serde_json::to_string_pretty(&scaling_agent::snapshot(&watched).await?)?);
        return Ok(());
    }
    let backend = cli.backend.build(&cli.fleet, &cli.settings, &shutdown).await?;
    let subscription = cli.fleet.subscribe(vec![ALL_WORK.to_string(), instance_report_key(work.name())], &shutdown);
    let deps = scaling_agent::Deps { watched, publish: cli.fleet.trigger_bus(), subscription, backend };
    scaling_agent::run(cli.settings, deps, shutdown).await?;
    Ok(())
}
