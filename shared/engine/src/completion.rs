//! Why one file: the batcher and the completions built on it share one ordering promise (what a receipt
//! may still have sent for it, a release before an extension); apart, that promise would have no home.
//!
//! Batched completion (seed 001, MultiProducerConcurrentConsumer). Producers push items into numbered
//! slots (one per queue, so a receipt handle is completed only on the queue it came from). A slot is
//! flushed through the pump when `batch_size` items have gathered or `push_interval` has passed since
//! the oldest one arrived; while a slot holds full batches it fans out up to `max_concurrency` pumps at
//! once. Items leave in FIFO order. The pump returns the items that failed; they are retried (at the
//! front) up to `max_attempts`. `complete(drain = true)` flushes everything and waits for the pumps;
//! `complete(drain = false)` drops what is pending. [`Completions`] are the two batchers of one queue
//! (deletes, releases) that deliveries are completed through; a [`Kept`] delivery is bound to them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::sleep_until;
use fleet_io::lock;
use fleet_io::queue::{Delivery, Handback, Queue, Receipt};

/// Batching parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    pub batch_size: usize,
    pub push_interval: Duration,
    /// Pumps running at once per slot.
    pub max_concurrency: usize,
    /// Attempts per item before it is given up (logged; the message then comes back by itself).
    pub max_attempts: u32,
}

impl Default for BatchSettings {
    fn default() -> Self {
        BatchSettings { batch_size: 10, push_interval: Duration::from_millis(50), max_concurrency: 4, max_attempts: 5 }
    }
}

/// The pump: takes the slot number and a batch, returns the items that failed.
pub type Pump<T> = Arc<dyn Fn(usize, Vec<T>) -> BoxFuture<'static, Vec<T>> + Send + Sync>;

/// Items waiting in a slot, with their attempt counts, and when the oldest of them arrived.
struct Pending<T> {
    items: VecDeque<(T, u32)>,
    oldest: Option<Instant>,
}

struct Slot<T> {
    pending: Mutex<Pending<T>>,
    notify: Notify,
    permits: Arc<Semaphore>,
}

/// Counters of a batcher.
#[derive(Debug, Default)]
pub struct BatchStats {
    pub retried: AtomicU64,
    pub given_up: AtomicU64,
}

/// The multi-producer concurrent consumer.
pub struct Batcher<T> {
    slots: Vec<Arc<Slot<T>>>,
    /// Kept for what is pushed after `complete` (see `push`).
    pump: Pump<T>,
    settings: BatchSettings,
    stop: CancellationToken,
    drain: Arc<AtomicBool>,
    tasks: TaskTracker,
    pub stats: Arc<BatchStats>,
}

