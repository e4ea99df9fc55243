//! The adaptive listener engine: one queue, consumer tasks that scale themselves (dynamic consumers),
//! back off when the queue is empty and park when a trigger can wake them, a throttle (concurrency
//! limit and priority buffer) between receiving and processing, batched completion of deletes and
//! visibility changes, a visibility heartbeat, retries with back-off, FIFO group order, and a bounded
//! drain. Processor and controller run their queues through it; each seed concept lives in its own
//! module.

pub mod admin;
pub mod args;
pub mod backoff;
pub mod completion;
mod config;
mod consumer;
mod dispatch;
pub mod dynamic_consumers;
mod events;
mod expiry;
pub mod heartbeat;
#[cfg(feature = "http")]
pub mod http;
mod inner;
pub mod metrics;
pub mod report;
pub mod state;
pub mod throttle;
mod trigger;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

// The tests (`use super::*`) name these; the engine's own code reaches them through `events` and `inner`.
#[cfg(test)]
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
use tokio_util::sync::CancellationToken;

use backoff::{default_queue_empty, EmptyContext, EmptyDecision, IdleBackoff};
pub use completion::{Completions, Kept, Visibility};
pub use config::EngineConfig;
use consumer::{spawn_consumer, work_detected, Consumers};
use dispatch::dispatch_loop;
use dynamic_consumers::ScalingPolicy;
pub use events::Stats;
use fleet_io::breaker::Breaker;
use fleet_io::error::Result;
use fleet_io::lock;
use fleet_io::queue::{Delivery, Message, Queue, QueueInfo};
use heartbeat::{heartbeat_loop, Heartbeat};
use inner::{Buffer, InHand, Lifecycle, Observed, Wakeups};
use throttle::{LimitsChange, Throttle, ThrottleLimits};

/// What the engine does with a delivery the handler gives back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Processed: delete it (batched).
    Done,
    /// Failed: back to the queue after a back-off that grows with its receive count; on the last
    /// allowed receive the handler's `on_poison` runs and it goes back at once (to the dead-letter queue).
    Failed(String),
    /// Back to the queue after this delay, not a failure.
    Release(Duration),
    /// A dependency failed (no answer, refused, 5xx, throttled), not the message: it is held, its
    /// visibility kept, and handed to the handler again once the dependency answers (its breaker
    /// closes). It never counts toward poison; one whose dependency keeps failing for it alone while
    /// every breaker stays closed is treated as `Failed` after a few tries.
    Unavailable(String),
}

