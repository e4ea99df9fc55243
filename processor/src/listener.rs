//! The work-queue handler run by the listener engine: bills a batch of work items in parallel, sends
//! their results per job (batched), and reports work items that failed on their last allowed receive.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use fleet_domain::model::{ChunkOutcome, ChunkResult, ResultMessage, WorkItem};
use fleet_domain::requests::RequestCounts;
use fleet_engine::{Completions, ErrorEvent, Handler, Outcome};
use fleet_io::auth::Key;
use fleet_io::blob::BlobStore;
use fleet_io::breaker::Breaker;
use fleet_io::error::Error;
use fleet_io::op::{sqs_extra_chunks, Billed, Op};
use fleet_io::queue::{plan_batches, Attrs, Delivery, Message, Outgoing, Queue};
use fleet_io::telemetry::Operation;
use fleet_io::trigger::Notifier;
use futures::future::join_all;

use crate::events;
use crate::handle::{failed_result, parse_work_item, process};

/// Work-detected triggers the processor publishes for the queues it puts work on, so that a parked
/// controller wakes at once.
#[derive(Clone, Default)]
pub struct Announce {
    /// Results sent, one per partition of the results queue (by partition number).
    pub results: Vec<Notifier>,
    /// A work item is on its way to the dead-letter queue (poison, or expired past its deadline).
    pub dead_letters: Option<Notifier>,
}

impl Announce {
    fn results(&self, partition: u16, n: u64) {
        if let Some(x) = self.results.get(usize::from(partition)) {
            x.notify(n);
        }
    }

    fn dead_letter(&self) {
        if let Some(x) = &self.dead_letters {
            x.notify(1);
        }
    }
}

pub struct WorkHandler {
    /// The work queue (shard) it reads: `messaging.destination.name` of its spans.
    queue: String,
    results: Arc<dyn Queue>,
    store: Arc<dyn BlobStore>,
    max_chunk_bytes: u64,
    announce: Announce,
    /// The work queue is a FIFO queue: its receives and deletes are counted as FIFO calls (SQS bills
    /// them at its FIFO price).
    work_fifo: bool,
    /// Signs every result and failure report it sends (`None`: sent unsigned).
    signing_key: Option<Key>,
}

impl WorkHandler {
    pub fn new(queue: &str, results: Arc<dyn Queue>, store: Arc<dyn BlobStore>, max_chunk_bytes: u64, announce: Announce, work_fifo: bool) -> WorkHandler {
        WorkHandler { queue: queue.to_string(), results, store, max_chunk_bytes, announce, work_fifo, signing_key: None }
    }

    /// The same handler signing what it sends with `key` (the processor's role key).
    pub fn with_signing_key(self, key: Option<Key>) -> WorkHandler {
        WorkHandler { signing_key: key, ..self }
    }

    /// The signature of a message body it sends ([`fleet_io::auth::ATTRIBUTE`]), when it has a key.
    fn sign(&self, body: &str) -> Option<String> {
        self.signing_key.as_ref().map(|k| k.sign(body))
    }

    /// The chunk's result, or why it should be tried again. A chunk that can never succeed (its blob
    /// missing, corrupt, over a cap, or hostile content) gets a failed result at once instead of
    /// cycling through every receive and back-off on its way to the dead-letter queue.
    /// With the result, the results partition its job's messages travel on.
    async fn handle_one(&self, m: &Message) -> Result<(ChunkResult, u16), Failure> {
        let item = parse_work_item(&m.body).map_err(|e| Failure::Own(format!("unreadable work item: {e}")))?;
        let billed = self.bill(&item, m).await?;
        Ok((billed, item.partition))
    }

    async fn bill(&self, item: &WorkItem, m: &Message) -> Result<ChunkResult, Failure> {
        let (job, chunk) = (item.job_id.as_str(), item.chunk);
        let (r, requests) = process(item, self.store.as_ref(), self.max_chunk_bytes).await;
        match r {
            Ok(r) => {
                events::ChunkBilled { job, chunk, transactions: r.transactions }.emit();
                Ok(r)
            }
            Err(e @ Error::Corrupt(_)) => {
                events::ChunkFailedForGood { job, chunk, receive_count: m.receive_count, error: &e }.emit();
                Ok(failed_result(item, format!("{e} (attempt {}; not retried: it can never succeed)", m.receive_count), requests))
            }
            Err(e) if e.is_outage() => {
                events::WorkItemHeld { job, chunk, error: &e }.emit();
                Err(Failure::Outage(e.to_string()))
            }
            Err(e) => {
                events::WorkItemRetried { job, chunk, receive_count: m.receive_count, retryable: e.is_retryable(), error: &e }.emit();
                Err(Failure::Own(failure_reason(&e, m.receive_count)))
            }
        }
    }

