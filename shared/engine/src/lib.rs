//! The adaptive listener engine: one queue, consumer tasks that scale themselves (dynamic consumers),
//! back off when the queue is empty and park when a trigger can wake them, a throttle (concurrency
//! limit and priority buffer) between receiving and processing, batched completion of deletes and
//! visibility changes, a visibility heartbeat, retries with back-off, FIFO group order, and a bounded
//! drain. Processor and controller run their queues through it; each seed concept lives in its own
//! module.

pub mod args;
pub mod backoff;
pub mod completion;
pub mod dynamic_consumers;
pub mod heartbeat;
#[cfg(feature = "http")]
pub mod http;
pub mod report;
pub mod state;
pub mod throttle;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{broadcast, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use backoff::{default_queue_empty, EmptyContext, EmptyDecision, IdleBackoff, RetryBackoff};
use completion::{BatchSettings, Batcher};
use dynamic_consumers::{decide, Activity, ScaleDecision, ScalingPolicy, WorkRules};
use fleet_io::error::Result;
use fleet_io::lock;
use fleet_io::queue::{Attrs, Message, Outgoing, Queue, QueueInfo};
use fleet_io::trigger::Subscription;
use heartbeat::Heartbeat;
use throttle::{LimitsChange, Throttle, ThrottleLimits};

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scaling: ScalingPolicy,
    pub backoff: IdleBackoff,
    /// Long-poll wait of a receive (at most 20 s); it counts as part of the idle cycle.
    pub receive_wait: Duration,
    /// Messages per receive (1-10).
    pub receive_batch: usize,
    /// Consumers wanted for a queue depth when work is detected.
    pub work_rules: WorkRules,
    pub throttle: ThrottleLimits,
    /// Delete and visibility-change batching.
    pub completion: BatchSettings,
    pub retry: RetryBackoff,
    /// Extend visibility at half the timeout while a message is in hand.
    pub heartbeat: bool,
    /// Stop extending a message after this long.
    pub max_processing: Duration,
    /// Work-detected triggers can wake a parked consumer.
    pub triggers: bool,
    /// A parked consumer polls anyway after this long (a lost trigger costs at most this delay).
    pub park_poll: Option<Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scaling: ScalingPolicy::DEFAULT,
            backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(10) },
            receive_wait: Duration::from_secs(20),
            receive_batch: 10,
            work_rules: WorkRules::default(),
            throttle: ThrottleLimits { max_concurrency: 16, buffer: 20, ttl: None },
            completion: BatchSettings::default(),
            retry: RetryBackoff { base: Duration::from_secs(2), max: Duration::from_secs(300) },
            heartbeat: true,
            max_processing: Duration::from_secs(15 * 60),
            triggers: false,
            park_poll: Some(Duration::from_secs(600)),
        }
    }
}

/// What became of a message handed to the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Processed: delete it (batched).
    Done,
    /// The handler completes it later through [`Completions`] (e.g. after a checkpoint).
    Deferred,
    /// Failed: back to the queue after a back-off that grows with its receive count; on the last
    /// allowed receive the handler's `on_poison` runs and it goes back at once (to the dead-letter queue).
    Failed(String),
    /// Back to the queue after this delay, not a failure.
    Release(Duration),
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
    /// Handles messages (at most `batch_size`); returns one outcome per message, in order.
    async fn handle(&self, msgs: &[Message], done: &Completions) -> Vec<Outcome>;
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

/// Completing messages later, on the queue they came from (batched).
#[derive(Clone)]
pub struct Completions {
    deletes: Arc<Batcher<String>>,
    visibility: Arc<Batcher<(String, Duration)>>,
}

impl Completions {
    pub fn delete(&self, receipt: String) {
        self.deletes.push(0, receipt);
    }

    pub fn release(&self, receipt: String, after: Duration) {
        self.visibility.push(0, (receipt, after));
    }
}

