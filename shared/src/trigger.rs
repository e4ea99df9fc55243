//! The fleet's pub/sub bus over RabbitMQ (seed 004's triggers): when work is put on a queue, a
//! `WorkDetected` event is published so idle listeners wake at once instead of waiting for their next
//! poll; processors holding work publish `InstanceReport`s (throughput, work in hand, liveness) for the
//! scaling agent. One topic exchange; routing keys `work.{queue}` and `report.{queue}`, so a listener
//! receives only the triggers of the queues it listens to. Publications wait for the broker's confirm;
//! connections come back with back-off. Triggers and reports are hints: losing one costs latency, never
//! data, so every failure here is logged and survived, and a subscription says whether it is live (a
//! listener parks only while a trigger can reach it).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch, Mutex};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::call::CallPolicy;
use crate::error::{Error, Result, Service};

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
}

/// Routing key of the work-detected triggers of `queue`.
pub fn work_key(queue: &str) -> String {
    format!("work.{queue}")
}

/// Routing key of the instance reports of listeners on `queue`.
pub fn report_key(queue: &str) -> String {
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

fn amqp_err(url: &str, e: lapin::Error) -> Error {
    Error::Unreachable { service: Service::RabbitMq, endpoint: redact_url(url), detail: e.to_string() }
}

/// Connects, opens a channel and declares the exchange, all within one attempt of `policy`.
async fn open_channel(url: &str, exchange: &str, policy: &CallPolicy) -> Result<(Connection, Channel)> {
    policy.once(Service::RabbitMq, "connect", Duration::ZERO, open_channel_unbounded(url, exchange)).await
}

async fn open_channel_unbounded(url: &str, exchange: &str) -> Result<(Connection, Channel)> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await.map_err(|e| amqp_err(url, e))?;
    let ch = conn.create_channel().await.map_err(|e| amqp_err(url, e))?;
    ch.exchange_declare(exchange.into(), ExchangeKind::Topic, ExchangeDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .map_err(|e| amqp_err(url, e))?;
    Ok((conn, ch))
}

/// Back-off between connection attempts: 200 ms doubling to 30 s, reset by a success.
#[derive(Debug, Clone, Copy)]
struct Reconnect {
    delay: Duration,
}

impl Reconnect {
    const FIRST: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_secs(30);

    fn new() -> Reconnect {
        Reconnect { delay: Self::FIRST }
    }

    /// The wait before the next attempt after a failure (the one after it doubles).
    fn failed(&mut self) -> Duration {
        let d = self.delay;
        self.delay = (self.delay * 2).min(Self::MAX);
        d
    }

    fn reset(&mut self) {
        self.delay = Self::FIRST;
    }
}

struct Publisher {
    link: Option<(Connection, Channel)>,
    backoff: Reconnect,
    /// No connection attempt before this (the broker was unreachable a moment ago).
    retry_at: Option<Instant>,
}

/// Publishes on the RabbitMQ topic exchange with publisher confirms; connects lazily and reconnects
/// with back-off after failures (while the broker is down, a publication fails at once instead of
/// waiting for a connection attempt each time).
pub struct RabbitTriggers {
    url: String,
    exchange: String,
    policy: CallPolicy,
    state: Mutex<Publisher>,
}

impl RabbitTriggers {
    /// Connecting and each publication's confirm are bounded by one attempt of `policy`.
    pub fn new(url: &str, exchange: &str, policy: CallPolicy) -> RabbitTriggers {
        RabbitTriggers {
            url: url.to_string(),
            exchange: exchange.to_string(),
            policy,
            state: Mutex::new(Publisher { link: None, backoff: Reconnect::new(), retry_at: None }),
        }
    }

    async fn send(&self, key: &str, payload: &[u8]) -> Result<()> {
        let mut st = self.state.lock().await;
        if st.link.as_ref().is_none_or(|(c, _)| !c.status().connected()) {
            st.link = None;
            if let Some(at) = st.retry_at {
                if Instant::now() < at {
                    return Err(Error::Unreachable {
                        service: Service::RabbitMq,
                        endpoint: redact_url(&self.url),
                        detail: format!("unreachable a moment ago; next attempt in {} ms", at.saturating_duration_since(Instant::now()).as_millis()),
                    });
                }
            }
            let opened = async {
                let (conn, ch) = open_channel(&self.url, &self.exchange, &self.policy).await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| amqp_err(&self.url, e))?;
                Ok::<_, Error>((conn, ch))
            }
            .await;
            match opened {
                Ok(link) => {
                    st.link = Some(link);
                    st.backoff.reset();
                    st.retry_at = None;
                }
                Err(e) => {
                    st.retry_at = Some(Instant::now() + st.backoff.failed());
                    return Err(e);
                }
            }
        }
        let (_, ch) = st.link.as_ref().expect("link just opened");
        let confirmed = self
            .policy
            .once(Service::RabbitMq, "basic.publish", Duration::ZERO, async {
                let confirm = ch
                    .basic_publish(self.exchange.as_str().into(), key.into(), BasicPublishOptions::default(), payload, BasicProperties::default())
                    .await
                    .map_err(|e| amqp_err(&self.url, e))?;
                match confirm.await.map_err(|e| amqp_err(&self.url, e))? {
                    Confirmation::Nack(_) => Err(Error::Unreachable {
                        service: Service::RabbitMq,
                        endpoint: redact_url(&self.url),
                        detail: "the broker refused the publication (nack)".into(),
                    }),
                    Confirmation::Ack(_) | Confirmation::NotRequested => Ok(()),
                }
            })
            .await;
        if confirmed.is_err() {
            st.link = None;
        }
        confirmed
    }
}

