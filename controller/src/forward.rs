//! The work queue's dead-letter queue is shared by every results partition: each controller reads it
//! and forwards every dead-lettered work item to its job's partition (as a `DeadLettered` result
//! message, with its receive count and reason), where the job's owner applies it as a failed chunk.
//! A dead letter is thus never made visible again for whichever controller SQS hands it to next. The
//! forward is sent before the dead letter is deleted: a crash between the two forwards it twice, and
//! the job applies a chunk's failure once.
//!
//! What cannot be forwarded is applied here as before partitions: an unreadable body is quarantined,
//! and a work item naming a partition beyond the count (lowered while its job was in flight) is
//! applied under its job's lease.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fleet_domain::model::{ResultMessage, WorkItem, WIRE_VERSION};
use fleet_engine::{Completions, Handler, Outcome};
use fleet_io::auth::Role;
use fleet_io::queue::{Attrs, Delivery, Outgoing, Queue};
use fleet_io::telemetry::Operation;
use fleet_io::trigger::Notifier;

use crate::aggregate::{Aggregator, Source};

/// How long a dead letter whose forward failed waits before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// The handler of the work dead-letter queue's listener.
pub struct Forwarder {
    /// The results partitions, by number.
    pub partitions: Vec<Arc<dyn Queue>>,
    /// Announces forwards on each partition (its owner's parked listener wakes), by number (empty
    /// without a trigger bus).
    pub notifiers: Vec<Notifier>,
    pub agg: Arc<Aggregator>,
    pub store_breaker: Option<Arc<fleet_io::breaker::Breaker>>,
}

#[async_trait]
impl Handler for Forwarder {
    fn batch_size(&self) -> usize {
        10
    }

    fn dependencies(&self) -> Vec<Arc<fleet_io::breaker::Breaker>> {
        self.store_breaker.iter().cloned().chain(self.partitions.first().and_then(|q| q.breaker())).collect()
    }

    fn holding(&self) -> usize {
        self.agg.holding().held(Some(Source::WorkDeadLetter))
    }

    async fn handle(&self, msgs: Vec<Delivery>, done: &Completions) -> Vec<(Delivery, Outcome)> {
        let mut out = Vec::with_capacity(msgs.len());
        let mut here = Vec::new();
        let mut by_partition: BTreeMap<u16, Vec<(Delivery, Outgoing)>> = BTreeMap::new();
        for d in msgs {
            // With a keyring, only a work item its submitter signed is forwarded under this
            // controller's signature; anything else is judged (and quarantined) here.
            let ring = self.agg.keyring();
            let signed = ring.is_none_or(|r| r.verify(&d.body, d.attrs.auth.as_deref()) == Ok(Role::Submitter));
            match serde_json::from_str::<WorkItem>(&d.body) {
                Ok(item) if signed && usize::from(item.partition) < self.partitions.len() && !crate::undo::is(crate::undo::Fix::ForwardDeadLetters) => {
                    let p = item.partition;
                    let msg = ResultMessage::DeadLettered { v: WIRE_VERSION, item, receives: d.receive_count, reason: d.attrs.reason.clone() };
                    match serde_json::to_string(&msg) {
                        Ok(body) => {
                            let auth = ring.and_then(|r| r.signing_key(Role::Controller)).map(|k| k.sign(&body));
                            let attrs = Attrs { trace: d.attrs.trace.clone(), auth, ..Attrs::default() };
                            by_partition.entry(p).or_default().push((d, Outgoing { body, attrs, dedup: None }));
                        }
                        Err(_) => here.push(d),
                    }
                }
                _ => here.push(d),
            }
        }
        for (p, items) in by_partition {
            let (deliveries, outgoing): (Vec<Delivery>, Vec<Outgoing>) = items.into_iter().unzip();
            // A PRODUCER span per partition's send, linking each dead letter's trace (its job's).
            let queue = &self.partitions[usize::from(p)];
            let span = tracing::info_span!("forward_dead_letters", otel.kind = "producer", partition = p, messages = outgoing.len());
            fleet_io::telemetry::link_all(&span, outgoing.iter().map(|o| o.attrs.trace.as_deref()));
            fleet_io::telemetry::Messaging { operation: Operation::Send, destination: queue.name(), message_id: None, batch: Some(outgoing.len()) }.set(&span);
            let sent = tracing::Instrument::instrument(queue.send_messages(&outgoing), span.clone()).await;
            if let Err(e) = &sent {
                fleet_io::telemetry::fail(&span, e);
            }
            match sent {
                Ok(_) => {
                    tracing::info!(partition = p, dead_letters = deliveries.len(), "dead-lettered work items forwarded to their partition");
                    if let Some(n) = self.notifiers.get(usize::from(p)) {
                        n.notify(deliveries.len() as u64);
                    }
                    out.extend(deliveries.into_iter().map(|d| (d, Outcome::Done)));
                }
                Err(e) => {
                    tracing::warn!(partition = p, error = %e, "could not forward dead letters to their partition; tried again");
                    let outcome = if e.is_outage() { Outcome::Unavailable(e.to_string()) } else { Outcome::Release(RETRY_AFTER) };
                    out.extend(deliveries.into_iter().map(|d| (d, outcome.clone())));
                }
            }
        }
        if !here.is_empty() {
            let kept = here.into_iter().map(|d| done.keep(d)).collect();
            let applied = self.agg.apply(Source::WorkDeadLetter, kept).await;
            out.extend(crate::outcomes(done, applied));
        }
        out
    }
}