    /// Sends one job's results to its partition, each with the trace context of the span that billed
    /// it; the first carries the batch's calls (receive, sends, deletes).
    /// `span` is the send's, given its messaging attributes here.
    /// `tokens`: each result's chunk token, as its work item brought it (passed on: the controller
    /// counts a result only with its chunk's token).
    async fn send_job(
        &self,
        span: &tracing::Span,
        job: &str,
        partition: u16,
        results: Vec<(ChunkResult, Option<String>)>,
        tokens: Vec<Option<String>>,
    ) -> fleet_io::Result<()> {
        let (mut results, traces): (Vec<ChunkResult>, Vec<Option<String>>) = results.into_iter().unzip();
        let rest: Vec<String> = results.drain(1..).map(|r| serde_json::to_string(&ResultMessage::Chunk(r))).collect::<Result<_, _>>()?;
        let Some(mut first) = results.pop() else { return Ok(()) };
        // Size the first before adding the counts (the slack covers the enum tag and the digits).
        let first_size = serde_json::to_vec(&first)?.len() + 128;
        let sizes: Vec<usize> = std::iter::once(first_size).chain(rest.iter().map(String::len)).collect();
        let n = sizes.len() as u64;
        // The batch's SQS calls are planned, not read off the counter: the sends carry them and the
        // deletes follow the sends (`processor/tests/it/memory.rs`: `a_jobs_requests_are_what_the_clients_counted`).
        let mut batch_calls = RequestCounts::default();
        let fifo = self.work_fifo;
        let mut add = |what: Billed, n: u64| batch_calls.add(what, n);
        add(Billed::Call { op: Op::SqsReceiveMessage, fifo }, 1);
        let batches = plan_batches(&sizes);
        add(Billed::call(Op::SqsSendMessageBatch), batches.len() as u64);
        // SQS bills each further 64 KiB of a batch's payload as one more request.
        add(Billed::Extra64KiB { fifo: false }, batches.iter().map(|b| sqs_extra_chunks(sizes[b.clone()].iter().sum())).sum());
        add(Billed::Call { op: Op::SqsDeleteMessageBatch, fifo }, n.div_ceil(10));
        first.requests.merge(&batch_calls);
        let head = serde_json::to_string(&ResultMessage::Chunk(first))?;
        let bodies: Vec<Outgoing> = std::iter::once(head)
            .chain(rest)
            .zip(traces)
            .zip(tokens)
            .map(|((body, trace), chunk_token)| Outgoing { attrs: Attrs { trace, auth: self.sign(&body), chunk_token, ..Attrs::default() }, body, dedup: None })
            .collect();
        let chunks = bodies.len();
        let queue = fleet_io::queue::partition(&self.results, partition)?;
        fleet_io::telemetry::Messaging { operation: Operation::Send, destination: queue.name(), message_id: None, batch: Some(chunks) }.set(span);
        queue.send_messages(&bodies).await?;
        events::ResultsSent { job, chunks }.emit();
        Ok(())
    }
}

/// Why a work item was not billed.
enum Failure {
    /// Its own fault (or unknown): retried with back-off, poison on the last receive.
    Own(String),
    /// A dependency's outage: held until it answers.
    Outage(String),
}

impl Failure {
    fn outcome(self) -> Outcome {
        match self {
            Failure::Own(r) => Outcome::Failed(r),
            Failure::Outage(r) => Outcome::Unavailable(r),
        }
    }
}

fn failure_reason(e: &Error, receives: u32) -> String {
    format!("{e} (after {receives} attempts)")
}

#[async_trait]
impl Handler for WorkHandler {
    fn batch_size(&self) -> usize {
        10
    }

    fn dependencies(&self) -> Vec<Arc<Breaker>> {
        self.store.breaker().into_iter().chain(self.results.breaker()).collect()
    }

