//! `controller`: parses configuration, sets up tracing and clients, runs the controller until SIGTERM.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use controller::cli::Cli;
use fleet_io::config::Aws;

/// mimalloc rather than the system allocator: a job of a million accounts grows one large table and
/// a million small allocations, and glibc's arenas kept 170 MB more resident than the heap held (peak
/// RSS 415 MiB over a 245 MiB heap; see docs/performance.md, "The controller at scale"). Its v2, whose
/// freed pages go back to the OS after 10 ms: v3 keeps them a second, and a burst of results decoded,
/// added and freed then peaked at 295-311 MiB instead of about 200.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    fleet_io::shutdown::serve(cli.log.log_json, |shutdown| start(cli, shutdown)).await
}

async fn start(cli: Cli, shutdown: tokio_util::sync::CancellationToken) -> anyhow::Result<()> {
    let aws = Aws::load().await.with_policy(cli.fleet.call_policy());
    let (results, results_dlq) =
        aws.results_queues(&cli.fleet, aws.policy).await.context("opening the results queue, its partitions and their dead-letter queues")?;
    let (work, work_dlq) = aws.work_queues(&cli.fleet, aws.policy).await.context("opening the work queue, its shards and their dead-letter queues")?;
    let store = aws.store(&cli.fleet.bucket);
    // The timings against one another (`controller::timings`), with the work queue's visibility timeout.
    let visibility = match work.info().await {
        Ok(i) => Some(i.visibility_timeout),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the work queue's visibility timeout; the timings check assumes the provisioned one");
            None
        }
    };
    // And the results queues' (the longest of the partitions' and their dead-letter queues').
    let mut results_visibility = None;
    for q in [results.as_ref(), results_dlq.as_ref()] {
        match q.info().await {
            Ok(i) => results_visibility = results_visibility.max(Some(i.visibility_timeout)),
            Err(e) => {
                tracing::warn!(queue = q.name(), error = %e, "could not read a results queue's visibility timeout; the timings check assumes the provisioned one")
            }
        }
    }
    if let Err(broken) = cli.settings.timings(cli.fleet.call_policy().deadline, visibility, results_visibility).check() {
        if !cli.settings.unchecked_timings {
            anyhow::bail!("the controller's timings do not agree:\n  {}\n(--unchecked-timings starts anyway, for test rigs)", broken.join("\n  "));
        }
        for b in &broken {
            tracing::warn!(problem = %b, "timings that do not agree, accepted (--unchecked-timings)");
        }
    }
    // Every partition's and the work dead-letter queue's every shard: a processor announces results on
    // their partition's, dead letters on their shard's.
    let triggers = cli.fleet.subscribe(fleet_io::trigger::work_keys(&[results.as_ref(), work_dlq.as_ref(), results_dlq.as_ref()]), &shutdown);
    controller::run(
        cli.settings,
        controller::Deps { results, work_dlq, results_dlq, store, work: Some(work), triggers, publish: cli.fleet.trigger_bus() },
        shutdown,
    )
    .await?;
    Ok(())
}