/// Counters.
#[derive(Debug, Default)]
pub struct Stats {
    pub receives: AtomicU64,
    pub empty_receives: AtomicU64,
    pub received: AtomicU64,
    pub processed: AtomicU64,
    pub failed: AtomicU64,
    pub expired: AtomicU64,
    pub evicted: AtomicU64,
    pub extended: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct ConsumerSlot {
    activity: Activity,
    parked: bool,
    retiring: bool,
}

struct Consumers {
    next_id: usize,
    list: BTreeMap<usize, ConsumerSlot>,
    /// (time, active consumers) at every change, for the state and benchmarks.
    timeline: Vec<(Instant, usize)>,
}

impl Consumers {
    fn active(&self) -> usize {
        self.list.values().filter(|c| !c.parked && !c.retiring).count()
    }

    fn note(&mut self) {
        let n = self.active();
        if self.timeline.last().is_none_or(|&(_, last)| last != n) {
            self.timeline.push((Instant::now(), n));
            if self.timeline.len() > 10_000 {
                self.timeline.drain(..5_000);
            }
        }
    }
}

struct Inner {
    queue: Arc<dyn Queue>,
    dead_letter: Option<Arc<dyn Queue>>,
    info: QueueInfo,
    cfg: EngineConfig,
    handler: Arc<dyn Handler>,
    throttle: Mutex<Throttle<Message>>,
    dispatch: Notify,
    room: Notify,
    wake: Notify,
    /// Wakes so far: a consumer that was receiving when one came does not wait after an empty receive.
    wakes: AtomicU64,
    /// A trigger can reach this engine now (triggers on and the bus subscription live): only then does
    /// an idle main consumer park; otherwise it polls at its back-off cap.
    triggers_live: AtomicBool,
    consumers: Mutex<Consumers>,
    heartbeat: Mutex<Heartbeat>,
    heartbeat_changed: Notify,
    completions: Completions,
    stop_receiving: CancellationToken,
    stop_all: CancellationToken,
    consumer_tasks: TaskTracker,
    work_tasks: TaskTracker,
    service_tasks: TaskTracker,
    stats: Stats,
    started: Instant,
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
        let q = queue.clone();
        let deletes = Batcher::start(
            1,
            cfg.completion,
            Arc::new(move |_, batch: Vec<String>| {
                let q = q.clone();
                Box::pin(async move {
                    let r = q.delete_batch(&batch).await;
                    to_retry(q.name(), "DeleteMessageBatch", batch, r, |r| r.as_str())
                })
            }),
        );
        let q = queue.clone();
        let visibility = Batcher::start(
            1,
            cfg.completion,
            Arc::new(move |_, batch: Vec<(String, Duration)>| {
                let q = q.clone();
                Box::pin(async move {
                    let r = q.set_visibility_batch(&batch).await;
                    to_retry(q.name(), "ChangeMessageVisibilityBatch", batch, r, |(r, _)| r.as_str())
                })
            }),
        );
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
        let inner = Arc::new(Inner {
            heartbeat: Mutex::new(Heartbeat::new(info.visibility_timeout, cfg.max_processing)),
            throttle: Mutex::new(Throttle::new(cfg.throttle)),
            consumers: Mutex::new(Consumers { next_id: 0, list: BTreeMap::new(), timeline: Vec::new() }),
            queue,
            dead_letter,
            info,
            cfg,
            handler,
            dispatch: Notify::new(),
            room: Notify::new(),
            wake: Notify::new(),
            wakes: AtomicU64::new(0),
            heartbeat_changed: Notify::new(),
            completions: Completions { deletes, visibility },
            stop_receiving: CancellationToken::new(),
            stop_all: CancellationToken::new(),
            consumer_tasks: TaskTracker::new(),
            work_tasks: TaskTracker::new(),
            service_tasks: TaskTracker::new(),
            stats: Stats::default(),
            triggers_live: AtomicBool::new(true),
            started: Instant::now(),
        });
        inner.service_tasks.spawn(dispatch_loop(inner.clone()));
        if inner.cfg.heartbeat {
            inner.service_tasks.spawn(heartbeat_loop(inner.clone()));
        }
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