    async fn handle(&self, msgs: Vec<Delivery>, _done: &Completions) -> Vec<(Delivery, Outcome)> {
        let handled = join_all(msgs.into_iter().map(|m| async move {
            // One CONSUMER span per work item, a child of the span that sent it (its context came with
            // the work item); its result carries this span's context on.
            let span = tracing::info_span!("bill_chunk", otel.kind = "consumer", receive_count = m.receive_count);
            fleet_io::telemetry::follow(&span, m.attrs.trace.as_deref());
            fleet_io::telemetry::Messaging { operation: Operation::Process, destination: &self.queue, message_id: Some(&m.id), batch: None }.set(&span);
            let trace = fleet_io::telemetry::traceparent(&span);
            let r = tracing::Instrument::instrument(self.handle_one(&m), span.clone()).await;
            match &r {
                Ok((ChunkResult { outcome: ChunkOutcome::Failed { reason }, .. }, _)) => fleet_io::telemetry::fail(&span, reason),
                Err(Failure::Own(why) | Failure::Outage(why)) => fleet_io::telemetry::fail(&span, why),
                Ok(_) => {}
            }
            (m, r.map(|r| (r, trace)))
        }))
        .await;
        let mut out = Vec::with_capacity(handled.len());
        // Group by job so that per-job request counts are exact enough: each job's results go in
        // their own batch calls.
        let mut by_job: BTreeMap<(String, u16), Vec<(Delivery, (ChunkResult, Option<String>))>> = BTreeMap::new();
        for (m, r) in handled {
            match r {
                Ok(((r, partition), trace)) => by_job.entry((r.job_id.clone(), partition)).or_default().push((m, (r, trace))),
                Err(f) => out.push((m, f.outcome())),
            }
        }
        for ((job, partition), items) in by_job {
            let (deliveries, results): (Vec<Delivery>, Vec<(ChunkResult, Option<String>)>) = items.into_iter().unzip();
            let n = results.len() as u64;
            // A PRODUCER span per job's send, a child of the context its first work item came with
            // (the job's trace), linking the span that billed each result (each result's context).
            let span = tracing::info_span!("send_results", otel.kind = "producer", job_id = %job, partition, messages = n);
            fleet_io::telemetry::follow(&span, deliveries.first().and_then(|d| d.attrs.trace.as_deref()));
            fleet_io::telemetry::link_all(&span, results.iter().map(|(_, trace)| trace.as_deref()));
            let tokens = deliveries.iter().map(|d| d.attrs.chunk_token.clone()).collect();
            match tracing::Instrument::instrument(self.send_job(&span, &job, partition, results, tokens), span.clone()).await {
                Ok(()) => {
                    self.announce.results(partition, n);
                    out.extend(deliveries.into_iter().map(|m| (m, Outcome::Done)));
                }
                Err(e) => {
                    fleet_io::telemetry::fail(&span, &e);
                    // Not sent: not deleted; the work items come back and are processed again.
                    events::ResultsNotSent { job: &job, outage: e.is_outage(), error: &e }.emit();
                    let failure = if e.is_outage() { Failure::Outage(format!("sending results: {e}")) } else { Failure::Own(format!("sending results: {e}")) };
                    let outcome = failure.outcome();
                    out.extend(deliveries.into_iter().map(|m| (m, outcome.clone())));
                }
            }
        }
        out
    }

    fn on_received(&self, msgs: &[Delivery]) {
        for m in msgs {
            events::WorkItemReceived { receive_count: m.receive_count, waited: m.age() }.emit();
        }
    }

    async fn on_poison(&self, msg: &Message, reason: &str) {
        // The work item goes to the dead-letter queue next; tell the controller why now.
        let Ok(item) = parse_work_item(&msg.body) else { return };
        // The failed attempts' own counts went with them: the last one's chunk read is counted here.
        let mut requests = RequestCounts::default();
        requests.add(Billed::call(Op::S3GetObject), 1);
        let body = match serde_json::to_string(&ResultMessage::Chunk(failed_result(&item, reason.to_string(), requests))) {
            Ok(b) => b,
            Err(e) => return tracing::error!(error = %e, "cannot encode a failed result"),
        };
        // It carries the work item's trace context on: the controller's span links the job's trace.
        // Signed as the processor's: the controller counts a failure report only from a processor.
        let out = Outgoing {
            attrs: Attrs { trace: msg.attrs.trace.clone(), auth: self.sign(&body), chunk_token: msg.attrs.chunk_token.clone(), ..Attrs::default() },
            body,
            dedup: None,
        };
        let sent = match fleet_io::queue::partition(&self.results, item.partition) {
            Ok(q) => q.send_messages(std::slice::from_ref(&out)).await.map(drop),
            Err(e) => Err(e),
        };
        match sent {
            Ok(_) => self.announce.results(item.partition, 1),
            Err(e) => tracing::warn!(job = %item.job_id, chunk = item.chunk, error = %e, "could not report a failed chunk; the dead letter will"),
        }
        // SQS moves it on its next receive.
        self.announce.dead_letter();
    }

