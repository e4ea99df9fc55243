//! The controller's typed events (as vector's `internal_events`): each happening worth a log line and
//! a metric is one value whose `emit` writes both, so they cannot drift apart. Their metrics are
//! registered once ([`register_metrics`]) into every `/metrics` exposition of the process.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{LazyLock, Mutex, Once};
use std::time::Duration;

use fleet_domain::model::JobStatus;
use fleet_engine::metrics::{seconds_histogram, Labels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use serde::Serialize;

static JOBS: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static BILLED: LazyLock<Counter> = LazyLock::new(Counter::default);
static FAILED: LazyLock<Counter> = LazyLock::new(Counter::default);
static LATENCY: LazyLock<Histogram> = LazyLock::new(|| Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.5, 2.0, 16)));
static CHECKPOINT: LazyLock<Histogram> = LazyLock::new(seconds_histogram);
static CHECKPOINT_BYTES: LazyLock<Counter> = LazyLock::new(Counter::default);
static QUARANTINED: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static REFUSED: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static LAST_RESULT: LazyLock<Gauge> = LazyLock::new(Gauge::default);
static OPEN_JOBS: LazyLock<Gauge> = LazyLock::new(Gauge::default);
static PARTITIONS: LazyLock<Gauge> = LazyLock::new(Gauge::default);
static PARTITION_CHANGES: LazyLock<Family<Labels, Counter>> = LazyLock::new(Family::default);
static STRAYS: LazyLock<Counter> = LazyLock::new(Counter::default);

/// The jobs this controller finished last (newest last), for the status page.
static RECENT: Mutex<VecDeque<FinishedView>> = Mutex::new(VecDeque::new());
/// How many finished jobs the status page remembers.
pub const RECENT_JOBS: usize = 50;
/// Failed chunk numbers kept per finished job for the status page (the report has them all).
const FAILED_SHOWN: usize = 20;

/// A finished job as the status page shows it.
#[derive(Debug, Clone, Serialize)]
pub struct FinishedView {
    pub job_id: String,
    pub status: JobStatus,
    pub total_chunks: Option<u32>,
    pub processed: u64,
    pub failed: u64,
    /// Rows another job billed first (not billed again).
    pub duplicates: u64,
    /// The first failed chunks' numbers (at most 20; `failed_chunk_count` says how many).
    pub failed_chunks: Vec<u32>,
    pub failed_chunk_count: usize,
    pub latency_s: Option<f64>,
    /// Unix seconds.
    pub finished_unix: i64,
    pub note: Option<String>,
}

/// The jobs this controller finished last, newest first.
pub fn recent_finished() -> Vec<FinishedView> {
    fleet_io::lock(&RECENT).iter().rev().cloned().collect()
}