    pub fn completions(&self) -> Completions {
        self.inner.completions.clone()
    }

    pub fn stats(&self) -> &Stats {
        &self.inner.stats
    }

    /// Consumers active now (not parked, not stopping).
    pub fn active_consumers(&self) -> usize {
        lock(&self.inner.consumers).active()
    }

    /// (seconds since start, active consumers) at every change.
    pub fn timeline(&self) -> Vec<(f64, usize)> {
        let start = self.inner.started;
        lock(&self.inner.consumers).timeline.iter().map(|(t, n)| (t.duration_since(start).as_secs_f64(), *n)).collect()
    }

    pub fn limits(&self) -> ThrottleLimits {
        lock(&self.inner.throttle).limits()
    }

    /// Changes the throttle at runtime; messages that no longer fit go back to the queue.
    pub fn set_limits(&self, change: &LimitsChange) -> ThrottleLimits {
        let (limits, back) = {
            let mut t = lock(&self.inner.throttle);
            let limits = t.limits().apply(change);
            let back = t.set_limits(limits);
            (limits, back)
        };
        tracing::info!(queue = self.queue_name(), ?limits, returned = back.len(), "throttle limits changed");
        for m in back {
            release(&self.inner, &m.receipt, Duration::ZERO);
        }
        self.inner.room.notify_waiters();
        self.inner.dispatch.notify_one();
        limits
    }

    /// Work was detected elsewhere (a trigger): wake waiting consumers and raise the consumer count
    /// for `depth` (queried when unknown).
    pub async fn wake(&self, depth: Option<u64>) {
        self.inner.wakes.fetch_add(1, Ordering::SeqCst);
        self.inner.wake.notify_waiters();
        work_detected(&self.inner, depth).await;
    }

    /// Wakes the engine on every work-detected trigger for its queue until `stop`, and follows the
    /// subscription's liveness: while the bus is down no consumer parks (a parked one is woken to poll at
    /// its back-off cap), and when it comes back the engine polls once (a trigger published meanwhile was
    /// lost) and may park again.
    pub fn follow_triggers(&self, sub: &Subscription, stop: CancellationToken) {
        let engine = self.clone();
        let mut rx = sub.events.subscribe();
        let mut live = sub.live.clone();
        self.inner.service_tasks.spawn(async move {
            let inner = &engine.inner;
            let mut was_live = *live.borrow_and_update();
            inner.triggers_live.store(was_live, Ordering::SeqCst);
            if !was_live {
                inner.wake.notify_waiters();
            }
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = inner.stop_receiving.cancelled() => return,
                    changed = live.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let now_live = *live.borrow_and_update();
                        inner.triggers_live.store(now_live, Ordering::SeqCst);
                        if now_live != was_live {
                            tracing::info!(queue = engine.queue_name(), live = now_live, "work-detected triggers {}", if now_live { "reach this listener again" } else { "unreachable: polling instead of parking" });
                            // Down: parked consumers go back to polling. Back: one poll for what a
                            // lost trigger announced.
                            inner.wakes.fetch_add(1, Ordering::SeqCst);
                            inner.wake.notify_waiters();
                        }
                        was_live = now_live;
                    }
                    ev = rx.recv() => match ev {
                        Ok(ev) if ev.queue == engine.queue_name() => {
                            tracing::debug!(source = %ev.source, messages = ev.messages, "work-detected trigger");
                            engine.wake((ev.messages > 0).then_some(ev.messages)).await;
                        }
                        Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                        Err(broadcast::error::RecvError::Closed) => return,
                    }
                }
            }
        });
    }

    /// Whether a trigger can reach this engine now (see [`Engine::follow_triggers`]).
    pub fn triggers_live(&self) -> bool {
        self.inner.cfg.triggers && self.inner.triggers_live.load(Ordering::SeqCst)
    }

    /// Stops receiving, returns buffered messages that have not started to the queue, lets receives
    /// under way end with their long poll (what they bring goes back at once), and waits for messages
    /// in progress; all of it within `grace`. Returns whether everything finished.
    pub async fn quiesce(&self, grace: Duration) -> bool {
        let inner = &self.inner;
        let deadline = Instant::now() + grace;
        inner.stop_receiving.cancel();
        inner.wake.notify_waiters();
        let back = lock(&inner.throttle).take_all();
        if !back.is_empty() {
            tracing::info!(queue = self.queue_name(), returned = back.len(), "returning buffered messages to the queue");
        }
        for m in back {
            release(inner, &m.receipt, Duration::ZERO);
        }
        inner.consumer_tasks.close();
        let polls_ended = tokio::time::timeout_at(deadline, inner.consumer_tasks.wait()).await.is_ok();
        inner.work_tasks.close();
        let finished = polls_ended && tokio::time::timeout_at(deadline, inner.work_tasks.wait()).await.is_ok();
        if !finished {
            tracing::warn!(queue = self.queue_name(), grace_s = grace.as_secs(), polls_ended, "messages still in progress after the grace period");
        }
        // FIFO messages held for a group still in progress after the grace period.
        let held = lock(&inner.throttle).take_held();
        for m in held {
            release(inner, &m.receipt, Duration::ZERO);
        }
        finished
    }

    /// Stops the dispatcher and heartbeat and completes the batchers: with `drain`, pending deletes and
    /// visibility changes are flushed; without, they are dropped (those messages come back).
    pub async fn finish(&self, drain: bool) {
        let inner = &self.inner;
        inner.stop_receiving.cancel();
        inner.stop_all.cancel();
        inner.service_tasks.close();
        inner.service_tasks.wait().await;
        inner.completions.deletes.complete(drain).await;
        inner.completions.visibility.complete(drain).await;
        tracing::info!(queue = self.queue_name(), drained = drain, "listener stopped");
    }

    /// `quiesce` then `finish(true)`.
    pub async fn shutdown(&self, grace: Duration) {
        self.quiesce(grace).await;
        self.finish(true).await;
    }
}