impl<T: Send + 'static> Batcher<T> {
    /// Starts `slots` slot tasks that call `pump`.
    pub fn start(slots: usize, settings: BatchSettings, pump: Pump<T>) -> Arc<Batcher<T>> {
        let settings = BatchSettings {
            batch_size: settings.batch_size.max(1),
            max_concurrency: settings.max_concurrency.max(1),
            max_attempts: settings.max_attempts.max(1),
            ..settings
        };
        let b = Arc::new(Batcher {
            slots: (0..slots.max(1))
                .map(|_| {
                    Arc::new(Slot {
                        pending: Mutex::new(Pending { items: VecDeque::new(), oldest: None }),
                        notify: Notify::new(),
                        permits: Arc::new(Semaphore::new(settings.max_concurrency)),
                    })
                })
                .collect(),
            pump: pump.clone(),
            settings,
            stop: CancellationToken::new(),
            drain: Arc::new(AtomicBool::new(true)),
            tasks: TaskTracker::new(),
            stats: Arc::new(BatchStats::default()),
        });
        for (i, slot) in b.slots.iter().enumerate() {
            let run = SlotRun {
                index: i,
                slot: slot.clone(),
                settings,
                pump: pump.clone(),
                stop: b.stop.clone(),
                drain: b.drain.clone(),
                tasks: b.tasks.clone(),
                stats: b.stats.clone(),
            };
            b.tasks.spawn(run.run());
        }
        b
    }

    /// Adds an item to a slot (slot numbers wrap). Once the batcher is completed (or completing) an
    /// item goes out on a call of its own: a slot nobody flushes any more would drop it without a
    /// word (a handler that outlived its listener's stop, releasing what it held: the message stayed
    /// invisible for the hold's two minutes; found by the simulation).
    pub fn push(&self, slot: usize, item: T) {
        if self.stop.is_cancelled() {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let (pump, index) = (self.pump.clone(), slot % self.slots.len());
                    rt.spawn(async move {
                        // Tried three times: nothing flushes it later (a failed call left a message
                        // held for the hold's two minutes; the simulation, fresh seed 171054357).
                        let mut items = vec![item];
                        for attempt in 0..3u32 {
                            items = pump(index, items).await;
                            if items.is_empty() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                        }
                        tracing::warn!(
                            slot = index,
                            "a completion after the batcher's end failed three times; the message comes back after its visibility timeout"
                        );
                    });
                }
                Err(_) => tracing::warn!(slot, "a completion after the batcher's end, outside a runtime: dropped"),
            }
            return;
        }
        let s = &self.slots[slot % self.slots.len()];
        push_items(s, std::iter::once((item, 0)), self.settings.batch_size, false);
    }

    /// Items waiting in all slots.
    pub fn pending(&self) -> usize {
        self.slots.iter().map(|s| lock(&s.pending).items.len()).sum()
    }

    /// Stops the batcher: with `drain`, flushes every slot and waits for all pumps; without, drops
    /// what is pending (and waits only for pumps already running).
    pub async fn complete(&self, drain: bool) {
        self.drain.store(drain, Ordering::SeqCst);
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

fn push_items<T>(s: &Slot<T>, items: impl IntoIterator<Item = (T, u32)>, batch_size: usize, front: bool) {
    let mut p = lock(&s.pending);
    let was_empty = p.items.is_empty();
    let mut v: Vec<(T, u32)> = items.into_iter().collect();
    if front {
        while let Some(it) = v.pop() {
            p.items.push_front(it);
        }
    } else {
        p.items.extend(v);
    }
    if was_empty {
        p.oldest.get_or_insert_with(Instant::now);
    }
    let full = p.items.len() >= batch_size;
    drop(p);
    if was_empty || full {
        s.notify.notify_one();
    }
}

struct SlotRun<T> {
    index: usize,
    slot: Arc<Slot<T>>,
    settings: BatchSettings,
    pump: Pump<T>,
    stop: CancellationToken,
    drain: Arc<AtomicBool>,
    tasks: TaskTracker,
    stats: Arc<BatchStats>,
}

impl<T: Send + 'static> SlotRun<T> {
    fn take(&self, all: bool) -> Vec<(T, u32)> {
        let mut p = lock(&self.slot.pending);
        if !all && p.items.len() < self.settings.batch_size {
            let due = p.oldest.is_some_and(|t| t.elapsed() >= self.settings.push_interval);
            if !due || p.items.is_empty() {
                return Vec::new();
            }
        }
        let n = p.items.len().min(self.settings.batch_size);
        let batch: Vec<(T, u32)> = p.items.drain(..n).collect();
        p.oldest = if p.items.is_empty() { None } else { Some(Instant::now()) };
        batch
    }

    async fn flush(&self, batch: Vec<(T, u32)>) {
        let permit = match self.slot.permits.clone().acquire_owned().await {
            Ok(p) => p,
            Err(_) => return,
        };
        let (pump, index, slot, settings, stats) = (self.pump.clone(), self.index, self.slot.clone(), self.settings, self.stats.clone());
        self.tasks.spawn(async move {
            let attempts: Vec<u32> = batch.iter().map(|(_, a)| *a).collect();
            // The pump hands back failed items by value; their attempt counts are the highest of the
            // batch (items are not comparable), which errs towards giving up sooner, never later.
            let attempt = attempts.iter().copied().max().unwrap_or(0) + 1;
            let failed = pump(index, batch.into_iter().map(|(t, _)| t).collect()).await;
            // The permit is held until failed items are back in the slot, so a drain that has all
            // permits knows nothing is in flight.
            let _permit = permit;
            if failed.is_empty() {
                return;
            }
            if attempt >= settings.max_attempts {
                stats.given_up.fetch_add(failed.len() as u64, Ordering::Relaxed);
                tracing::warn!(slot = index, items = failed.len(), attempts = attempt, "batch entries still failing; giving up");
                return;
            }
            stats.retried.fetch_add(failed.len() as u64, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20 << attempt.min(8))).await;
            push_items(&slot, failed.into_iter().map(|t| (t, attempt)), settings.batch_size, true);
        });
    }

    async fn run(self) {
        loop {
            loop {
                let batch = self.take(false);
                if batch.is_empty() {
                    break;
                }
                self.flush(batch).await;
            }
            let deadline = lock(&self.slot.pending).oldest.map(|t| t + self.settings.push_interval);
            tokio::select! {
                biased;
                _ = self.stop.cancelled() => break,
                _ = self.slot.notify.notified() => {}
                _ = sleep_until(deadline) => {}
            }
        }
        if !self.drain.load(Ordering::SeqCst) {
            let dropped = lock(&self.slot.pending).items.drain(..).count();
            if dropped > 0 {
                tracing::info!(slot = self.index, dropped, "stopping without drain: pending items dropped");
            }
            return;
        }
        // Drain: flush until empty, including items that failed and came back for another attempt.
        loop {
            let batch = self.take(true);
            if !batch.is_empty() {
                self.flush(batch).await;
                continue;
            }
            // Wait for running pumps (they may hand back failed items), then look again.
            let all = self.settings.max_concurrency as u32;
            match self.slot.permits.acquire_many(all).await {
                Ok(p) => drop(p),
                Err(_) => return,
            }
            if lock(&self.slot.pending).items.is_empty() {
                return;
            }
        }
    }
}

