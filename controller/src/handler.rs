//! The results listeners' handler: a batch of results applied to its jobs (`aggregate`), and what
//! that gives back completed on the queue each message came from (deleted once checkpointed, or
//! handed back, announced, for the job's owner).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fleet_engine::{Completions, Handler, Kept, Outcome};
use fleet_io::queue::Delivery;
use fleet_io::telemetry::Operation;
use fleet_io::trigger::Notifier;

use crate::aggregate::{self, Aggregator, Source};
use crate::{events, undo};

/// Deletes messages a checkpoint (or a report) covers, each on the queue it came from (batched).
pub(crate) fn complete(kept: Vec<Kept>) {
    for k in kept {
        k.delete();
    }
}

/// One notifier per queue (by name): announces messages handed back to it, so that the parked
/// listener of the controller they are for wakes when they are visible again.
pub(crate) type Notifiers = BTreeMap<String, Notifier>;

/// Announces hand-backs (each message with when it is visible again) on their queue's notifier.
pub(crate) fn announce<'a>(notifiers: &Notifiers, released: impl IntoIterator<Item = (&'a str, Duration)>) {
    let mut per_queue: BTreeMap<&str, (u64, Duration)> = BTreeMap::new();
    for (queue, after) in released {
        let e = per_queue.entry(queue).or_default();
        *e = (e.0 + 1, e.1.max(after));
    }
    for (queue, (n, after)) in per_queue {
        if let Some(notifier) = notifiers.get(queue) {
            notifier.notify_after(n, after + Duration::from_millis(100));
        }
    }
}

/// Completes what applying held messages again gave back: deletes, and hand-backs (to the job's
/// owner, or to any controller that reaches the store), announced.
pub(crate) fn complete_applied(applied: aggregate::Applied, notifiers: &Notifiers) {
    complete(applied.delete);
    announce(notifiers, applied.release.iter().map(|(k, after)| (k.queue(), *after)));
    for (k, after) in applied.release {
        k.release(after);
    }
}

/// What a batch's handler hands its engine: the outcomes of the messages of the engine's own queue
/// (`done`'s). A batch may also complete messages that came from another queue: a job's earlier
/// messages from a dead-letter queue (or its results queue), pending in the job until this batch's
/// checkpoint covered them. Those are completed here on the queue they came from; handed to this
/// engine they were deleted on the wrong queue (an invalid receipt on SQS, so they came back and
/// were received again; found by the simulation, seed 516, where the in-memory queues' receipts
/// collided and a seal was lost).
pub(crate) fn outcomes(done: &Completions, applied: aggregate::Applied) -> Vec<(Delivery, Outcome)> {
    let mut out = Vec::with_capacity(applied.release.len() + applied.delete.len());
    let own = |k: &Kept| k.queue() == done.queue() || undo::is(undo::Fix::OwnQueueCompletes);
    for (k, after) in applied.release {
        if own(&k) {
            out.push((k.into_delivery(), Outcome::Release(after)));
        } else {
            k.release(after);
        }
    }
    for k in applied.delete {
        if own(&k) {
            out.push((k.into_delivery(), Outcome::Done));
        } else {
            k.delete();
        }
    }
    out
}

/// The handler of one results partition's listener (its results queue or its dead-letter queue).
pub(crate) struct ResultsHandler {
    pub(crate) source: Source,
    /// The queue it reads (`messaging.destination.name` of its spans).
    pub(crate) queue: String,
    pub(crate) agg: Arc<Aggregator>,
    /// Announces messages handed back for another controller (shared with the hold's retry).
    pub(crate) notifiers: Arc<Notifiers>,
    /// The store's breaker: while S3 does not answer, nothing is received (checkpoints cannot be
    /// written).
    pub(crate) store_breaker: Option<Arc<fleet_io::breaker::Breaker>>,
}

#[async_trait]
impl Handler for ResultsHandler {
    fn batch_size(&self) -> usize {
        10
    }

    fn dependencies(&self) -> Vec<Arc<fleet_io::breaker::Breaker>> {
        self.store_breaker.iter().cloned().collect()
    }

    fn holding(&self) -> usize {
        self.agg.holding().held(Some(self.source))
    }

    async fn handle(&self, msgs: Vec<Delivery>, done: &Completions) -> Vec<(Delivery, Outcome)> {
        // Applied in memory, checkpointed, then deleted; a crash anywhere before the delete redelivers
        // the messages and the checkpoint makes the replay a no-op. Only this batch's jobs are locked.
        // What `apply` does not return waits in its job for the next checkpoint (or, when the job
        // could not be saved, is dropped and comes back after the visibility timeout).
        // One CONSUMER span for the batch, which may hold several jobs' messages: it links the context
        // of every message (the spans that billed or forwarded them), each job's trace reaching it by
        // its link, rather than being a child of any one (exported when OTEL_EXPORTER_OTLP_ENDPOINT is
        // set; see `fleet_io::telemetry`).
        let n = msgs.len();
        let span = tracing::info_span!("apply_results", otel.kind = "consumer", source = ?self.source, messages = n);
        fleet_io::telemetry::Messaging { operation: Operation::Process, destination: &self.queue, message_id: None, batch: Some(n) }.set(&span);
        fleet_io::telemetry::link_all(&span, msgs.iter().map(|m| m.attrs.trace.as_deref()));
        let kept = msgs.into_iter().map(|d| done.keep(d)).collect();
        // A job that could not be applied marks it failed (`Aggregator::apply`).
        let applied = tracing::Instrument::instrument(self.agg.apply(self.source, kept), span).await;
        events::ResultsApplied { open_jobs: self.agg.memory().open_jobs() }.emit();
        // Announced when they are visible again, so that the owner's parked listener finds them.
        announce(&self.notifiers, applied.release.iter().map(|(k, after)| (k.queue(), *after)));
        outcomes(done, applied)
    }
}