/// What a batch call hands back to the batcher for another attempt: the entries that failed, or the
/// whole batch when the call itself failed and may succeed later.
fn to_retry<T>(queue: &str, op: &str, batch: Vec<T>, r: Result<Vec<String>>, receipt: impl Fn(&T) -> &str) -> Vec<T> {
    match r {
        Ok(failed) if failed.is_empty() => Vec::new(),
        Ok(failed) => batch.into_iter().filter(|t| failed.iter().any(|f| f == receipt(t))).collect(),
        Err(e) => {
            tracing::warn!(queue, error = %e, entries = batch.len(), op, "batch call failed");
            if e.is_retryable() {
                batch
            } else {
                Vec::new()
            }
        }
    }
}

fn spawn_consumer(inner: &Arc<Inner>) -> Option<usize> {
    if inner.stop_receiving.is_cancelled() {
        return None;
    }
    let id = {
        let mut c = lock(&inner.consumers);
        let id = c.next_id;
        c.next_id += 1;
        c.list.insert(id, ConsumerSlot { activity: Activity::new(&inner.cfg.scaling), parked: false, retiring: false });
        c.note();
        id
    };
    inner.consumer_tasks.spawn(consume(inner.clone(), id));
    Some(id)
}

async fn wait_for_room(inner: &Inner) -> Option<usize> {
    loop {
        let notified = inner.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Room must not start a receive once stopping (a returned message was received again at once).
        if inner.stop_receiving.is_cancelled() {
            return None;
        }
        let n = lock(&inner.throttle).reserve(inner.cfg.receive_batch);
        if n > 0 {
            return Some(n);
        }
        tokio::select! {
            _ = inner.stop_receiving.cancelled() => return None,
            _ = notified => {}
        }
    }
}

/// Gives back room reserved for a receive that brought nothing (or less): consumers waiting for room
/// must hear of it (one waited forever behind a long poll that came back empty).
fn unreserve(inner: &Inner, n: usize) {
    lock(&inner.throttle).unreserve(n);
    inner.room.notify_waiters();
}

