//! The RabbitMQ implementation of [`TriggerBus`]: a topic exchange, publisher confirms, lazy
//! connection with back-off, and subscriptions that reconnect when the broker comes back. `amqps://`
//! URLs connect over TLS (rustls) trusting the system's roots and, when given, the broker's own CA
//! ([`AmqpCa`]).

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::{broadcast, watch, Mutex};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{instance_report_key, redact_url, work_key, InstanceReport, Subscription, TriggerBus, WorkDetected};
use crate::call::{CallPolicy, Op};
use crate::error::{Error, Result, Service};
use crate::pem::PemFile;

fn amqp_err(url: &str, e: lapin::Error) -> Error {
    Error::Unreachable { service: Service::RabbitMq, endpoint: redact_url(url), detail: e.to_string(), source: Some(Box::new(e)) }
}

/// A CA certificate (PEM) the broker's certificate may chain to, besides the system's roots: a broker
/// with a private CA (amqps:// only).
#[derive(Clone, Debug)]
pub struct AmqpCa(PemFile);

impl AmqpCa {
    /// Reads the PEM file at `path` (a clap value parser: a missing file or one without a certificate
    /// stops the start).
    pub fn from_file(path: &str) -> std::result::Result<AmqpCa, String> {
        let f = PemFile::read(path).map_err(|e| format!("AMQP CA file {e}"))?;
        if !f.holds("CERTIFICATE") {
            return Err(format!("AMQP CA file {path}: no PEM certificate in it"));
        }
        Ok(AmqpCa(f))
    }

    /// The file it was read from.
    pub fn path(&self) -> &str {
        self.0.path()
    }
}

/// Connects, opens a channel and declares the exchange, all within one attempt of `policy`.
async fn open_channel(url: &str, exchange: &str, ca: Option<&AmqpCa>, policy: &CallPolicy) -> Result<(Connection, Channel)> {
    policy.once(Op::AmqpConnect, crate::call::On::Unnamed, Duration::ZERO, open_channel_unbounded(url, exchange, ca)).await
}

async fn open_channel_unbounded(url: &str, exchange: &str, ca: Option<&AmqpCa>) -> Result<(Connection, Channel)> {
    let tls = lapin::tcp::OwnedTLSConfig { identity: None, cert_chain: ca.map(|c| c.0.pem().to_string()) };
    let runtime = lapin::runtime::default_runtime().map_err(|e| amqp_err(url, e))?;
    let conn = Connection::connect_with_config(url, ConnectionProperties::default(), tls, runtime).await.map_err(|e| amqp_err(url, e))?;
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
    ca: Option<AmqpCa>,
    policy: CallPolicy,
    state: Mutex<Publisher>,
}

impl RabbitTriggers {
    /// Connecting and each publication's confirm are bounded by one attempt of `policy`.
    pub fn new(url: &str, exchange: &str, policy: CallPolicy) -> RabbitTriggers {
        RabbitTriggers {
            url: url.to_string(),
            exchange: exchange.to_string(),
            ca: None,
            policy,
            state: Mutex::new(Publisher { link: None, backoff: Reconnect::new(), retry_at: None }),
        }
    }

    /// Trusts `ca` too for the broker's certificate (amqps://).
    pub fn with_ca(mut self, ca: Option<AmqpCa>) -> RabbitTriggers {
        self.ca = ca;
        self
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
                        source: None,
                    });
                }
            }
            let opened = async {
                let (conn, ch) = open_channel(&self.url, &self.exchange, self.ca.as_ref(), &self.policy).await?;
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
            .once(Op::AmqpPublish, crate::call::On::Unnamed, Duration::ZERO, async {
                let confirm = ch
                    .basic_publish(self.exchange.as_str().into(), key.into(), BasicPublishOptions::default(), payload, BasicProperties::default())
                    .await
                    .map_err(|e| amqp_err(&self.url, e))?;
                match confirm.await.map_err(|e| amqp_err(&self.url, e))? {
                    Confirmation::Nack(_) => Err(Error::Unreachable {
                        service: Service::RabbitMq,
                        endpoint: redact_url(&self.url),
                        detail: "the broker refused the publication (nack)".into(),
                        source: None,
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
        self.send(&instance_report_key(&report.queue), &serde_json::to_vec(report)?).await
    }
}

/// Subscribes to the exchange with an exclusive, auto-deleted queue bound to `keys` (`work.{queue}`,
/// `report.#`, ...) and forwards what arrives until `shutdown`; reconnects with back-off when the
/// broker goes away, saying meanwhile that it is not live.
pub fn spawn_subscription(
    url: String,
    exchange: String,
    keys: Vec<String>,
    ca: Option<AmqpCa>,
    policy: CallPolicy,
    shutdown: CancellationToken,
) -> Subscription {
    let (events, _) = broadcast::channel(256);
    let (reports, _) = broadcast::channel(1024);
    let (live_tx, live) = watch::channel(false);
    let sub = Subscription { events: events.clone(), reports: reports.clone(), live };
    tokio::spawn(async move {
        let mut backoff = Reconnect::new();
        loop {
            let run = async {
                let (conn, ch) = open_channel(&url, &exchange, ca.as_ref(), &policy).await?;
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
                biased;
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
                biased;
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    });
    sub
}