/// Completing deliveries on the queue they came from, batched (seed 001): deletes and releases
/// gather per queue and leave in DeleteMessageBatch and ChangeMessageVisibilityBatch calls of up to 10;
/// so do visibility extensions of messages kept in hand (borrowed receipts: keeping a message longer
/// is not a completion).
#[derive(Clone)]
pub struct Completions {
    queue: Arc<str>,
    deletes: Arc<Batcher<Receipt>>,
    visibility: Arc<Batcher<(Receipt, Duration)>>,
    extensions: Arc<Batcher<(String, Duration)>>,
    /// Receipts released or deleted lately: an extension of one still waiting in its batcher is
    /// dropped, never sent after the release (the two batchers flush in no set order, and an
    /// extension sent after a release made the message invisible again for the extension's time).
    /// A release of a receipt whose extension is already in flight waits for that call's answer
    /// (the two calls could land in either order; found by the simulation, seed 61207294: a hold's
    /// extension landed after the hand-back and left two messages invisible for two minutes).
    done_with: Arc<Mutex<DoneWith>>,
}

/// How long a released or deleted receipt is remembered (extensions wait in their batcher far less;
/// a controller's stop shows what a hold extended up to its two minutes before, and a `show` of a
/// receipt completed meanwhile must stay a no-op for that long).
const DONE_WITH_FOR: Duration = Duration::from_secs(180);

/// Receipts extended, and those of them released or deleted lately (only extended messages are
/// remembered: the rest cost nothing).
#[derive(Default)]
struct DoneWith {
    extended: std::collections::HashSet<String>,
    done: std::collections::HashSet<String>,
    order: VecDeque<(Instant, String)>,
    /// Receipts in an extension call not answered yet (how many such calls), and the releases that
    /// wait for them.
    in_flight: std::collections::HashMap<String, usize>,
    deferred: Vec<(Receipt, Duration)>,
}

