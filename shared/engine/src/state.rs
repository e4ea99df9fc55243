//! Instance state (seed 004's QueryState): queue depth and in-flight, active and total consumers,
//! concurrency in use and its limit, buffer length and capacity. The `http` module serves it as JSON at
//! `GET /state` and as Prometheus metrics at `GET /metrics`.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::{lock, Engine};
use fleet_io::queue::QueueDepth;

/// A snapshot of one listener.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ListenerState {
    pub queue: String,
    /// Approximate depth (one GetQueueAttributes call; absent when not asked for or unavailable).
    pub depth: Option<QueueDepth>,
    pub consumers_active: usize,
    pub consumers_total: usize,
    pub consumers_parked: usize,
    pub consumers_min: usize,
    pub consumers_max: usize,
    pub concurrency_in_use: usize,
    pub concurrency_limit: usize,
    pub buffer_len: usize,
    pub buffer_capacity: usize,
    pub ttl_ms: u64,
    /// Messages received and not yet completed (buffered, processing, or waiting for a later completion).
    pub in_hand: usize,
    pub pending_deletes: usize,
    pub pending_visibility_changes: usize,
    pub receives: u64,
    pub empty_receives: u64,
    pub received: u64,
    pub processed: u64,
    pub failed: u64,
    pub expired: u64,
    pub evicted: u64,
    pub extended: u64,
    /// The dependencies whose breaker is open now (the listener receives nothing until they answer).
    #[serde(default)]
    pub paused_for: Vec<String>,
    /// Messages held now through a dependency's outage (visibility kept, receive count unspent).
    #[serde(default)]
    pub held: usize,
    /// Times a message was held for an outage, and times a consumer paused for one.
    #[serde(default)]
    pub held_total: u64,
    #[serde(default)]
    pub paused_total: u64,
    /// The breaker of each dependency the listener needs (open or not, failures in a row, trips,
    /// probes, the last failure).
    #[serde(default)]
    pub breakers: Vec<fleet_io::breaker::BreakerState>,
}

/// The few figures an instance report needs, read without any request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub in_hand: usize,
    pub processed: u64,
    pub consumers_active: usize,
    pub concurrency_limit: usize,
}

impl Engine {
    /// Work in hand, messages completed, consumers and concurrency limit (no request).
    pub fn counts(&self) -> Counts {
        let inner = &self.inner;
        Counts {
            in_hand: lock(&inner.heartbeat).len(),
            processed: inner.stats.processed.load(Ordering::Relaxed),
            consumers_active: lock(&inner.consumers).active(),
            concurrency_limit: lock(&inner.throttle).limits().max_concurrency,
        }
    }

    /// The dependencies whose breaker is open now (no request).
    pub fn paused_for(&self) -> Vec<String> {
        self.inner.breakers.iter().filter(|b| b.is_open()).map(|b| b.service().to_string()).collect()
    }

    /// The current state; with `depth`, the queue depth is fetched (one request).
    pub async fn state(&self, depth: bool) -> ListenerState {
        let inner = &self.inner;
        let depth = if depth { inner.queue.depth().await.ok() } else { None };
        let (active, total, parked) = {
            let c = lock(&inner.consumers);
            (c.active(), c.list.len(), c.list.values().filter(|s| s.parked).count())
        };
        let (running, len, limits) = {
            let t = lock(&inner.throttle);
            (t.running(), t.len(), t.limits())
        };
        let s = &inner.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        ListenerState {
            queue: inner.queue.name().to_string(),
            depth,
            consumers_active: active,
            consumers_total: total,
            consumers_parked: parked,
            consumers_min: inner.cfg.scaling.min_consumers,
            consumers_max: inner.cfg.scaling.max_consumers,
            concurrency_in_use: running,
            concurrency_limit: limits.max_concurrency,
            buffer_len: len,
            buffer_capacity: limits.buffer,
            ttl_ms: limits.ttl.map_or(0, |t| t.as_millis() as u64),
            in_hand: lock(&inner.heartbeat).len(),
            pending_deletes: inner.completions.pending().0,
            pending_visibility_changes: inner.completions.pending().1,
            receives: get(&s.receives),
            empty_receives: get(&s.empty_receives),
            received: get(&s.received),
            processed: get(&s.processed),
            failed: get(&s.failed),
            expired: get(&s.expired),
            evicted: get(&s.evicted),
            extended: get(&s.extended),
            paused_for: self.paused_for(),
            held: inner.holding.load(Ordering::SeqCst) + inner.handler.holding(),
            held_total: get(&s.held),
            paused_total: get(&s.paused),
            breakers: inner.breakers.iter().map(|b| b.state()).collect(),
        }
    }
}
