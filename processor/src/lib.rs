//! The processor service: the adaptive listener engine (`fleet_engine`) on the work queue, with a
//! handler that bills the chunks the work items reference, sends the chunk results to the results queue
//! and only then completes (deletes, batched) the work items. A failing work item goes back with a
//! growing back-off and reaches the dead-letter queue after maxReceiveCount.

pub mod cli;
pub mod events;
pub mod handle;
pub mod listener;

use std::sync::Arc;
use std::time::Duration;

use fleet_engine::args::ListenerArgs;
use fleet_engine::{http, Engine};
use fleet_io::auth::{Key, Role};
use fleet_io::blob::BlobStore;
use fleet_io::queue::Queue;
use fleet_io::trigger::{Notifier, Subscription, TriggerBus};
use tokio_util::sync::CancellationToken;

/// Processor settings (the binary fills them from flags and env).
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub listener: ListenerArgs,
    /// Hard cap on a chunk's decompressed size, bytes (larger chunks are refused as corrupt).
    #[arg(long, env = "PROCESSOR_MAX_CHUNK_BYTES", default_value_t = 64 << 20)]
    pub max_chunk_bytes: u64,
    /// Grace period for in-flight work on shutdown, seconds.
    #[arg(long, env = "PROCESSOR_DRAIN_SECS", default_value_t = 30)]
    pub drain_secs: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { listener: ListenerArgs::default(), max_chunk_bytes: 64 << 20, drain_secs: 30 }
    }
}

/// The services a processor talks to.
#[derive(Clone)]
pub struct Deps {
    /// The work queue: a [`fleet_io::queue::Sharded`] one gets a listener per shard.
    pub work: Arc<dyn Queue>,
    /// Where expired work items of jobs past their deadline go (reason `expired`): sharded like the
    /// work queue, each shard's to its own.
    pub work_dlq: Option<Arc<dyn Queue>>,
    pub results: Arc<dyn Queue>,
    pub store: Arc<dyn BlobStore>,
    /// Work-detected triggers (bus subscription to the key of each of the work queue's shards), when
    /// enabled.
    pub triggers: Option<Subscription>,
    /// Where this processor announces the results (and dead letters) it puts on queues, and reports its
    /// throughput and work in hand to the scaling agent while it has work, when enabled.
    pub publish: Option<Arc<dyn TriggerBus>>,
    /// The processor's role key (`--signing-key`): every chunk result and failure report it sends is
    /// signed with it, so that a controller with a keyring counts them; `None`: sent unsigned.
    pub signing_key: Option<Key>,
}

impl Deps {
    /// Work queue, results queue and store only: no dead-letter queue for expired work items, no triggers.
    pub fn new(work: Arc<dyn Queue>, results: Arc<dyn Queue>, store: Arc<dyn BlobStore>) -> Deps {
        Deps { work, work_dlq: None, results, store, triggers: None, publish: None, signing_key: None }
    }
}

/// At most one results trigger per this interval (a controller parks only after a whole empty long
/// poll, far longer).
const ANNOUNCE_INTERVAL: Duration = Duration::from_millis(100);
/// An instance holding work reports to the scaling agent this often.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(2);

/// Starts a listener on each shard of the work queue (one for a queue that is not sharded), and the
/// state endpoint when configured. Each shard's consumers scale and back off on their own; expired work
/// items go to the shard's own dead-letter queue.
pub async fn start(settings: &Settings, deps: Deps, shutdown: &CancellationToken) -> fleet_io::Result<Vec<Engine>> {
    events::register_metrics();
    say_signing(deps.signing_key.as_ref());
    let cfg = settings.listener.engine(deps.triggers.is_some());
    let shards = shards(&deps);
    // One results notifier per partition for every shard's listener (its rate limit is the instance's).
    let results: Vec<Notifier> = match &deps.publish {
        Some(bus) => fleet_io::queue::partitions(&deps.results).iter().map(|q| Notifier::new(bus.clone(), q.name(), "processor", ANNOUNCE_INTERVAL)).collect(),
        None => Vec::new(),
    };
    let mut engines = Vec::with_capacity(shards.len());
    for (work, dlq) in shards {
        let announce = listener::Announce {
            results: results.clone(),
            dead_letters: deps.publish.as_ref().zip(dlq.as_ref()).map(|(bus, q)| Notifier::new(bus.clone(), q.name(), "processor", ANNOUNCE_INTERVAL)),
        };
        let fifo = fleet_io::config::is_fifo(work.name());
        let handler = Arc::new(
            listener::WorkHandler::new(work.name(), deps.results.clone(), deps.store.clone(), settings.max_chunk_bytes, announce, fifo)
                .with_signing_key(deps.signing_key.clone()),
        );
        let engine = Engine::start(work, dlq, handler, cfg.clone()).await?;
        if let Some(sub) = &deps.triggers {
            engine.follow_triggers(sub, shutdown.clone());
        }
        engines.push(engine);
    }
    if let Some(bus) = &deps.publish {
        fleet_engine::report::spawn_reporter(engines.clone(), bus.clone(), fleet_engine::report::instance_id(), REPORT_INTERVAL, shutdown.clone());
    }
    http::serve_from_args(&settings.listener, &engines, shutdown).await?;
    Ok(engines)
}

/// Says once, at start, how the processor's messages are signed: unsigned (info), with its key (its
/// role and id, never the secret), or with a key of another role than a processor's (a warning: a
/// controller with a keyring counts results and failure reports only from a processor's key).
fn say_signing(key: Option<&Key>) {
    match key {
        None => tracing::info!(
            "no signing key (--signing-key / FLEET_SIGNING_KEY_FILE): results and failure reports are sent unsigned; a controller with a keyring (--role-keys) will not count them"
        ),
        Some(k) if k.role() != Role::Processor => tracing::warn!(
            role = %k.role(),
            key_id = k.id(),
            "the signing key is not a processor's: a controller with a keyring will not count the results and failure reports it signs"
        ),
        Some(k) => tracing::info!(role = %k.role(), key_id = k.id(), "results and failure reports are signed"),
    }
}

/// A shard of the work queue and its dead-letter queue.
type Shard = (Arc<dyn Queue>, Option<Arc<dyn Queue>>);

/// The work queue's shards, each with its dead-letter queue (the same one for every shard when the
/// dead-letter queue given is not sharded alike).
fn shards(deps: &Deps) -> Vec<Shard> {
    let work: Vec<Arc<dyn Queue>> = match deps.work.as_sharded() {
        Some(s) => s.shards().to_vec(),
        None => vec![deps.work.clone()],
    };
    let dlqs: Option<Vec<Arc<dyn Queue>>> = deps.work_dlq.as_ref().map(|d| match d.as_sharded() {
        Some(s) if s.shards().len() == work.len() => s.shards().to_vec(),
        _ => vec![d.clone(); work.len()],
    });
    work.into_iter().enumerate().map(|(i, w)| (w, dlqs.as_ref().map(|d| d[i].clone()))).collect()
}

/// Runs the processor until `shutdown`, then drains: stops receiving, returns buffered work items,
/// finishes in-flight ones within the grace period and flushes completions (every shard's listener
/// under the one grace period).
pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> fleet_io::Result<()> {
    let engines = start(&settings, deps, &shutdown).await?;
    shutdown.cancelled().await;
    let grace = Duration::from_secs(settings.drain_secs);
    futures::future::join_all(engines.iter().map(|e| e.shutdown(grace))).await;
    tracing::info!("processor stopped");
    Ok(())
}