impl std::fmt::Debug for Completions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completions").field("queue", &self.queue).finish_non_exhaustive()
    }
}

impl Completions {
    /// Batchers completing on `queue` (an engine starts its own; tests and tools may start one alone).
    pub fn start(queue: Arc<dyn Queue>, settings: BatchSettings) -> Completions {
        let q = queue.clone();
        let deletes = Batcher::start(
            1,
            settings,
            Arc::new(move |_, batch: Vec<Receipt>| {
                let q = q.clone();
                Box::pin(async move { to_retry(q.name(), "DeleteMessageBatch", q.delete_batch(batch).await) })
            }),
        );
        let q = queue.clone();
        let visibility = Batcher::start(
            1,
            settings,
            Arc::new(move |_, batch: Vec<(Receipt, Duration)>| {
                let q = q.clone();
                Box::pin(async move { to_retry(q.name(), "ChangeMessageVisibilityBatch", q.release_batch(batch).await) })
            }),
        );
        let q = queue.clone();
        let done_with: Arc<Mutex<DoneWith>> = Arc::default();
        let released = done_with.clone();
        let releases = visibility.clone();
        let extensions = Batcher::start(
            1,
            settings,
            Arc::new(move |_, mut batch: Vec<(String, Duration)>| {
                let (q, released, releases) = (q.clone(), released.clone(), releases.clone());
                {
                    let mut d = lock(&released);
                    batch.retain(|(r, _)| !d.done.contains(r));
                    for (r, _) in &batch {
                        *d.in_flight.entry(r.clone()).or_default() += 1;
                    }
                }
                Box::pin(async move {
                    if batch.is_empty() {
                        return Vec::new();
                    }
                    let refs: Vec<(&str, Duration)> = batch.iter().map(|(r, d)| (r.as_str(), *d)).collect();
                    let answer = q.extend(&refs).await;
                    // Answered: the releases that waited for this call go now.
                    let ready: Vec<(Receipt, Duration)> = {
                        let mut d = lock(&released);
                        for (r, _) in &batch {
                            if let std::collections::hash_map::Entry::Occupied(mut e) = d.in_flight.entry(r.clone()) {
                                *e.get_mut() -= 1;
                                if *e.get() == 0 {
                                    e.remove();
                                }
                            }
                        }
                        let d = &mut *d;
                        let (ready, wait): (Vec<_>, Vec<_>) =
                            std::mem::take(&mut d.deferred).into_iter().partition(|(r, _)| !d.in_flight.contains_key(r.as_str()));
                        d.deferred = wait;
                        ready
                    };
                    for entry in ready {
                        releases.push(0, entry);
                    }
                    let r = match answer {
                        Ok(failed) => Ok(fleet_io::queue::pick(batch, &failed)),
                        Err(e) => Err((e, batch)),
                    };
                    to_retry(q.name(), "ChangeMessageVisibilityBatch", r)
                })
            }),
        );
        Completions { queue: queue.name().into(), deletes, visibility, extensions, done_with }
    }

    /// Keeps a message in hand invisible for `by` from now (batched; the message stays in hand).
    pub fn extend(&self, receipt: &str, by: Duration) {
        {
            let mut d = lock(&self.done_with);
            if d.done.contains(receipt) {
                return;
            }
            d.extended.insert(receipt.to_string());
        }
        self.extensions.push(0, (receipt.to_string(), by));
    }

