//! The engine's typed events (as the controller's and processor's, after vector's `internal_events`):
//! each happening of a listener is one value whose `emit` writes its log line (structured fields) and
//! bumps its [`Stats`] counters together, so they cannot drift apart. The counters feed `/state`
//! ([`crate::state::ListenerState`]) and the `listener_*` metrics rendered from it. The handler's error
//! hook (`Handler::on_error`) is called by the code where the happening is, not here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
    /// Times a delivery was held for a dependency's outage.
    pub held: AtomicU64,
    /// Times a consumer paused for an open breaker.
    pub paused: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A receive call answered: `messages` received (none: an empty receive).
pub(crate) struct ReceiveDone<'a> {
    pub queue: &'a str,
    pub consumer: usize,
    pub messages: usize,
}

impl ReceiveDone<'_> {
    pub fn emit(&self, stats: &Stats) {
        tracing::trace!(queue = self.queue, consumer = self.consumer, messages = self.messages, "receive done");
        bump(&stats.receives, 1);
        if self.messages == 0 {
            bump(&stats.empty_receives, 1);
        } else {
            bump(&stats.received, self.messages as u64);
        }
    }
}

/// A receive call failed (or had no answer in time): the consumer tries again after `retry_in`.
pub(crate) struct ReceiveFailed<'a> {
    pub queue: &'a str,
    pub consumer: usize,
    pub error: &'a fleet_io::Error,
    pub retry_in: Duration,
}

impl ReceiveFailed<'_> {
    pub fn emit(&self, stats: &Stats) {
        tracing::warn!(queue = self.queue, consumer = self.consumer, error = %self.error, retry_in_ms = self.retry_in.as_millis() as u64, "receive failed");
        bump(&stats.receives, 1);
    }
}

/// A consumer paused for an open breaker: it receives nothing until every dependency answers.
pub(crate) struct ConsumerPaused<'a> {
    pub queue: &'a str,
    pub consumer: usize,
}

impl ConsumerPaused<'_> {
    pub fn emit(&self, stats: &Stats) {
        bump(&stats.paused, 1);
        tracing::info!(queue = self.queue, consumer = self.consumer, "a dependency is down: receiving nothing until it answers");
    }
}

/// A consumer parked after an empty receive, until work is detected (or its safety poll).
pub(crate) struct ConsumerParked<'a> {
    pub queue: &'a str,
    pub consumer: usize,
}

impl ConsumerParked<'_> {
    pub fn emit(&self) {
        tracing::debug!(queue = self.queue, consumer = self.consumer, "parked until work is detected");
    }
}

/// The main consumer's sample found every consumer busy: one more was started.
pub(crate) struct ConsumerAdded<'a> {
    pub queue: &'a str,
    pub consumer: usize,
}

impl ConsumerAdded<'_> {
    pub fn emit(&self) {
        tracing::debug!(queue = self.queue, consumer = self.consumer, "all consumers busy: one more");
    }
}

/// Why an idle consumer stops.
pub(crate) enum Retired {
    /// The `QueueEmpty` rule stopped it after `idle` empty receives in a row.
    Idle(u32),
    /// The main consumer's sample chose it (it stops at the end of its current iteration).
    Sampled,
}

/// An idle consumer stops.
pub(crate) struct ConsumerRetired<'a> {
    pub queue: &'a str,
    pub consumer: usize,
    pub why: Retired,
}

impl ConsumerRetired<'_> {
    pub fn emit(&self) {
        match self.why {
            Retired::Idle(idle) => tracing::debug!(queue = self.queue, consumer = self.consumer, idle, "idle consumer stops"),
            Retired::Sampled => tracing::debug!(queue = self.queue, consumer = self.consumer, "idle consumer stopped"),
        }
    }
}

/// Work was detected: the consumers are raised from `from` to `to` for a queue depth.
pub(crate) struct ConsumersRaised<'a> {
    pub queue: &'a str,
    pub depth: u64,
    pub from: usize,
    pub to: usize,
}

impl ConsumersRaised<'_> {
    pub fn emit(&self) {
        tracing::debug!(queue = self.queue, depth = self.depth, from = self.from, to = self.to, "work detected: raising consumers");
    }
}

/// A look at the queue's depth failed (the last look stays).
pub(crate) struct DepthUnavailable<'a> {
    pub queue: &'a str,
    pub error: &'a fleet_io::Error,
}

impl DepthUnavailable<'_> {
    pub fn emit(&self) {
        tracing::debug!(queue = self.queue, error = %self.error, "queue depth unavailable");
    }
}

/// A poll under way at a stop brought messages: they go straight back.
pub(crate) struct PollReturned<'a> {
    pub queue: &'a str,
    pub returned: usize,
}

impl PollReturned<'_> {
    pub fn emit(&self) {
        tracing::info!(queue = self.queue, returned = self.returned, "stopping: returning what the last poll brought");
    }
}

/// A buffered message was evicted from a full buffer by one of higher priority: back on the queue.
pub(crate) struct Evicted<'a> {
    pub queue: &'a str,
    pub message_id: &'a str,
}