    fn on_error(&self, event: ErrorEvent<'_>) {
        match event {
            ErrorEvent::Expired { dead_lettered: true, .. } => self.announce.dead_letter(),
            event => tracing::debug!(?event, "listener event"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fleet_domain::model::{BlobRef, WIRE_VERSION};
    use fleet_io::auth::{Keyring, Refused, Role};
    use fleet_io::memory::{MemoryQueue, MemoryStore};

    use super::*;

    fn item(chunk: u32) -> WorkItem {
        let blob = BlobRef { key: fleet_domain::layout::chunk_key("j1", chunk), sha256: "0".repeat(64), compressed_bytes: 10, raw_bytes: 20 };
        WorkItem { v: WIRE_VERSION, job_id: "j1".into(), chunk, transactions: 2, blob, tariff: Default::default(), partition: 0 }
    }

    fn handler(results: &Arc<MemoryQueue>, key: Option<Key>) -> WorkHandler {
        WorkHandler::new("work", results.clone(), MemoryStore::new(), 1 << 20, Announce::default(), false).with_signing_key(key)
    }

    /// Every message on `q`, taken off it: its body and signature.
    async fn taken(q: &MemoryQueue) -> Vec<(String, Option<String>)> {
        let got = q.receive(10, Duration::ZERO).await.unwrap();
        let out = got.iter().map(|d| (d.body.clone(), d.attrs.auth.clone())).collect();
        q.delete(got).await.unwrap();
        out
    }

    /// A job's results (two chunks: one batch) and a failure report (a work item's last receive),
    /// sent by a processor with a key and by one without.
    async fn sent_by(key: Option<Key>) -> Vec<(String, Option<String>)> {
        let results = MemoryQueue::new("results", Duration::from_secs(30));
        let h = handler(&results, key);
        let billed = (0..2).map(|c| (failed_result(&item(c), "billed elsewhere".into(), RequestCounts::default()), None)).collect();
        // Each result passes its work item's chunk token on.
        let tokens = vec![Some("token-0".to_string()), Some("token-1".to_string())];
        h.send_job(&tracing::Span::none(), "j1", 0, billed, tokens).await.unwrap();
        let attrs = Attrs { chunk_token: Some("token-2".into()), ..Attrs::default() };
        let poison = Message { id: "m2".into(), body: serde_json::to_string(&item(2)).unwrap(), receive_count: 5, sent_ms: None, attrs };
        h.on_poison(&poison, "it kept failing").await;
        let got = results.receive(10, Duration::ZERO).await.unwrap();
        let mut passed: Vec<Option<String>> = got.iter().map(|d| d.attrs.chunk_token.clone()).collect();
        passed.sort();
        assert_eq!(passed, ["token-0", "token-1", "token-2"].map(|t| Some(t.to_string())), "each result carries its work item's chunk token");
        for d in got {
            d.release(results.as_ref(), Duration::ZERO).await.unwrap();
        }
        let sent = taken(&results).await;
        assert_eq!(sent.len(), 3, "two results and a failure report: {sent:?}");
        assert!(sent.iter().any(|(b, _)| b.contains("it kept failing")), "the failure report: {sent:?}");
        sent
    }

    #[tokio::test]
    async fn results_and_failure_reports_are_signed_as_a_processors_with_its_key() {
        let key = Key::generate(Role::Processor);
        let ring = Keyring::new([key.clone()]);
        for (body, auth) in sent_by(Some(key)).await {
            assert_eq!(ring.verify(&body, auth.as_deref()), Ok(Role::Processor), "{body}");
        }
    }

    #[tokio::test]
    async fn without_a_key_they_go_unsigned() {
        let ring = Keyring::new([Key::generate(Role::Processor)]);
        for (body, auth) in sent_by(None).await {
            assert_eq!(auth, None, "{body}");
            assert_eq!(ring.verify(&body, auth.as_deref()), Err(Refused::Unsigned));
        }
    }
}