/// Waits `d` (None: until woken). `Some(true)`: woken, also by a wake since `wakes` was read (a trigger
/// that arrived during the receive that came back empty); `Some(false)`: waited; `None`: stopping.
async fn pause(inner: &Inner, d: Option<Duration>, wakes: u64) -> Option<bool> {
    let notified = inner.wake.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    if inner.wakes.load(Ordering::SeqCst) != wakes {
        return Some(true);
    }
    tokio::select! {
        _ = inner.stop_receiving.cancelled() => None,
        _ = notified => Some(true),
        _ = sleep_until(d.map(|d| Instant::now() + d)) => Some(false),
    }
}

/// How long a receive may take beyond its long-poll wait before it is abandoned.
const RECEIVE_GRACE: Duration = Duration::from_secs(10);
/// How long past its long-poll wait a receive in flight at a stop is waited for.
const STOP_POLL_MARGIN: Duration = Duration::from_secs(1);

async fn consume(inner: Arc<Inner>, id: usize) {
    let mut idle: u32 = 0;
    let mut iterations: u64 = 0;
    let mut error_backoff = Duration::from_millis(100);
    loop {
        if lock(&inner.consumers).list.get(&id).is_none_or(|c| c.retiring) {
            break;
        }
        let Some(max) = wait_for_room(&inner).await else {
            break;
        };
        let started = Instant::now();
        let wakes = inner.wakes.load(Ordering::SeqCst);
        // A stop does not cut the receive short: the queue would keep serving a poll cut on this side
        // and could hand it messages nobody sees until their visibility timeout (a restart cost a job
        // 30 s). The poll ends within its wait; what it brings goes straight back (see `accept`).
        // A receive that outlives its long poll by far hangs on a dead connection: give up on it, and
        // sooner when stopping (at the poll's end plus a second).
        let limit = inner.cfg.receive_wait + RECEIVE_GRACE;
        let receive = tokio::time::timeout(limit, inner.queue.receive(max as u32, inner.cfg.receive_wait));
        tokio::pin!(receive);
        let answer = tokio::select! {
            r = &mut receive => r,
            _ = inner.stop_receiving.cancelled() => {
                let end = started + inner.cfg.receive_wait + STOP_POLL_MARGIN;
                tokio::time::timeout_at(end, receive).await.unwrap_or_else(Err)
            }
        };
        let received = answer.unwrap_or_else(|_| {
            Err(fleet_io::Error::Service {
                service: fleet_io::error::Service::Sqs,
                operation: "ReceiveMessage",
                detail: format!("no answer on queue {} within {} s; abandoned", inner.queue.name(), started.elapsed().as_secs()),
                retryable: true,
            })
        });
        iterations += 1;
        bump(&inner.stats.receives, 1);
        // One look at the consumer set: record this iteration; the main consumer is the oldest alive.
        let (main, alive) = {
            let mut c = lock(&inner.consumers);
            if let (Ok(msgs), Some(slot)) = (&received, c.list.get_mut(&id)) {
                slot.activity.record(!msgs.is_empty());
            }
            (c.list.keys().next() == Some(&id), c.list.values().filter(|s| !s.retiring).count())
        };
        match received {
            Err(e) => {
                unreserve(&inner, max);
                inner.handler.on_error(ErrorEvent::Receive { error: &e });
                tracing::warn!(queue = inner.queue.name(), consumer = id, error = %e, retry_in_ms = error_backoff.as_millis() as u64, "receive failed");
                if pause(&inner, Some(error_backoff), wakes).await.is_none() {
                    break;
                }
                error_backoff = (error_backoff * 2).min(Duration::from_secs(10));
                continue;
            }
            Ok(msgs) => {
                error_backoff = Duration::from_millis(100);
                if !msgs.is_empty() {
                    let was_idle = idle > 0;
                    idle = 0;
                    accept(&inner, msgs, max);
                    if was_idle {
                        work_detected(&inner, None).await;
                    }
                } else {
                    unreserve(&inner, max);
                    bump(&inner.stats.empty_receives, 1);
                    idle = idle.saturating_add(1);
                    let ctx = EmptyContext {
                        idle_count: idle,
                        waited: started.elapsed(),
                        main,
                        alive,
                        min_consumers: inner.cfg.scaling.min_consumers,
                        triggers: inner.cfg.triggers && inner.triggers_live.load(Ordering::SeqCst),
                    };
                    match inner.handler.queue_empty(&inner.cfg.backoff, ctx) {
                        EmptyDecision::Stop if !main => {
                            tracing::debug!(queue = inner.queue.name(), consumer = id, idle, "idle consumer stops");
                            break;
                        }
                        EmptyDecision::Park | EmptyDecision::Stop => {
                            set_parked(&inner, id, true);
                            tracing::debug!(queue = inner.queue.name(), consumer = id, "parked until work is detected");
                            let woke = pause(&inner, inner.cfg.park_poll, wakes).await;
                            set_parked(&inner, id, false);
                            match woke {
                                None => break,
                                Some(true) => idle = 0,
                                Some(false) => {}
                            }
                        }
                        EmptyDecision::Wait(d) => match pause(&inner, Some(d.saturating_sub(started.elapsed())), wakes).await {
                            None => break,
                            Some(true) => idle = 0,
                            Some(false) => {}
                        },
                    }
                }
            }
        }
        if main && iterations.is_multiple_of(u64::from(inner.cfg.scaling.sample_rate)) {
            sample(&inner);
        }
    }
    let mut c = lock(&inner.consumers);
    c.list.remove(&id);
    c.note();
}