/// Adds the controller's metrics to the process's `/metrics` (once).
pub fn register_metrics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The series of a known label value are there at 0 from the start, not at their first event:
        // an alert or a dashboard finds them on every controller (`promtool check metrics` and
        // deploy/e2e/tests/compose.rs look for them). The quarantine's are per queue, made at the first.
        for status in [JobStatus::Complete, JobStatus::Partial, JobStatus::Abandoned, JobStatus::Quarantined] {
            drop(JOBS.get_or_create(&vec![("status".to_string(), status_label(status).to_string())]));
        }
        for why in ["contradicts", "unrecorded", "role"] {
            drop(REFUSED.get_or_create(&vec![("why".to_string(), why.to_string())]));
        }
        for change in ["gained", "given_up"] {
            drop(PARTITION_CHANGES.get_or_create(&vec![("change".to_string(), change.to_string())]));
        }
        fleet_engine::metrics::register(|r| {
            r.register("controller_jobs_finished", "Jobs finished, by status", JOBS.clone());
            r.register("controller_transactions_billed", "Transactions billed into finished jobs' reports", BILLED.clone());
            r.register("controller_transactions_failed", "Transactions of failed chunks in finished jobs' reports", FAILED.clone());
            r.register("controller_job_latency_seconds", "From a job's submission (its manifest) to its report", LATENCY.clone());
            r.register("controller_checkpoint_seconds", "Time to write one checkpoint (document and parts)", CHECKPOINT.clone());
            r.register("controller_checkpoint_part_bytes", "Bytes of checkpoint parts written", CHECKPOINT_BYTES.clone());
            r.register(
                "controller_messages_refused",
                "Messages that contradict their job's records (why=contradicts), that it has no record of (why=unrecorded), or that no role allowed to send them signed (why=role): quarantined, never counted",
                REFUSED.clone(),
            );
            r.register(
                "controller_messages_stray",
                "Messages read from a results partition other than the one their job's records name: forwarded to it, never applied or leased here",
                STRAYS.clone(),
            );
            r.register(
                "controller_messages_quarantined",
                "Messages moved to the quarantine (S3: unreadable, refused against their job's records, or of a quarantined job), by queue",
                QUARANTINED.clone(),
            );
            r.register(
                "controller_last_result_timestamp_seconds",
                "When this controller last applied a message of a job (Unix seconds; 0: never)",
                LAST_RESULT.clone(),
            );
            r.register("controller_open_jobs", "Jobs this controller holds in memory, not finished", OPEN_JOBS.clone());
            r.register("controller_partitions_owned", "Results partitions this controller reads now", PARTITIONS.clone());
            r.register(
                "controller_partition_changes",
                "Results partitions this controller started (change=gained) or stopped (change=given_up) reading",
                PARTITION_CHANGES.clone(),
            );
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
    pub duplicates: u64,
    pub requests: u64,
    /// From its submission, when its manifest says when that was.
    pub latency: Option<Duration>,
    pub total_chunks: Option<u32>,
    pub failed_chunks: &'a [fleet_domain::model::FailedChunk],
    pub note: Option<&'a str>,
}

impl JobFinished<'_> {
    pub fn emit(&self) {
        tracing::info!(job = %self.job, status = ?self.status, processed = self.processed, failed = self.failed, duplicates = self.duplicates, requests = self.requests,
            latency_s = self.latency.map(|l| l.as_secs_f64()), "job finished; report written");
        JOBS.get_or_create(&vec![("status".to_string(), status_label(self.status).to_string())]).inc();
        BILLED.inc_by(self.processed);
        FAILED.inc_by(self.failed);
        if let Some(l) = self.latency {
            LATENCY.observe(l.as_secs_f64());
        }
        let view = FinishedView {
            job_id: self.job.to_string(),
            status: self.status,
            total_chunks: self.total_chunks,
            processed: self.processed,
            failed: self.failed,
            duplicates: self.duplicates,
            failed_chunks: self.failed_chunks.iter().take(FAILED_SHOWN).map(|c| c.chunk).collect(),
            failed_chunk_count: self.failed_chunks.len(),
            latency_s: self.latency.map(|l| l.as_secs_f64()),
            finished_unix: time::OffsetDateTime::now_utc().unix_timestamp(),
            note: self.note.map(str::to_string),
        };
        let mut recent = fleet_io::lock(&RECENT);
        recent.retain(|v| v.job_id != view.job_id);
        recent.push_back(view);
        while recent.len() > RECENT_JOBS {
            recent.pop_front();
        }
    }
}

/// An unreadable message was moved to the quarantine (`initiator dlq list` shows it).
pub struct MessageQuarantined<'a> {
    pub queue: &'a str,
    pub message_id: &'a str,
    pub key: &'a str,
    pub reason: &'a str,
}

impl MessageQuarantined<'_> {
    pub fn emit(&self) {
        tracing::warn!(queue = self.queue, message_id = self.message_id, key = self.key, reason = self.reason, "message quarantined");
        QUARANTINED.get_or_create(&vec![("queue".to_string(), self.queue.to_string())]).inc();
    }
}

