//! Instance state (seed 004's QueryState): queue depth and in-flight, active and total consumers,
//! concurrency in use and its limit, buffer length and capacity. The `http` module serves it as JSON at
//! `GET /state` and as Prometheus metrics at `GET /metrics`.
//!
//! Reading the state makes no request: the depth is the last look, taken by [`depth_loop`] every
//! [`DEPTH_REFRESH`] while the listener receives (never while it is parked or a breaker is open, so an
//! idle fleet stays at zero requests and a scrape never waits out an outage) and by the engine's own
//! work-detected reads.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{lock, Engine, Inner};
use crate::config::RECEIVE_GRACE;
use crate::events;
use fleet_io::queue::QueueDepth;

/// A snapshot of one listener.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ListenerState {
    pub queue: String,
    /// Approximate depth at the last look (absent before the first).
    pub depth: Option<QueueDepth>,
    /// How old that look is, milliseconds.
    #[serde(default)]
    pub depth_age_ms: Option<u64>,
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
            in_hand: inner.in_hand.len(),
            processed: inner.observed.stats.processed.load(Ordering::Relaxed),
            consumers_active: lock(&inner.consumers).active(),
            concurrency_limit: lock(&inner.buffer.throttle).limits().max_concurrency,
        }
    }

    /// The dependencies whose breaker is open now (no request).
    pub fn paused_for(&self) -> Vec<String> {
        self.inner.breakers.iter().filter(|b| b.is_open()).map(|b| b.service().to_string()).collect()
    }

    /// The current state (no request: the depth is the last look).
    pub fn state(&self) -> ListenerState {
        let inner = &self.inner;
        let look = inner.observed.last_depth();
        let (active, total, parked) = {
            let c = lock(&inner.consumers);
            (c.active(), c.list.len(), c.list.values().filter(|s| s.parked).count())
        };
        let (running, len, limits) = {
            let t = lock(&inner.buffer.throttle);
            (t.running(), t.len(), t.limits())
        };
        let s = &inner.observed.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        ListenerState {
            queue: inner.queue.name().to_string(),
            depth: look.map(|(d, _)| d),
            depth_age_ms: look.map(|(_, at)| at.elapsed().as_millis() as u64),
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
            in_hand: inner.in_hand.len(),
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
            held: inner.observed.holding() + inner.handler.holding(),
            held_total: get(&s.held),
            paused_total: get(&s.paused),
            breakers: inner.breakers.iter().map(|b| b.state()).collect(),
        }
    }
}

/// How often the depth is looked at while the listener receives.
pub const DEPTH_REFRESH: Duration = Duration::from_secs(15);

/// Refreshes the last look at the queue's depth every [`DEPTH_REFRESH`] while a consumer receives
/// and no breaker is open; ends with the engine.
pub(crate) async fn depth_loop(inner: Arc<Inner>) {
    loop {
        tokio::select! {
            biased;
            () = inner.lifecycle.stop_all.cancelled() => return,
            () = tokio::time::sleep(DEPTH_REFRESH) => {}
        }
        let receiving = lock(&inner.consumers).active() > 0;
        if !receiving || inner.breakers.iter().any(|b| b.is_open()) || inner.lifecycle.stopping() {
            continue;
        }
        // A look under way never holds up a stop (a hung queue answers only at the call's deadline).
        let depth = tokio::select! {
            biased;
            () = inner.lifecycle.stop_all.cancelled() => return,
            d = inner.queue.depth() => d,
        };
        match depth {
            Ok(d) => inner.observed.note_depth(d),
            Err(e) => events::DepthUnavailable { queue: inner.queue.name(), error: &e }.emit(),
        }
    }
}

/// Whether a listener can take work now ([`Health::ready`]: every dependency's breaker closed and, with
/// triggers on, the bus subscription live) and whether it still works at all ([`Health::live`]: a
/// consumer task is left, and one that receives has turned its loop or finished a message within
/// [`Engine::stall_bound`]); with the reasons when not. Orchestrators probe these (`/readyz`,
/// `/livez`): not ready takes an instance out of service, not live restarts it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Health {
    pub queue: String,
    pub ready: bool,
    pub live: bool,
    pub reasons: Vec<String>,
}

/// Slack above the longest expected quiet time before a receiving listener counts as stuck.
pub const STALL_SLACK: Duration = Duration::from_secs(30);

impl Engine {
    /// How long a receiving listener may show no progress before it counts as stuck: a long poll, its
    /// grace and the longest idle wait, plus [`STALL_SLACK`]; with messages in hand (every slot may be
    /// busy on slow ones), the longest processing time plus the slack.
    pub fn stall_bound(&self, in_hand: bool) -> Duration {
        let c = &self.inner.cfg;
        let turn = c.receive_wait + RECEIVE_GRACE + c.backoff.max_idle + STALL_SLACK;
        if in_hand {
            turn.max(c.max_processing + STALL_SLACK)
        } else {
            turn
        }
    }

    /// Readiness and liveness now (no request).
    pub fn health(&self) -> Health {
        let inner = &self.inner;
        let s = &inner.observed.stats;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let mut reasons = Vec::new();
        let open = self.paused_for();
        for d in &open {
            reasons.push(format!("{d} unreachable (breaker open)"));
        }
        let bus_down = inner.cfg.triggers && !inner.wakeups.triggers_live();
        if bus_down {
            reasons.push("trigger bus subscription down".into());
        }
        let ready = open.is_empty() && !bus_down;
        let (total, active) = {
            let c = lock(&inner.consumers);
            (c.list.len(), c.active())
        };
        let stopping = inner.lifecycle.stopping();
        let mut live = true;
        if total == 0 && !stopping {
            live = false;
            reasons.push("no consumer task left".into());
        }
        // Progress: any receive or completed message since the last look.
        let mark = get(&s.receives) + get(&s.processed) + get(&s.failed) + get(&s.expired);
        let now = tokio::time::Instant::now();
        let quiet = {
            let mut p = lock(&inner.observed.progress);
            if p.0 != mark || active == 0 || !open.is_empty() || stopping {
                *p = (mark, now);
            }
            now - p.1
        };
        let in_hand = !inner.in_hand.is_empty();
        let bound = self.stall_bound(in_hand);
        if quiet > bound {
            live = false;
            reasons.push(format!("no progress for {} s (bound {} s)", quiet.as_secs(), bound.as_secs()));
        }
        Health { queue: inner.queue.name().to_string(), ready, live, reasons }
    }
}