fn set_parked(inner: &Inner, id: usize, parked: bool) {
    let mut c = lock(&inner.consumers);
    if let Some(s) = c.list.get_mut(&id) {
        s.parked = parked;
    }
    c.note();
}

/// The main consumer's scaling check.
fn sample(inner: &Arc<Inner>) {
    let decision = {
        let c = lock(&inner.consumers);
        let main = c.list.keys().next().copied();
        decide(&inner.cfg.scaling, c.list.iter().filter(|(_, s)| !s.retiring && !s.parked).map(|(id, s)| (*id, &s.activity, Some(*id) == main)))
    };
    match decision {
        ScaleDecision::Up => {
            if let Some(id) = spawn_consumer(inner) {
                tracing::debug!(queue = inner.queue.name(), consumer = id, "all consumers busy: one more");
            }
        }
        ScaleDecision::Down(id) => {
            let mut c = lock(&inner.consumers);
            if let Some(s) = c.list.get_mut(&id) {
                // It stops at the end of its current iteration: a long poll is never cut for this.
                s.retiring = true;
            }
            c.note();
            drop(c);
            inner.wake.notify_waiters();
            tracing::debug!(queue = inner.queue.name(), consumer = id, "idle consumer stopped");
        }
        ScaleDecision::Hold => {}
    }
}

/// QueueWorkDetected: raise the consumers at once to the optimal count for the queue depth.
async fn work_detected(inner: &Arc<Inner>, depth: Option<u64>) {
    if inner.stop_receiving.is_cancelled() {
        return;
    }
    let depth = match depth {
        Some(d) => d,
        None => match inner.queue.depth().await {
            Ok(d) => d.visible,
            Err(e) => {
                tracing::debug!(queue = inner.queue.name(), error = %e, "queue depth unavailable");
                return;
            }
        },
    };
    let target = inner.cfg.scaling.clamp(inner.cfg.work_rules.optimal(depth));
    // Parked consumers count: a wake has just woken them (counting them as idle spawned a second
    // consumer on every trigger that woke a parked engine).
    let active = lock(&inner.consumers).list.values().filter(|c| !c.retiring).count();
    if target > active {
        tracing::debug!(queue = inner.queue.name(), depth, from = active, to = target, "work detected: raising consumers");
    }
    for _ in active..target {
        spawn_consumer(inner);
    }
}

