//! The fleet's pub/sub bus (seed 004's triggers): when work is put on a queue, a `WorkDetected` event
//! is published so idle listeners wake at once instead of waiting for their next poll; processors
//! holding work publish `InstanceReport`s (throughput, work in hand, liveness) for the scaling agent.
//! One topic exchange; routing keys `work.{queue}` and `report.{queue}`, so a listener receives only
//! the triggers of the queues it listens to. Triggers and reports are hints: losing one costs latency,
//! never data, so every failure is logged and survived, and a subscription says whether it is live (a
//! listener parks only while a trigger can reach it). The RabbitMQ implementation is in `rabbitmq`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};

use crate::error::Result;

/// "Work was put on this queue."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkDetected {
    /// Queue name the work is on.
    pub queue: String,
    /// Messages put (or seen), when known.
    pub messages: u64,
    /// Who published it (`initiator`, `scaling-agent`).
    pub source: String,
}

/// What one listener instance reports while it holds work (and once when it leaves): the scaling
/// agent's per-instance throughput and liveness signals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceReport {
    /// Instance id (stable for the life of the process).
    pub instance: String,
    /// Queue the instance listens to.
    pub queue: String,
    /// Messages completed since the instance started.
    pub processed: u64,
    /// Messages completed per second since the previous report.
    pub rate: f64,
    /// Messages received and not yet completed.
    pub in_hand: u64,
    /// Consumers active (receiving) now.
    pub consumers: u32,
    /// Whether the instance had as much work as it can take (all its consumers busy or its buffer
    /// full): its rate is then its capacity.
    pub saturated: bool,
    /// The instance is stopping (last report).
    pub leaving: bool,
    /// Dependencies whose breaker is open in the instance: it is paused for them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paused_for: Vec<String>,
}

/// Routing key of the work-detected triggers of `queue`.
pub fn work_key(queue: &str) -> String {
    format!("work.{queue}")
}

/// Routing keys of the work-detected triggers of these queues: each shard's, for a sharded one.
pub fn work_keys(queues: &[&dyn crate::queue::Queue]) -> Vec<String> {
    queues.iter().flat_map(|q| q.shard_names()).map(|q| work_key(&q)).collect()
}

/// Routing key of the instance reports of listeners on `queue`.
pub fn instance_report_key(queue: &str) -> String {
    format!("report.{queue}")
}

/// Binding that receives every work-detected trigger.
pub const ALL_WORK: &str = "work.#";
/// Binding that receives every instance report.
pub const ALL_REPORTS: &str = "report.#";

#[async_trait]
pub trait TriggerBus: Send + Sync + 'static {
    async fn publish(&self, event: &WorkDetected) -> Result<()>;
    /// Publishes an instance report.
    async fn report(&self, report: &InstanceReport) -> Result<()>;
}

/// Publishes a trigger, waiting at most 5 s. A trigger is a hint (listeners find the work by polling),
/// so a failure is logged, not returned.
pub async fn announce(bus: &dyn TriggerBus, ev: &WorkDetected) {
    match tokio::time::timeout(Duration::from_secs(5), bus.publish(ev)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(queue = %ev.queue, error = %e, "could not publish a work-detected trigger; listeners find the work by polling"),
        Err(_) => tracing::warn!(queue = %ev.queue, "publishing a work-detected trigger timed out; listeners find the work by polling"),
    }
}

/// Announces `messages` on `queue`: one trigger per shard of a sharded queue (its listeners are per
/// shard), one for any other.
pub async fn announce_on(bus: &dyn TriggerBus, queue: &dyn crate::queue::Queue, messages: u64, source: &str) {
    for name in queue.shard_names() {
        announce(bus, &WorkDetected { queue: name, messages, source: source.to_string() }).await;
    }
}

/// Hides the password of an AMQP URL for logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// What a subscription delivers: triggers, reports, and whether it is connected now.
#[derive(Clone)]
pub struct Subscription {
    pub events: broadcast::Sender<WorkDetected>,
    pub reports: broadcast::Sender<InstanceReport>,
    /// True while subscribed: a trigger published now reaches this process.
    pub live: watch::Receiver<bool>,
}

