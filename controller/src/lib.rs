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

/// Checkpoint at least this often while messages are pending.
const FLUSH_INTERVAL: Duration = Duration::from_millis(250);
/// ... or as soon as this many messages are pending.
const FLUSH_MESSAGES: usize = 100;

/// Runs until `shutdown`: one loop on the results queue, one on the work dead-letter queue, and a timer
/// that checkpoints pending work; on shutdown the last checkpoint is written and its messages deleted.
pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> shared::Result<()> {
    let agg = Arc::new(Mutex::new(Aggregator::new(deps.store.clone())));
    let tracker = TaskTracker::new();
    let wait = Duration::from_secs(settings.receive_wait_secs.min(20));
    for source in [Source::Results, Source::WorkDeadLetter] {
        let (agg, deps, stop) = (agg.clone(), deps.clone(), shutdown.clone());
        tracker.spawn(async move { consume(source, deps, agg, wait, stop).await });
    }
    {
        let (agg, deps, stop) = (agg.clone(), deps.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(FLUSH_INTERVAL);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => flush(&agg, &deps).await,
                }
            }
        });
    }
    tracing::info!(results = deps.results.name(), dlq = deps.work_dlq.name(), bucket = deps.store.bucket(), "controller started");
    shutdown.cancelled().await;
    shared::shutdown::drain(&tracker, Duration::from_secs(settings.drain_secs)).await;
    flush(&agg, &deps).await;
    tracing::info!("controller stopped");
    Ok(())
}

async fn flush(agg: &Mutex<Aggregator>, deps: &Deps) {
    let done = {
        let mut agg = agg.lock().await;
        if agg.pending() == 0 {
            return;
        }
        agg.flush().await
    };
    delete(deps, done).await;
}

fn queue_of(deps: &Deps, source: Source) -> &Arc<dyn Queue> {
    match source {
        Source::Results => &deps.results,
        Source::WorkDeadLetter => &deps.work_dlq,
    }
}

async fn delete(deps: &Deps, receipts: Vec<(Source, String)>) {
    for source in [Source::Results, Source::WorkDeadLetter] {
        let these: Vec<String> = receipts.iter().filter(|(s, _)| *s == source).map(|(_, r)| r.clone()).collect();
        if these.is_empty() {
            continue;
        }
        let queue = queue_of(deps, source);
        if let Err(e) = queue.delete(&these).await {
            tracing::warn!(queue = queue.name(), error = %e, "delete failed; the messages will be redelivered and ignored");
        }
    }
}

async fn consume(source: Source, deps: Deps, agg: Arc<Mutex<Aggregator>>, wait: Duration, stop: CancellationToken) {
    let queue = queue_of(&deps, source).clone();
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
        // Applied in memory, checkpointed, then deleted; a crash anywhere before the delete redelivers
        // the messages and the checkpoint makes the replay a no-op.
        let (mut done, park) = {
            let mut agg = agg.lock().await;
            let applied = agg.apply(source, &msgs).await;
            let mut done = applied.delete;
            if agg.pending() >= FLUSH_MESSAGES {
                done.extend(agg.flush().await);
            }
            (done, applied.park)
        };
        delete(&deps, std::mem::take(&mut done)).await;
        for receipt in &park {
            let _ = queue.set_visibility(receipt, Duration::from_secs(12 * 3600)).await;
        }
    }
}