fn accept(inner: &Arc<Inner>, msgs: Vec<Message>, reserved: usize) {
    let now = Instant::now();
    bump(&inner.stats.received, msgs.len() as u64);
    if inner.stop_receiving.is_cancelled() {
        // A poll that was under way at the stop: none of it starts here, all of it goes straight back.
        unreserve(inner, reserved);
        tracing::info!(queue = inner.queue.name(), returned = msgs.len(), "stopping: returning what the last poll brought");
        for m in msgs {
            release(inner, &m.receipt, Duration::ZERO);
        }
        return;
    }
    {
        let mut hb = lock(&inner.heartbeat);
        for m in &msgs {
            hb.track(&m.receipt, now);
        }
    }
    inner.heartbeat_changed.notify_one();
    let mut back = Vec::new();
    {
        let mut t = lock(&inner.throttle);
        t.unreserve(reserved);
        for m in msgs {
            let group = fifo_group(inner, &m);
            let priority = m.attrs.priority;
            back.extend(t.push(m, priority, group, now));
        }
    }
    for m in back {
        bump(&inner.stats.evicted, 1);
        inner.handler.on_error(ErrorEvent::Evicted { msg: &m });
        release(inner, &m.receipt, Duration::ZERO);
    }
    inner.dispatch.notify_one();
    // Fewer messages than reserved leave room for another receive.
    inner.room.notify_waiters();
}

/// The message group that orders a message: only on a FIFO queue.
fn fifo_group(inner: &Inner, m: &Message) -> Option<String> {
    if inner.info.fifo {
        m.attrs.group.clone()
    } else {
        None
    }
}

fn release(inner: &Inner, receipt: &str, after: Duration) {
    lock(&inner.heartbeat).untrack(receipt);
    inner.completions.release(receipt.to_string(), after);
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

async fn expire(inner: Arc<Inner>, m: Message) {
    bump(&inner.stats.expired, 1);
    let past_deadline = m.attrs.deadline_ms.is_some_and(|d| now_ms() >= d);
    if let (true, Some(dlq)) = (past_deadline, &inner.dead_letter) {
        let out = Outgoing { body: m.body.clone(), attrs: Attrs { reason: Some("expired".into()), ..m.attrs.clone() } };
        match dlq.send_messages(&[out]).await {
            Ok(_) => {
                inner.handler.on_error(ErrorEvent::Expired { msg: &m, dead_lettered: true });
                lock(&inner.heartbeat).untrack(&m.receipt);
                inner.completions.delete(m.receipt);
                return;
            }
            Err(e) => {
                tracing::warn!(queue = inner.queue.name(), error = %e, "could not dead-letter an expired message; returning it")
            }
        }
    }
    inner.handler.on_error(ErrorEvent::Expired { msg: &m, dead_lettered: false });
    let group = fifo_group(&inner, &m);
    let back = lock(&inner.throttle).give_back(m, group);
    if let Some(m) = back {
        release(&inner, &m.receipt, Duration::ZERO);
    }
}

/// Marks a batch's messages finished in the throttle even if the handler panics.
struct Running {
    inner: Arc<Inner>,
    groups: Vec<Option<String>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut t = lock(&self.inner.throttle);
        let back: Vec<Message> = self.groups.iter().flat_map(|g| t.finish(g.as_deref())).collect();
        drop(t);
        for m in back {
            release(&self.inner, &m.receipt, Duration::ZERO);
        }
        self.inner.dispatch.notify_one();
        self.inner.room.notify_waiters();
    }
}

