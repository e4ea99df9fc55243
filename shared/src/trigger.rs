//! Work-detected triggers over pub/sub (seed 004): when work is put on a queue, a `WorkDetected` event is
//! published on a RabbitMQ fanout exchange so idle listeners wake at once instead of waiting for their
//! next poll. Triggers are hints: losing one costs latency, never data, so every failure here is logged
//! and survived.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, Mutex};
use tokio_util::sync::CancellationToken;

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

#[async_trait]
pub trait TriggerBus: Send + Sync + 'static {
    async fn publish(&self, event: &WorkDetected) -> Result<()>;
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

async fn open_channel(url: &str, exchange: &str) -> Result<(Connection, Channel)> {
    let conn = Connection::connect(url, ConnectionProperties::default()).await.map_err(|e| amqp_err(url, e))?;
    let ch = conn.create_channel().await.map_err(|e| amqp_err(url, e))?;
    ch.exchange_declare(exchange.into(), ExchangeKind::Fanout, ExchangeDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .map_err(|e| amqp_err(url, e))?;
    Ok((conn, ch))
}

/// Publishes triggers on a RabbitMQ fanout exchange; connects lazily and reconnects after failures.
pub struct RabbitTriggers {
    url: String,
    exchange: String,
    channel: Mutex<Option<(Connection, Channel)>>,
}

impl RabbitTriggers {
    pub fn new(url: &str, exchange: &str) -> RabbitTriggers {
        RabbitTriggers { url: url.to_string(), exchange: exchange.to_string(), channel: Mutex::new(None) }
    }
}

#[async_trait]
impl TriggerBus for RabbitTriggers {
    async fn publish(&self, event: &WorkDetected) -> Result<()> {
        let payload = serde_json::to_vec(event)?;
        let mut guard = self.channel.lock().await;
        if guard.as_ref().is_none_or(|(c, _)| !c.status().connected()) {
            *guard = Some(open_channel(&self.url, &self.exchange).await?);
        }
        let (_, ch) = guard.as_ref().expect("channel just opened");
        let res = ch.basic_publish(self.exchange.as_str().into(), "".into(), BasicPublishOptions::default(), &payload, BasicProperties::default()).await;
        if let Err(e) = res {
            *guard = None;
            return Err(amqp_err(&self.url, e));
        }
        Ok(())
    }
}

/// Subscribes to the trigger exchange with an exclusive, auto-deleted queue and forwards events to
/// `tx` until `shutdown`; reconnects with back-off when the broker goes away.
pub fn spawn_subscriber(url: String, exchange: String, tx: broadcast::Sender<WorkDetected>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut delay = Duration::from_millis(200);
        loop {
            let run = async {
                let (conn, ch) = open_channel(&url, &exchange).await?;
                let q = ch
                    .queue_declare("".into(), QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() }, FieldTable::default())
                    .await
                    .map_err(|e| amqp_err(&url, e))?;
                ch.queue_bind(q.name().clone(), exchange.as_str().into(), "".into(), QueueBindOptions::default(), FieldTable::default())
                    .await
                    .map_err(|e| amqp_err(&url, e))?;
                let mut consumer = ch
                    .basic_consume(q.name().clone(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default())
                    .await
                    .map_err(|e| amqp_err(&url, e))?;
                tracing::info!(url = %redact_url(&url), %exchange, "subscribed to work-detected triggers");
                while let Some(d) = consumer.next().await {
                    let d = d.map_err(|e| amqp_err(&url, e))?;
                    match serde_json::from_slice::<WorkDetected>(&d.data) {
                        Ok(ev) => {
                            let _ = tx.send(ev);
                        }
                        Err(e) => tracing::warn!(error = %e, "ignoring malformed trigger"),
                    }
                }
                drop(conn);
                Ok::<(), Error>(())
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                r = run => {
                    match r {
                        Ok(()) => tracing::warn!("trigger subscription ended; reconnecting"),
                        Err(e) => tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "trigger subscription failed; polling continues"),
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(30));
        }
    })
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

/// In-memory trigger bus for tests: a broadcast channel.
pub struct MemoryTriggers {
    pub tx: broadcast::Sender<WorkDetected>,
}

impl MemoryTriggers {
    pub fn new() -> Arc<MemoryTriggers> {
        Arc::new(MemoryTriggers { tx: broadcast::channel(64).0 })
    }
}

#[async_trait]
impl TriggerBus for MemoryTriggers {
    async fn publish(&self, event: &WorkDetected) -> Result<()> {
        let _ = self.tx.send(event.clone());
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