/// Events for the error hook.
#[derive(Debug)]
pub enum ErrorEvent<'a> {
    /// Waited in the buffer longer than the TTL; dead-lettered (reason `expired`) when its deadline passed.
    Expired { msg: &'a Message, dead_lettered: bool },
    /// Evicted from a full buffer by a message of higher priority; back on the queue.
    Evicted { msg: &'a Message },
    /// Still in hand after the maximum processing time: no longer extended.
    Overdue { receipt: &'a str },
    /// A receive call failed.
    Receive { error: &'a fleet_io::Error },
}

/// The message handler and the engine's hooks.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Most messages handed over in one call.
    fn batch_size(&self) -> usize {
        1
    }
    /// Handles deliveries (at most `batch_size`). Each is either given back with its outcome, for the
    /// engine to complete, or kept: a handler that keeps one completes it itself, later, through
    /// [`Completions`] (e.g. once a checkpoint covers it; [`Completions::keep`]). One dropped without a
    /// completion comes back after its visibility timeout.
    async fn handle(&self, msgs: Vec<Delivery>, done: &Completions) -> Vec<(Delivery, Outcome)>;
    /// The breakers of the dependencies handling needs (e.g. S3 and SQS): while one is open the
    /// consumers receive nothing and held messages wait.
    fn dependencies(&self) -> Vec<Arc<Breaker>> {
        Vec::new()
    }
    /// Messages of this queue the handler keeps through an outage itself (shown as held).
    fn holding(&self) -> usize {
        0
    }
    /// Messages just received, before they wait for a slot: called once per receive (a delivery
    /// handed to `handle` again, after an outage, is not received again).
    fn on_received(&self, _msgs: &[Delivery]) {}
    /// A message failed on its last allowed receive (it goes to the dead-letter queue next).
    async fn on_poison(&self, _msg: &Message, _reason: &str) {}
    /// The error hook.
    fn on_error(&self, event: ErrorEvent<'_>) {
        tracing::debug!(?event, "listener event");
    }
    /// The `QueueEmpty` decision.
    fn queue_empty(&self, backoff: &IdleBackoff, ctx: EmptyContext) -> EmptyDecision {
        default_queue_empty(backoff, ctx)
    }
}

/// The state every task of one engine shares (consumers, dispatcher, work tasks, heartbeat,
/// completion batchers, the HTTP state endpoint), grouped by what each part guards (`inner`). Locks
/// are std mutexes held for a few statements, never across an await.
struct Inner {
    /// The queue listened to (receives, depth; completions go through `completions`).
    queue: Arc<dyn Queue>,
    /// Where `expiry` sends a message whose job deadline passed while it waited (reason `expired`).
    dead_letter: Option<Arc<dyn Queue>>,
    /// The queue's visibility timeout, maxReceiveCount and FIFO flag, read once at start.
    info: QueueInfo,
    /// Settings, clamped to what SQS allows at start; never changed after (the throttle's limits
    /// change through `buffer`).
    cfg: EngineConfig,
    /// The service's handler and hooks.
    handler: Arc<dyn Handler>,
    /// The breakers of the handler's dependencies (read at start): consumers pause while one is open.
    breakers: Vec<Arc<Breaker>>,
    /// Batched deletes and releases on `queue` (the handler's kept deliveries complete here too).
    completions: Completions,
    /// The throttle (received messages waiting for a slot, slots in use) and its signals.
    buffer: Buffer,
    /// Wake-ups of paused and parked consumers, and whether a trigger can reach them.
    wakeups: Wakeups,
    /// The consumer set: written by consumers (activity, parked, leaving), the main consumer's sample
    /// (one more, one retiring) and `work_detected`; read by the state endpoint.
    consumers: Mutex<Consumers>,
    /// The receipts in hand and when the heartbeat extends them.
    in_hand: InHand,
    /// Stop tokens and task trackers.
    lifecycle: Lifecycle,
    /// Counters, held deliveries, the last depth and progress: what the state endpoint and health read.
    observed: Observed,
}

/// Sleeps until `t`, or forever when there is none (a `select!` arm that may have no deadline).
pub(crate) async fn sleep_until(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// A running listener on one queue.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Reads the queue's settings and starts `min_consumers` consumers, the dispatcher, the heartbeat
    /// and the completion batchers.
    pub async fn start(queue: Arc<dyn Queue>, dead_letter: Option<Arc<dyn Queue>>, handler: Arc<dyn Handler>, cfg: EngineConfig) -> Result<Engine> {
        let info = queue.info().await?;
        Ok(Engine::start_with_info(queue, dead_letter, handler, cfg, info))
    }

    /// As [`Engine::start`], with the queue settings given.
    pub fn start_with_info(
        queue: Arc<dyn Queue>,
        dead_letter: Option<Arc<dyn Queue>>,
        handler: Arc<dyn Handler>,
        cfg: EngineConfig,
        info: QueueInfo,
    ) -> Engine {
        let completions = Completions::start(queue.clone(), cfg.completion);
        let cfg = EngineConfig {
            receive_batch: cfg.receive_batch.clamp(1, 10),
            receive_wait: cfg.receive_wait.min(Duration::from_secs(20)),
            scaling: ScalingPolicy {
                min_consumers: cfg.scaling.min_consumers.max(1),
                max_consumers: cfg.scaling.max_consumers.max(cfg.scaling.min_consumers).max(1),
                sample_rate: cfg.scaling.sample_rate.max(1),
                ..cfg.scaling
            },
            ..cfg
        };
        let breakers = handler.dependencies().into_iter().chain(queue.breaker()).fold(Vec::<Arc<Breaker>>::new(), |mut v, b| {
            if !v.iter().any(|x| Arc::ptr_eq(x, &b)) {
                v.push(b);
            }
            v
        });
        let inner = Arc::new(Inner {
            in_hand: InHand::new(Heartbeat::new(info.visibility_timeout, cfg.max_processing)),
            buffer: Buffer::new(Throttle::new(cfg.throttle)),
            consumers: Mutex::new(Consumers::new()),
            queue,
            dead_letter,
            info,
            cfg,
            handler,
            wakeups: Wakeups::new(),
            completions,
            lifecycle: Lifecycle::new(),
            breakers,
            observed: Observed::new(),
        });
        let tasks = &inner.lifecycle.service_tasks;
        tasks.spawn(dispatch_loop(inner.clone()));
        if inner.cfg.heartbeat {
            tasks.spawn(heartbeat_loop(inner.clone()));
        }
        tasks.spawn(state::depth_loop(inner.clone()));
        for _ in 0..inner.cfg.scaling.min_consumers {
            spawn_consumer(&inner);
        }
        tracing::info!(
            queue = inner.queue.name(),
            min = inner.cfg.scaling.min_consumers,
            max = inner.cfg.scaling.max_consumers,
            concurrency = inner.cfg.throttle.max_concurrency,
            buffer = inner.cfg.throttle.buffer,
            visibility_s = info.visibility_timeout.as_secs(),
            fifo = info.fifo,
            "listener started"
        );
        Engine { inner }
    }

    pub fn queue_name(&self) -> &str {
        self.inner.queue.name()
    }

    /// Whether a trigger or report naming `queue` is about this engine's queue (one of its shards, for
    /// a sharded queue).
    pub fn answers_to(&self, queue: &str) -> bool {
        self.inner.queue.shard_names().iter().any(|s| s == queue)
    }

    pub fn completions(&self) -> Completions {
        self.inner.completions.clone()
    }

    pub fn stats(&self) -> &Stats {
        &self.inner.observed.stats
    }

    /// Consumers active now (not parked, not stopping).
    pub fn active_consumers(&self) -> usize {
        lock(&self.inner.consumers).active()
    }

    /// (seconds since start, active consumers) at every change.
    pub fn timeline(&self) -> Vec<(f64, usize)> {
        let start = self.inner.observed.started;
        lock(&self.inner.consumers).timeline.iter().map(|(t, n)| (t.duration_since(start).as_secs_f64(), *n)).collect()
    }

    pub fn limits(&self) -> ThrottleLimits {
        lock(&self.inner.buffer.throttle).limits()
    }

    /// Changes the throttle at runtime; messages that no longer fit go back to the queue.
    pub fn set_limits(&self, change: &LimitsChange) -> ThrottleLimits {
        let (limits, back) = {
            let mut t = lock(&self.inner.buffer.throttle);
            let limits = t.limits().apply(change);
            let back = t.set_limits(limits);
            (limits, back)
        };
        tracing::info!(queue = self.queue_name(), ?limits, returned = back.len(), "throttle limits changed");
        for m in back {
            release(&self.inner, m, Duration::ZERO);
        }
        self.inner.buffer.changed();
        limits
    }

    /// Work was detected elsewhere (a trigger): wake waiting consumers and raise the consumer count
    /// for `depth` (queried when unknown).
    pub async fn wake(&self, depth: Option<u64>) {
        self.inner.wakeups.wake();
        work_detected(&self.inner, depth).await;
    }

    /// Stops receiving, returns buffered messages that have not started to the queue, lets receives
    /// under way end with their long poll (what they bring goes back at once), and waits for messages
    /// in progress; all of it within `grace`. Returns whether everything finished.
    pub async fn quiesce(&self, grace: Duration) -> bool {
        let inner = &self.inner;
        let deadline = Instant::now() + grace;
        inner.lifecycle.stop_receiving.cancel();
        inner.wakeups.rouse();
        let back = lock(&inner.buffer.throttle).take_all();
        if !back.is_empty() {
            tracing::info!(queue = self.queue_name(), returned = back.len(), "returning buffered messages to the queue");
        }
        for m in back {
            release(inner, m, Duration::ZERO);
        }
        let l = &inner.lifecycle;
        l.consumer_tasks.close();
        let polls_ended = tokio::time::timeout_at(deadline, l.consumer_tasks.wait()).await.is_ok();
        l.work_tasks.close();
        let finished = polls_ended && tokio::time::timeout_at(deadline, l.work_tasks.wait()).await.is_ok();
        if !finished {
            tracing::warn!(queue = self.queue_name(), grace_s = grace.as_secs(), polls_ended, "messages still in progress after the grace period");
        }
        // FIFO messages held for a group still in progress after the grace period.
        let held = lock(&inner.buffer.throttle).take_held();
        for m in held {
            release(inner, m, Duration::ZERO);
        }
        finished
    }

    /// Stops the dispatcher and heartbeat and completes the batchers: with `drain`, pending deletes and
    /// visibility changes are flushed; without, they are dropped (those messages come back).
    pub async fn finish(&self, drain: bool) {
        let inner = &self.inner;
        let l = &inner.lifecycle;
        l.stop_receiving.cancel();
        l.stop_all.cancel();
        l.service_tasks.close();
        l.service_tasks.wait().await;
        // What polls under way at the stop brought and no later poll's end returned (a poll dropped
        // with its reservation): back now, before the completions end.
        consumer::return_kept_at_stop(inner);
        inner.completions.finish(drain).await;
        tracing::info!(queue = self.queue_name(), drained = drain, "listener stopped");
    }

    /// `quiesce` then `finish(true)`.
    pub async fn shutdown(&self, grace: Duration) {
        self.quiesce(grace).await;
        self.finish(true).await;
    }
}

/// Returns a delivery to the queue after `after`: it is no longer in hand.
fn release(inner: &Inner, d: Delivery, after: Duration) {
    inner.in_hand.untrack(d.receipt());
    inner.completions.release(d, after);
}

#[cfg(test)]
mod tests;