    /// Remembers that an extended receipt is done with (its pending extensions are dropped).
    fn done_with(&self, receipt: &Receipt) {
        let now = Instant::now();
        let mut d = lock(&self.done_with);
        while d.order.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) >= DONE_WITH_FOR) {
            if let Some((_, r)) = d.order.pop_front() {
                d.done.remove(&r);
            }
        }
        if d.extended.remove(receipt.as_str()) {
            d.done.insert(receipt.as_str().to_string());
            d.order.push_back((now, receipt.as_str().to_string()));
        }
    }

    /// Deletes the message (batched).
    pub fn delete(&self, d: Delivery) {
        let r = d.into_receipt();
        self.done_with(&r);
        self.deletes.push(0, r);
    }

    /// Returns the message to the queue, visible again after `after` (batched).
    pub fn release(&self, d: Delivery, after: Duration) {
        let r = d.into_receipt();
        self.done_with(&r);
        {
            let mut d = lock(&self.done_with);
            if d.in_flight.contains_key(r.as_str()) {
                d.deferred.push((r, after));
                return;
            }
        }
        self.visibility.push(0, (r, after));
    }

    /// Binds a delivery to these completions, for a handler that keeps it past its `handle` call.
    pub fn keep(&self, d: Delivery) -> Kept {
        Kept { delivery: d, on: self.clone() }
    }

    /// The queue completed on.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Deletes, and visibility changes (releases and extensions), waiting for their batch call.
    pub fn pending(&self) -> (usize, usize) {
        (self.deletes.pending(), self.visibility.pending() + self.extensions.pending())
    }

    /// Stops the batchers: with `drain`, what is pending is flushed; without, it is dropped (those
    /// messages come back after their visibility timeout).
    pub async fn finish(&self, drain: bool) {
        self.extensions.complete(drain).await;
        self.deletes.complete(drain).await;
        self.visibility.complete(drain).await;
    }
}

/// A delivery a handler keeps past its `handle` call (e.g. until a checkpoint covers it), bound to the
/// completions of the engine that received it: completing it needs nothing else, and uses it up. It
/// reads as its delivery and message (`Deref`).
#[derive(Debug)]
pub struct Kept {
    delivery: Delivery,
    on: Completions,
}

/// A handle on a kept message that outlives it (the message may be moved on, or dropped with the
/// task that held it): [`show`](Visibility::show) makes it visible again at once, unless it was
/// completed (deleted or released) meanwhile.
#[derive(Debug, Clone)]
pub struct Visibility {
    on: Completions,
    receipt: String,
}

impl Visibility {
    pub fn show(&self) {
        self.on.extend(&self.receipt, Duration::ZERO);
    }
}

impl Kept {
    /// A handle that makes the message visible again even once this `Kept` is gone.
    pub fn visibility(&self) -> Visibility {
        Visibility { on: self.on.clone(), receipt: self.delivery.receipt().to_string() }
    }
}

impl std::ops::Deref for Kept {
    type Target = Delivery;
    fn deref(&self) -> &Delivery {
        &self.delivery
    }
}

impl Kept {
    /// Deletes the message (batched).
    pub fn delete(self) {
        self.on.delete(self.delivery);
    }

    /// Returns the message to its queue after `after` (batched).
    pub fn release(self, after: Duration) {
        self.on.release(self.delivery, after);
    }

    /// The queue the message came from.
    pub fn queue(&self) -> &str {
        self.on.queue()
    }

    /// Keeps the message invisible for `by` from now (batched), e.g. while what it waits for is down;
    /// SQS refuses to keep one past 12 hours from its receive (it then comes back).
    pub fn extend(&self, by: Duration) {
        self.on.extend(self.delivery.receipt(), by);
    }

    /// The delivery, unbound (to give back to the engine with an outcome).
    pub fn into_delivery(self) -> Delivery {
        self.delivery
    }
}

/// What a batch call hands back to the batcher for another attempt: the entries that failed, or the
/// whole batch when the call itself failed and may succeed later (entries of a call that can never
/// succeed are dropped: those messages come back after their visibility timeout).
pub(crate) fn to_retry<T>(queue: &str, op: &str, r: Handback<T>) -> Vec<T> {
    match r {
        Ok(failed) => failed,
        Err((e, batch)) => {
            tracing::warn!(queue, error = %e, entries = batch.len(), op, "batch call failed");
            if e.is_retryable() {
                batch
            } else {
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests;
