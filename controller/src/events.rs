//! The controller's typed events (as vector's `internal_events`): each happening worth a log line and
//! a metric is one value whose `emit` writes both, so they cannot drift apart. Their metrics are
//! registered once ([`register_metrics`]) into every `/metrics` exposition of the process.

use std::sync::{LazyLock, Once};
use std::time::Duration;

use fleet_domain::model::JobStatus;
use fleet_engine::metrics::{seconds_histogram, Labels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

static JOBS: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static BILLED: LazyLock<Counter> = LazyLock::new(Counter::default);
static FAILED: LazyLock<Counter> = LazyLock::new(Counter::default);
static LATENCY: LazyLock<Histogram> = LazyLock::new(|| Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.5, 2.0, 16)));
static CHECKPOINT: LazyLock<Histogram> = LazyLock::new(seconds_histogram);
static CHECKPOINT_BYTES: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Adds the controller's metrics to the process's `/metrics` (once).
pub fn register_metrics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        fleet_engine::metrics::register(|r| {
            r.register("controller_jobs_finished", "Jobs finished, by status", JOBS.clone());
            r.register("controller_transactions_billed", "Transactions billed into finished jobs' reports", BILLED.clone());
            r.register("controller_transactions_failed", "Transactions of failed chunks in finished jobs' reports", FAILED.clone());
            r.register("controller_job_latency_seconds", "From a job's submission (its manifest) to its report", LATENCY.clone());
            r.register("controller_checkpoint_seconds", "Time to write one checkpoint (document and parts)", CHECKPOINT.clone());
            r.register("controller_checkpoint_part_bytes", "Bytes of checkpoint parts written", CHECKPOINT_BYTES.clone());
        });
    });
}

fn status_label(s: JobStatus) -> &'static str {
    match s {
        JobStatus::Complete => "complete",
        JobStatus::Partial => "partial",
        JobStatus::Abandoned => "abandoned",
        JobStatus::Quarantined => "quarantined",
        _ => "open",
    }
}

/// A job's report was written.
pub struct JobFinished<'a> {
    pub job: &'a str,
    pub status: JobStatus,
    pub processed: u64,
    pub failed: u64,
    pub requests: u64,
    /// From its submission, when its manifest says when that was.
    pub latency: Option<Duration>,
}

impl JobFinished<'_> {
    pub fn emit(&self) {
        tracing::info!(job = %self.job, status = ?self.status, processed = self.processed, failed = self.failed, requests = self.requests,
            latency_s = self.latency.map(|l| l.as_secs_f64()), "job finished; report written");
        JOBS.get_or_create(&vec![("status".to_string(), status_label(self.status).to_string())]).inc();
        BILLED.inc_by(self.processed);
        FAILED.inc_by(self.failed);
        if let Some(l) = self.latency {
            LATENCY.observe(l.as_secs_f64());
        }
    }
}

/// A checkpoint was written.
pub struct CheckpointWritten<'a> {
    pub job: &'a str,
    pub part_bytes: u64,
    pub took: Duration,
}

impl CheckpointWritten<'_> {
    pub fn emit(&self) {
        tracing::debug!(job = %self.job, part_bytes = self.part_bytes, took_ms = self.took.as_millis() as u64, "checkpoint written");
        CHECKPOINT.observe(self.took.as_secs_f64());
        CHECKPOINT_BYTES.inc_by(self.part_bytes);
    }
}