impl Evicted<'_> {
    pub fn emit(&self, stats: &Stats) {
        tracing::trace!(queue = self.queue, message_id = self.message_id, "evicted from a full buffer");
        bump(&stats.evicted, 1);
    }
}

/// A buffered message waited past its TTL: it goes back, or to the dead-letter queue past its deadline.
pub(crate) struct Expired<'a> {
    pub queue: &'a str,
    pub message_id: &'a str,
}

impl Expired<'_> {
    pub fn emit(&self, stats: &Stats) {
        tracing::trace!(queue = self.queue, message_id = self.message_id, "expired in the buffer");
        bump(&stats.expired, 1);
    }
}

/// A message could not be moved to the dead-letter queue (`why`: `expired` or `failed`): it goes back
/// to its queue instead.
pub(crate) struct DeadLetterFailed<'a> {
    pub queue: &'a str,
    pub why: &'static str,
    pub error: &'a fleet_io::Error,
}

impl DeadLetterFailed<'_> {
    pub fn emit(&self) {
        if self.why == "expired" {
            tracing::warn!(queue = self.queue, error = %self.error, "could not dead-letter an expired message; returning it");
        } else {
            tracing::warn!(queue = self.queue, error = %self.error, "could not dead-letter a failed FIFO message; returning it with its group");
        }
    }
}

/// Messages handed to the handler were processed (deleted by the engine, or kept by the handler).
pub(crate) struct Processed<'a> {
    pub queue: &'a str,
    pub messages: u64,
}

impl Processed<'_> {
    pub fn emit(&self, stats: &Stats) {
        if self.messages == 0 {
            return;
        }
        tracing::trace!(queue = self.queue, messages = self.messages, "processed");
        bump(&stats.processed, self.messages);
    }
}

/// A message failed and goes back to its queue after `retry_in` (at once, towards the dead-letter queue,
/// on its last attempt).
pub(crate) struct MessageFailed<'a> {
    pub queue: &'a str,
    pub message_id: &'a str,
    pub receive_count: u32,
    pub attempt: u32,
    pub last_attempt: bool,
    pub retry_in: Duration,
    pub reason: &'a str,
}

impl MessageFailed<'_> {
    pub fn emit(&self, stats: &Stats) {
        bump(&stats.failed, 1);
        tracing::warn!(
            queue = self.queue, message_id = %self.message_id, receive_count = self.receive_count, attempt = self.attempt,
            last_attempt = self.last_attempt, retry_in_s = self.retry_in.as_secs(), reason = %self.reason, "message failed"
        );
    }
}

/// A FIFO message failed and is tried again in place after `retry_in`: its group waits, no receive spent.
pub(crate) struct RetriedInPlace<'a> {
    pub queue: &'a str,
    pub message_id: &'a str,
    pub receive_count: u32,
    pub attempt: u32,
    pub retry_in: Duration,
    pub reason: &'a str,
}

impl RetriedInPlace<'_> {
    pub fn emit(&self, stats: &Stats) {
        bump(&stats.failed, 1);
        tracing::warn!(
            queue = self.queue, message_id = %self.message_id, receive_count = self.receive_count, attempt = self.attempt,
            retry_in_s = self.retry_in.as_secs(), reason = %self.reason, "message failed; retried in place (FIFO: its group waits, no receive spent)"
        );
    }
}

/// Deliveries held for a dependency's outage: visibility kept, receive count unspent, handled again
/// once it answers.
pub(crate) struct DeliveriesHeld<'a> {
    pub queue: &'a str,
    pub held: usize,
    /// A breaker is open now (else the dependency failed without tripping one yet).
    pub dependency_down: bool,
    pub reason: &'a str,
}

impl DeliveriesHeld<'_> {
    pub fn emit(&self, stats: &Stats) {
        bump(&stats.held, self.held as u64);
        tracing::info!(
            queue = self.queue, held = self.held, dependency_down = self.dependency_down, reason = %self.reason,
            "a dependency failed: holding the messages (visibility kept, receive count unspent) until it answers"
        );
    }
}

/// Held deliveries whose dependency keeps failing for them alone while every breaker stays closed:
/// from now on their failures count as theirs.
pub(crate) struct HeldFailing<'a> {
    pub queue: &'a str,
    pub held: usize,
    pub reason: &'a str,
}

impl HeldFailing<'_> {
    pub fn emit(&self) {
        tracing::warn!(queue = self.queue, held = self.held, reason = %self.reason, "a dependency keeps failing for these messages only: treated as failures");
    }
}

/// The heartbeat extended the visibility of `messages` in hand by a full timeout.
pub(crate) struct VisibilityExtended<'a> {
    pub queue: &'a str,
    pub messages: usize,
}

impl VisibilityExtended<'_> {
    pub fn emit(&self, stats: &Stats) {
        if self.messages == 0 {
            return;
        }
        bump(&stats.extended, self.messages as u64);
        tracing::debug!(queue = self.queue, messages = self.messages, "extending visibility");
    }
}

/// A message still in hand passed the maximum processing time: no longer extended.
pub(crate) struct Overdue<'a> {
    pub queue: &'a str,
}

impl Overdue<'_> {
    pub fn emit(&self) {
        tracing::warn!(queue = self.queue, "message passed the maximum processing time; no longer extended");
    }
}