async fn dispatch_loop(inner: Arc<Inner>) {
    let batch = inner.handler.batch_size().max(1);
    loop {
        let notified = inner.dispatch.notified();
        let (ready, expired, next) = {
            let mut t = lock(&inner.throttle);
            let expired = t.expire(Instant::now());
            let mut ready = Vec::new();
            while let Some(x) = t.pop_ready() {
                ready.push(x);
            }
            (ready, expired, t.next_expiry())
        };
        if !expired.is_empty() {
            inner.room.notify_waiters();
        }
        for m in expired {
            inner.work_tasks.spawn(expire(inner.clone(), m));
        }
        let mut ready = ready.into_iter().peekable();
        while ready.peek().is_some() {
            let (msgs, groups): (Vec<Message>, Vec<Option<String>>) = ready.by_ref().take(batch).unzip();
            let running = Running { inner: inner.clone(), groups };
            inner.work_tasks.spawn(process(inner.clone(), msgs, running));
        }
        tokio::select! {
            _ = inner.stop_all.cancelled() => return,
            _ = notified => {}
            _ = sleep_until(next) => {}
        }
    }
}

async fn process(inner: Arc<Inner>, msgs: Vec<Message>, running: Running) {
    let outcomes = inner.handler.handle(&msgs, &inner.completions).await;
    if outcomes.len() != msgs.len() {
        tracing::error!(queue = inner.queue.name(), messages = msgs.len(), outcomes = outcomes.len(), "handler returned the wrong number of outcomes");
    }
    let mut outcomes = outcomes.into_iter();
    for (i, m) in msgs.iter().enumerate() {
        let outcome = outcomes.next().unwrap_or(Outcome::Release(Duration::ZERO));
        lock(&inner.heartbeat).untrack(&m.receipt);
        match outcome {
            Outcome::Done => {
                bump(&inner.stats.processed, 1);
                inner.completions.delete(m.receipt.clone());
            }
            Outcome::Deferred => bump(&inner.stats.processed, 1),
            Outcome::Release(after) => inner.completions.release(m.receipt.clone(), after),
            Outcome::Failed(reason) => {
                bump(&inner.stats.failed, 1);
                let last = inner.info.max_receive_count.is_some_and(|max| m.receive_count >= max);
                let delay = if last {
                    inner.handler.on_poison(m, &reason).await;
                    Duration::ZERO
                } else {
                    inner.cfg.retry.delay(m.receive_count)
                };
                tracing::warn!(
                    queue = inner.queue.name(), message_id = %m.id, receive_count = m.receive_count, last_attempt = last,
                    retry_in_s = delay.as_secs(), %reason, "message failed"
                );
                // FIFO: the group's later messages must not overtake it; they go back too, and become
                // visible no later than it (a visible message behind an invisible one of its group
                // could be received first): a second earlier on a delayed retry, right after it on
                // the last attempt.
                let successors = match running.groups.get(i).and_then(Option::as_deref) {
                    Some(g) => lock(&inner.throttle).take_group(g),
                    None => Vec::new(),
                };
                if delay.is_zero() {
                    inner.completions.release(m.receipt.clone(), delay);
                }
                let ahead = if delay > Duration::from_secs(1) { delay - Duration::from_secs(1) } else { delay };
                for b in &successors {
                    release(&inner, &b.receipt, ahead);
                }
                if !delay.is_zero() {
                    inner.completions.release(m.receipt.clone(), delay);
                }
            }
        }
    }
    drop(running);
}

async fn heartbeat_loop(inner: Arc<Inner>) {
    loop {
        let notified = inner.heartbeat_changed.notified();
        let (due, next, visibility) = {
            let mut hb = lock(&inner.heartbeat);
            let due = hb.due(Instant::now());
            (due, hb.next_due(), hb.visibility())
        };
        if !due.extend.is_empty() {
            bump(&inner.stats.extended, due.extend.len() as u64);
            tracing::debug!(queue = inner.queue.name(), messages = due.extend.len(), "extending visibility");
        }
        for r in due.extend {
            inner.completions.release(r, visibility);
        }
        for r in &due.overdue {
            inner.handler.on_error(ErrorEvent::Overdue { receipt: r });
            tracing::warn!(queue = inner.queue.name(), "message passed the maximum processing time; no longer extended");
        }
        tokio::select! {
            _ = inner.stop_all.cancelled() => return,
            _ = notified => {}
            _ = sleep_until(next) => {}
        }
    }
}

#[cfg(test)]
mod tests;
