//! The processor's typed events (as the controller's, after vector's `internal_events`): each
//! happening to a work item is one value whose `emit` writes its log line and updates its metrics
//! together. Registered once ([`register_metrics`]) into the process's `/metrics`.

use std::sync::{LazyLock, Once};

use fleet_engine::metrics::{Histograms, Labels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

static CHUNKS: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static BILLED: LazyLock<Counter> = LazyLock::new(Counter::default);
static RESULTS_SENT: LazyLock<Counter> = LazyLock::new(Counter::default);
static SEND_FAILURES: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static WAITED: LazyLock<Histograms> = LazyLock::new(|| Family::new_with_constructor(wait_histogram as fn() -> Histogram));

/// Seconds, 50 ms to about 27 minutes.
fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 16))
}

/// `first` for a work item's first receive, `again` for a redelivery.
fn delivery(receive_count: u32) -> Labels {
    vec![("delivery".to_string(), if receive_count <= 1 { "first" } else { "again" }.to_string())]
}

/// Adds the processor's metrics to the process's `/metrics` (once).
pub fn register_metrics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Every series there at 0 from the start, not at its first event (a dashboard or an alert finds
        // it on every processor).
        for result in ["billed", "failed", "retried", "held"] {
            drop(CHUNKS.get_or_create(&vec![("result".to_string(), result.to_string())]));
        }
        for n in [1, 2] {
            drop(WAITED.get_or_create(&delivery(n)));
        }
        for cause in ["outage", "other"] {
            drop(SEND_FAILURES.get_or_create(&vec![("cause".to_string(), cause.to_string())]));
        }
        fleet_engine::metrics::register(|r| {
            r.register(
                "processor_chunks",
                "Work items handled, by what became of them: billed, failed (for good: blob missing, corrupt or hostile), retried (failed, tried again), held (a dependency down)",
                CHUNKS.clone(),
            );
            r.register("processor_transactions_billed", "Transactions in chunks billed (before the controller counts each chunk once)", BILLED.clone());
            r.register("processor_results_sent", "Chunk results sent to the results queue", RESULTS_SENT.clone());
            r.register(
                "processor_work_wait_seconds",
                "Time a work item waited in the queue, from its sending to its receive (once per receive), by delivery: first, or again (after a failed or released receive: its wait since it was first sent)",
                WAITED.clone(),
            );
            r.register("processor_results_send_failures", "Batches of results not sent (their work items come back), by cause: outage or other", SEND_FAILURES.clone());
        });
    });
}

fn chunk(kind: &'static str) {
    CHUNKS.get_or_create(&vec![("result".to_string(), kind.to_string())]).inc();
}

/// A work item was received, `waited` after it was sent (when the queue said when: SQS's
/// `SentTimestamp`; a clock behind the queue's counts as no wait rather than none).
pub struct WorkItemReceived {
    pub receive_count: u32,
    pub waited: Option<std::time::Duration>,
}

impl WorkItemReceived {
    pub fn emit(&self) {
        if let Some(w) = self.waited {
            WAITED.get_or_create(&delivery(self.receive_count)).observe(w.as_secs_f64());
        }
    }
}

/// A chunk was billed (its result is sent next).
pub struct ChunkBilled<'a> {
    pub job: &'a str,
    pub chunk: u32,
    pub transactions: u64,
}

impl ChunkBilled<'_> {
    pub fn emit(&self) {
        tracing::trace!(job = %self.job, chunk = self.chunk, transactions = self.transactions, "chunk billed");
        chunk("billed");
        BILLED.inc_by(self.transactions);
    }
}

/// A chunk that can never succeed: its failed result is sent at once.
pub struct ChunkFailedForGood<'a> {
    pub job: &'a str,
    pub chunk: u32,
    pub receive_count: u32,
    pub error: &'a dyn std::fmt::Display,
}

impl ChunkFailedForGood<'_> {
    pub fn emit(&self) {
        tracing::warn!(job = %self.job, chunk = self.chunk, receive_count = self.receive_count, error = %self.error, "chunk can never succeed: failed at once");
        chunk("failed");
    }
}

/// A work item failed and is tried again (with back-off; poison on its last allowed attempt).
pub struct WorkItemRetried<'a> {
    pub job: &'a str,
    pub chunk: u32,
    pub receive_count: u32,
    pub retryable: bool,
    pub error: &'a dyn std::fmt::Display,
}

impl WorkItemRetried<'_> {
    pub fn emit(&self) {
        tracing::warn!(job = %self.job, chunk = self.chunk, receive_count = self.receive_count, retryable = self.retryable, error = %self.error, "work item failed");
        chunk("retried");
    }
}

/// A dependency failed while billing: the work item is held until it answers.
pub struct WorkItemHeld<'a> {
    pub job: &'a str,
    pub chunk: u32,
    pub error: &'a dyn std::fmt::Display,
}

impl WorkItemHeld<'_> {
    pub fn emit(&self) {
        tracing::debug!(job = %self.job, chunk = self.chunk, error = %self.error, "a dependency failed; the work item is held");
        chunk("held");
    }
}

/// One job's results of a batch were sent.
pub struct ResultsSent<'a> {
    pub job: &'a str,
    pub chunks: usize,
}

impl ResultsSent<'_> {
    pub fn emit(&self) {
        tracing::debug!(job = %self.job, chunks = self.chunks, "results sent");
        RESULTS_SENT.inc_by(self.chunks as u64);
    }
}

/// One job's results of a batch could not be sent: its work items are not deleted and come back.
pub struct ResultsNotSent<'a> {
    pub job: &'a str,
    pub outage: bool,
    pub error: &'a dyn std::fmt::Display,
}

impl ResultsNotSent<'_> {
    pub fn emit(&self) {
        tracing::warn!(job = %self.job, outage = self.outage, error = %self.error, "sending results failed; work items will be redelivered");
        SEND_FAILURES.get_or_create(&vec![("cause".to_string(), if self.outage { "outage" } else { "other" }.to_string())]).inc();
    }
}