#[async_trait]
impl TriggerBus for RabbitTriggers {
    async fn publish(&self, event: &WorkDetected) -> Result<()> {
        self.send(&work_key(&event.queue), &serde_json::to_vec(event)?).await
    }

    async fn report(&self, report: &InstanceReport) -> Result<()> {
        self.send(&report_key(&report.queue), &serde_json::to_vec(report)?).await
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

/// Subscribes to the exchange with an exclusive, auto-deleted queue bound to `keys` (`work.{queue}`,
/// `report.#`, ...) and forwards what arrives until `shutdown`; reconnects with back-off when the
/// broker goes away, saying meanwhile that it is not live.
pub fn spawn_subscription(url: String, exchange: String, keys: Vec<String>, policy: CallPolicy, shutdown: CancellationToken) -> Subscription {
    let (events, _) = broadcast::channel(256);
    let (reports, _) = broadcast::channel(1024);
    let (live_tx, live) = watch::channel(false);
    let sub = Subscription { events: events.clone(), reports: reports.clone(), live };
    tokio::spawn(async move {
        let mut backoff = Reconnect::new();
        loop {
            let run = async {
                let (conn, ch) = open_channel(&url, &exchange, &policy).await?;
                let q = ch
                    .queue_declare("".into(), QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() }, FieldTable::default())
                    .await
                    .map_err(|e| amqp_err(&url, e))?;
                for key in &keys {
                    ch.queue_bind(q.name().clone(), exchange.as_str().into(), key.as_str().into(), QueueBindOptions::default(), FieldTable::default())
                        .await
                        .map_err(|e| amqp_err(&url, e))?;
                }
                let mut consumer = ch
                    .basic_consume(q.name().clone(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default())
                    .await
                    .map_err(|e| amqp_err(&url, e))?;
                tracing::info!(url = %redact_url(&url), %exchange, ?keys, "subscribed to the fleet bus");
                backoff.reset();
                let _ = live_tx.send(true);
                while let Some(d) = consumer.next().await {
                    let d = d.map_err(|e| amqp_err(&url, e))?;
                    if d.routing_key.as_str().starts_with("report.") {
                        match serde_json::from_slice::<InstanceReport>(&d.data) {
                            Ok(r) => {
                                let _ = reports.send(r);
                            }
                            Err(e) => tracing::warn!(error = %e, "ignoring a malformed instance report"),
                        }
                    } else {
                        match serde_json::from_slice::<WorkDetected>(&d.data) {
                            Ok(ev) => {
                                let _ = events.send(ev);
                            }
                            Err(e) => tracing::warn!(error = %e, "ignoring a malformed trigger"),
                        }
                    }
                }
                drop(conn);
                Ok::<(), Error>(())
            };
            let result = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = run => r,
            };
            let _ = live_tx.send(false);
            let delay = backoff.failed();
            match result {
                Ok(()) => tracing::warn!(retry_in_ms = delay.as_millis() as u64, "bus subscription ended; listeners poll until it is back"),
                Err(e) => tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "bus subscription failed; listeners poll until it is back"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    });
    sub
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

/// In-memory bus for tests: broadcast channels, and a liveness switch to play a broker outage.
pub struct MemoryTriggers {
    pub tx: broadcast::Sender<WorkDetected>,
    pub reports: broadcast::Sender<InstanceReport>,
    pub live: watch::Sender<bool>,
}

impl MemoryTriggers {
    pub fn new() -> Arc<MemoryTriggers> {
        Arc::new(MemoryTriggers { tx: broadcast::channel(256).0, reports: broadcast::channel(1024).0, live: watch::channel(true).0 })
    }

    /// A subscription to this bus (every queue).
    pub fn subscription(&self) -> Subscription {
        Subscription { events: self.tx.clone(), reports: self.reports.clone(), live: self.live.subscribe() }
    }
}

#[async_trait]
impl TriggerBus for MemoryTriggers {
    async fn publish(&self, event: &WorkDetected) -> Result<()> {
        let _ = self.tx.send(event.clone());
        Ok(())
    }

    async fn report(&self, report: &InstanceReport) -> Result<()> {
        let _ = self.reports.send(report.clone());
        Ok(())
    }
}

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
