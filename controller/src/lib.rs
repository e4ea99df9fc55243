//! The controller service: consumes the results queue (and the work dead-letter queue), aggregates per
//! job idempotently, checkpoints job state to S3 before deleting the messages it applied, and writes
//! the report to the warehouse when every chunk of a job is accounted for.

pub mod aggregate;

use std::sync::Arc;
use std::time::Duration;

use shared::blob::BlobStore;
use shared::queue::Queue;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use aggregate::{Aggregator, Source};

/// Controller settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Long-poll wait of a receive, seconds (0-20).
    #[arg(long, env = "CONTROLLER_RECEIVE_WAIT_SECS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=20))]
    pub receive_wait_secs: u64,
    /// Grace period to finish the batch in hand on shutdown, seconds.
    #[arg(long, env = "CONTROLLER_DRAIN_SECS", default_value_t = 30)]
    pub drain_secs: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { receive_wait_secs: 20, drain_secs: 30 }
    }
}

/// The services a controller talks to.
#[derive(Clone)]
pub struct Deps {
    pub results: Arc<dyn Queue>,
    pub work_dlq: Arc<dyn Queue>,
    pub store: Arc<dyn BlobStore>,
}

/// Runs until `shutdown`: one loop on the results queue, one on the work dead-letter queue.
pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> shared::Result<()> {
    let agg = Arc::new(Mutex::new(Aggregator::new(deps.store.clone())));
    let tracker = TaskTracker::new();
    let wait = Duration::from_secs(settings.receive_wait_secs.min(20));
    for (queue, source) in [(deps.results.clone(), Source::Results), (deps.work_dlq.clone(), Source::WorkDeadLetter)] {
        let (agg, stop) = (agg.clone(), shutdown.clone());
        tracker.spawn(async move { consume(queue, source, agg, wait, stop).await });
    }
    tracing::info!(results = deps.results.name(), dlq = deps.work_dlq.name(), bucket = deps.store.bucket(), "controller started");
    shutdown.cancelled().await;
    shared::shutdown::drain(&tracker, Duration::from_secs(settings.drain_secs)).await;
    tracing::info!("controller stopped");
    Ok(())
}

async fn consume(queue: Arc<dyn Queue>, source: Source, agg: Arc<Mutex<Aggregator>>, wait: Duration, stop: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let msgs = tokio::select! {
            _ = stop.cancelled() => return,
            r = queue.receive(10, wait) => r,
        };
        let msgs = match msgs {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(queue = queue.name(), error = %e, "receive failed");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        if msgs.is_empty() {
            continue;
        }
        // Applied, checkpointed, then deleted; a crash anywhere before the delete redelivers the batch
        // and the checkpoint makes the replay a no-op.
        let done = agg.lock().await.apply(source, &msgs).await;
        if !done.delete.is_empty() {
            if let Err(e) = queue.delete(&done.delete).await {
                tracing::warn!(queue = queue.name(), error = %e, "delete failed; the results will be redelivered and ignored");
            }
        }
        for receipt in &done.park {
            let _ = queue.set_visibility(receipt, Duration::from_secs(12 * 3600)).await;
        }
    }
}