/// Announces work put on one queue, for the services that put it there (the processor on the results
/// queue): at most one trigger per `min_interval`, and a call within the interval after a publication
/// is folded into one more publication at the interval's end, so the last work put is always
/// announced. Never blocks the caller; a failed publication is logged (the listener's safety poll
/// covers it).
#[derive(Clone)]
pub struct Notifier {
    inner: Arc<NotifierInner>,
}

struct NotifierInner {
    bus: Arc<dyn TriggerBus>,
    queue: String,
    source: String,
    min_interval: Duration,
    state: std::sync::Mutex<NotifierState>,
}

#[derive(Default)]
struct NotifierState {
    last: Option<tokio::time::Instant>,
    pending: u64,
    scheduled: bool,
}

impl Notifier {
    pub fn new(bus: Arc<dyn TriggerBus>, queue: &str, source: &str, min_interval: Duration) -> Notifier {
        Notifier {
            inner: Arc::new(NotifierInner { bus, queue: queue.to_string(), source: source.to_string(), min_interval, state: std::sync::Mutex::default() }),
        }
    }

    /// `messages` become visible on the queue after `delay` (handed back with a visibility delay):
    /// announced then, not before, since a parked listener woken before would find nothing and
    /// park again while busier listeners take them.
    pub fn notify_after(&self, messages: u64, delay: Duration) {
        if delay.is_zero() {
            return self.notify(messages);
        }
        let me = Notifier { inner: self.inner.clone() };
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            me.notify(messages);
        });
    }

    /// `messages` were put on the queue.
    pub fn notify(&self, messages: u64) {
        let wait = {
            let mut s = crate::lock(&self.inner.state);
            s.pending += messages;
            if s.scheduled {
                return;
            }
            s.scheduled = true;
            s.last.map_or(Duration::ZERO, |l| (l + self.inner.min_interval).saturating_duration_since(tokio::time::Instant::now()))
        };
        let inner = self.inner.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let messages = {
                let mut s = crate::lock(&inner.state);
                s.scheduled = false;
                s.last = Some(tokio::time::Instant::now());
                std::mem::take(&mut s.pending)
            };
            announce(inner.bus.as_ref(), &WorkDetected { queue: inner.queue.clone(), messages, source: inner.source.clone() }).await;
        });
    }
}

#[cfg(feature = "test-util")]
pub mod memory;
pub mod rabbitmq;

#[cfg(feature = "test-util")]
pub use memory::MemoryTriggers;
pub use rabbitmq::{spawn_subscription, AmqpCa, RabbitTriggers};

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn notifier_coalesces_within_the_interval_and_announces_the_last() {
        let bus = MemoryTriggers::new();
        let mut rx = bus.tx.subscribe();
        let n = Notifier::new(bus.clone(), "results", "processor", Duration::from_millis(100));
        let t0 = tokio::time::Instant::now();
        n.notify(2);
        let first = rx.recv().await.unwrap();
        assert_eq!((first.messages, first.queue.as_str(), t0.elapsed()), (2, "results", Duration::ZERO));
        // Three calls within the interval: one publication at its end, with their sum.
        tokio::time::sleep(Duration::from_millis(10)).await;
        n.notify(1);
        n.notify(4);
        tokio::time::sleep(Duration::from_millis(30)).await;
        n.notify(5);
        let second = rx.recv().await.unwrap();
        assert_eq!((second.messages, t0.elapsed()), (10, Duration::from_millis(100)));
        // Nothing more is pending; a call long after publishes at once.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(rx.try_recv().is_err());
        n.notify(1);
        let third = rx.recv().await.unwrap();
        assert_eq!((third.messages, t0.elapsed()), (1, Duration::from_millis(1100)));
    }

    #[test]
    fn redacts_password() {
        assert_eq!(redact_url("amqp://guest:secret@127.0.0.1:5672/%2f"), "amqp://guest:***@127.0.0.1:5672/%2f");
        assert_eq!(redact_url("amqp://127.0.0.1:5672"), "amqp://127.0.0.1:5672");
    }
}