/// A message was refused against its job's records (see `controller_core::records`); it is quarantined.
pub struct MessageRefused<'a> {
    pub job: &'a str,
    pub message_id: &'a str,
    pub reason: &'a str,
    /// It contradicts the records (`false`: the job has no record of it).
    pub recorded: bool,
}

impl MessageRefused<'_> {
    pub fn emit(&self) {
        let why = if self.recorded { "contradicts" } else { "unrecorded" };
        tracing::error!(job = self.job, message_id = self.message_id, reason = self.reason, why, "message refused: the job's records say otherwise");
        REFUSED.get_or_create(&vec![("why".to_string(), why.to_string())]).inc();
    }
}

/// A message was not signed by a role that may send it (see `fleet_io::auth`); it is quarantined.
pub struct MessageUnauthorized<'a> {
    pub job: &'a str,
    pub message_id: &'a str,
    pub reason: &'a str,
}

impl MessageUnauthorized<'_> {
    pub fn emit(&self) {
        tracing::error!(
            job = self.job,
            message_id = self.message_id,
            reason = self.reason,
            why = "role",
            "message refused: not sent by a role that may send it"
        );
        REFUSED.get_or_create(&vec![("why".to_string(), "role".to_string())]).inc();
    }
}

/// A message came from a results partition other than its job's (as the job's records name it): it
/// is forwarded there, never applied, loaded or leased here.
pub struct MessageStray<'a> {
    pub job: &'a str,
    pub message_id: &'a str,
    /// The partition it was read from.
    pub from: u16,
    /// Its job's partition.
    pub to: u16,
}

impl MessageStray<'_> {
    pub fn emit(&self) {
        tracing::warn!(job = self.job, message_id = self.message_id, from = self.from, to = self.to, "a stray message: forwarded to its job's partition");
        STRAYS.inc();
    }
}

/// The target of the partition events (the simulation follows who reads what through it).
pub const PARTITIONS_TARGET: &str = "fleet::partitions";

/// This controller started or stopped reading a results partition.
pub struct PartitionChanged<'a> {
    pub owner: &'a str,
    pub partition: u16,
    /// Started (gained) or stopped (given up, lost, or handed back on the way out).
    pub owned: bool,
}

impl PartitionChanged<'_> {
    pub fn emit(&self) {
        let change = if self.owned { "gained" } else { "given_up" };
        PARTITION_CHANGES.get_or_create(&vec![("change".to_string(), change.to_string())]).inc();
        if self.owned {
            PARTITIONS.inc();
        } else {
            PARTITIONS.dec();
        }
        tracing::info!(target: PARTITIONS_TARGET, owner = self.owner, partition = self.partition, change, "results partition {change}");
    }
}

/// A balancing round told this controller to stop reading partitions (asked for by a peer, or
/// taken while it could not renew): all of them stop receiving at once.
pub struct PartitionsToStop<'a> {
    pub owner: &'a str,
    pub partitions: &'a BTreeSet<u16>,
    /// Because the membership went stale (not renewed in time), not by a round's plan.
    pub stale: bool,
}

impl PartitionsToStop<'_> {
    pub fn emit(&self) {
        let partitions: Vec<u16> = self.partitions.iter().copied().collect();
        tracing::info!(target: PARTITIONS_TARGET, owner = self.owner, partitions = ?partitions, stale = self.stale, "stopping results partitions");
    }
}

/// A batch of a job's messages was applied (the job moved, or a duplicate was dropped).
pub struct ResultsApplied {
    /// Jobs this controller holds in memory after the batch.
    pub open_jobs: usize,
}

impl ResultsApplied {
    pub fn emit(&self) {
        LAST_RESULT.set(time::OffsetDateTime::now_utc().unix_timestamp());
        OPEN_JOBS.set(i64::try_from(self.open_jobs).unwrap_or(i64::MAX));
    }
}

/// The jobs in memory were counted again (the timer, so that the gauge falls as jobs finish).
pub fn open_jobs(n: usize) {
    OPEN_JOBS.set(i64::try_from(n).unwrap_or(i64::MAX));
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
