//! The messages and documents that travel between the fleet's parts: work items on the work queue,
//! chunk results on the results queue, the job manifest and the controller's checkpoint on S3.
//! Every document carries a version field so that old and new fleet members can tell each other apart.
//!
//! Why one file of ~500 lines: these are the wire formats, read by every role; kept together, a
//! change to one document is seen beside the others it must stay compatible with (the submission's
//! metadata, the kept list of a partial job, the checkpoint's progress). The logic that acts on
//! them lives elsewhere.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::billing::{AccountTotals, Tariff};
use crate::requests::RequestCounts;
pub use crate::transaction::Transaction;

/// Version of the wire format written by this build.
pub const WIRE_VERSION: u32 = 1;

/// A chunk blob on S3 (claim check): where it is and how to verify it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    pub key: String,
    /// Lowercase hex SHA-256 of the stored (compressed) bytes.
    pub sha256: String,
    pub compressed_bytes: u64,
    /// Size after decompression; the processor refuses to expand past it.
    pub raw_bytes: u64,
}

/// What the initiator records of a chunk as it writes its blob (the blob's user metadata): the job's
/// own word on the chunk, against which the controller checks every result, failure report and dead
/// letter that names it, and by which it caps what their payloads may decode to. A message's own
/// figures are never taken on trust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRecord {
    /// Transactions in the chunk.
    pub transactions: u64,
    /// The chunk's CSV size, decompressed.
    pub raw_bytes: u64,
    /// The results partition the job's messages travel on (`None`: a chunk written by an initiator
    /// before partitions were recorded): a message about the job read from any other partition is a
    /// stray, never a reason to load or lease the job there.
    pub partition: Option<u16>,
}

impl ChunkRecord {
    pub fn to_meta(self) -> std::collections::BTreeMap<String, String> {
        let mut m: std::collections::BTreeMap<String, String> =
            [("transactions", self.transactions.to_string()), ("raw-bytes", self.raw_bytes.to_string())].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        if let Some(p) = self.partition {
            m.insert("partition".into(), p.to_string());
        }
        m
    }

    /// `None` when the metadata does not hold a record (a chunk written by an initiator before records).
    pub fn from_meta(m: &std::collections::BTreeMap<String, String>) -> Option<ChunkRecord> {
        Some(ChunkRecord {
            transactions: m.get("transactions")?.parse().ok()?,
            raw_bytes: m.get("raw-bytes")?.parse().ok()?,
            partition: m.get("partition").and_then(|p| p.parse().ok()),
        })
    }
}

/// What the initiator says of a submission as it begins it, in the metadata of the job's first object
/// (`jobs/{job}/tariff.json`): the input files' names and the time, so that `initiator jobs` shows
/// them with one HEAD, for a job still being read as for a finished one. Object metadata holds about
/// 2 KB: names are kept whole while they fit in [`Submission::FILES_BYTES`] and the rest counted.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Submission {
    pub files: Vec<String>,
    /// Files left out for room.
    pub more_files: usize,
    /// RFC 3339, UTC.
    pub submitted_at: String,
}

impl Submission {
    /// The room the file names take in the metadata, encoded.
    pub const FILES_BYTES: usize = 1_024;

    pub fn new(files: &[String], submitted_at: String) -> Submission {
        let mut kept = Vec::new();
        let mut used = 0;
        for f in files {
            let n = Self::encode(f).len() + 1;
            if used + n > Self::FILES_BYTES {
                break;
            }
            used += n;
            kept.push(f.clone());
        }
        Submission { more_files: files.len() - kept.len(), files: kept, submitted_at }
    }

    /// A name as metadata may carry it: printable ASCII, `%` and `,` escaped (names are joined by `,`).
    fn encode(name: &str) -> String {
        const SET: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%').add(b',').add(b' ');
        percent_encoding::utf8_percent_encode(name, SET).to_string()
    }

    pub fn to_meta(&self) -> std::collections::BTreeMap<String, String> {
        let files = self.files.iter().map(|f| Self::encode(f)).collect::<Vec<_>>().join(",");
        [("files", files), ("more-files", self.more_files.to_string()), ("submitted-at", self.submitted_at.clone())]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// `None` when the metadata holds no submission (a job begun by an initiator before it was kept).
    pub fn from_meta(m: &std::collections::BTreeMap<String, String>) -> Option<Submission> {
        let files = m.get("files")?;
        let files = if files.is_empty() {
            Vec::new()
        } else {
            files.split(',').map(|f| percent_encoding::percent_decode_str(f).decode_utf8_lossy().into_owned()).collect()
        };
        Some(Submission { files, more_files: m.get("more-files").and_then(|n| n.parse().ok()).unwrap_or(0), submitted_at: m.get("submitted-at")?.clone() })
    }
}

/// The failed chunks of a finished job whose blobs are kept for `initiator retry` (written by the
/// job's controller before its report, at `jobs/{job}/kept.json`; the purge leaves those blobs), until
/// a retry has billed their rows or the operator gives them up (`retry --give-up`). The bucket's
/// lifecycle rule for `jobs/` ends them after 30 days whatever happens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kept {
    pub v: u32,
    pub job_id: String,
    /// Chunk numbers, ascending.
    pub chunks: Vec<u32>,
}

/// The small message on the work queue that references one chunk blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkItem {
    pub v: u32,
    pub job_id: String,
    /// 0-based chunk number within the job. (Work items go out while the input is still being read,
    /// so they do not know the job's size; the `Sealed` result message tells the controller.)
    pub chunk: u32,
    pub transactions: u64,
    pub blob: BlobRef,
    pub tariff: Tariff,
    /// The results partition its job's messages travel on (see `layout::partition_of`); 0 from an
    /// initiator before partitions.
    #[serde(default)]
    pub partition: u16,
}

/// How a chunk's per-account totals travel back: inline, compressed inline, or as a blob reference
/// when they are too large for a queue message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "encoding", rename_all = "snake_case")]
pub enum AccountsPayload {
    Inline {
        accounts: Vec<AccountTotals>,
    },
    /// Base64 of zstd-compressed CSV rows (`codec::accounts_to_zstd_csv`).
    ZstdCsv {
        data: String,
    },
    /// A blob holding zstd-compressed CSV rows.
    Blob {
        blob: BlobRef,
    },
}

/// What happened to a chunk (in its result message). Not the listener's `fleet_engine::Outcome`
/// (what becomes of a received message).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ChunkOutcome {
    Processed { payload: AccountsPayload },
    Failed { reason: String },
}

/// A message on the results queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ResultMessage {
    Chunk(ChunkResult),
    /// Sent by the initiator once every work item of the job is out and the manifest is written: the job
    /// has `total_chunks` chunks (possibly none). The controller finishes a job only after this.
    Sealed {
        v: u32,
        job_id: String,
        total_chunks: u32,
    },
    /// Sent by `initiator abandon`: finish the job now as `abandoned` with what was processed.
    Abandon {
        v: u32,
        job_id: String,
        reason: String,
    },
    /// A work item that reached the work queue's dead-letter queue (shared by every partition),
    /// forwarded by a controller to its job's partition: the chunk failed on every allowed attempt.
    DeadLettered {
        v: u32,
        item: WorkItem,
        /// Times it was received before it was dead-lettered.
        receives: u32,
        /// Why a listener moved it (e.g. `expired`), when it said.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

impl ResultMessage {
    pub fn job_id(&self) -> &str {
        match self {
            ResultMessage::Chunk(c) => &c.job_id,
            ResultMessage::Sealed { job_id, .. } | ResultMessage::Abandon { job_id, .. } => job_id,
            ResultMessage::DeadLettered { item, .. } => &item.job_id,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkResult {
    pub v: u32,
    pub job_id: String,
    pub chunk: u32,
    pub transactions: u64,
    #[serde(flatten)]
    pub outcome: ChunkOutcome,
    /// SQS and S3 calls the processor made for this chunk.
    pub requests: RequestCounts,
}

/// A rejected input row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejected {
    pub file: String,
    pub line: u64,
    pub txn_id: Option<String>,
    pub reason: String,
}

/// Written by the initiator to `jobs/{job}/manifest.json` before any work item is sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub v: u32,
    pub job_id: String,
    pub created_at: String,
    pub files: Vec<String>,
    pub submitted: u64,
    pub accepted: u64,
    pub rejected: Vec<Rejected>,
    pub total_chunks: u32,
    /// Transactions in each chunk, by chunk number.
    pub chunk_transactions: Vec<u64>,
    pub tariff: Tariff,
    /// Calls the initiator made for this job, including the sends that follow the manifest.
    pub requests: RequestCounts,
    /// The results partition the job's messages travel on (0 before partitions).
    #[serde(default)]
    pub partition: u16,
    /// Where each chunk's rows came from, by chunk number: per input file it read, the first and last
    /// line of its rows (a chunk's rows may be interleaved with other chunks' there). Empty from an
    /// initiator before it was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunk_lines: Vec<Vec<Lines>>,
    /// The finished job whose failed chunks this job bills again (`initiator retry`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completes: Option<String>,
}

/// Lines of one input file that a chunk's rows lie within (1-based, physical lines, inclusive).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lines {
    /// The file's index in the manifest's `files`.
    pub file: u32,
    pub first: u64,
    pub last: u64,
}

impl Manifest {
    /// Where chunk `chunk`'s rows came from, as `file:first-last` for each file (empty: not recorded).
    pub fn chunk_source(&self, chunk: u32) -> Vec<ChunkLines> {
        let spans = self.chunk_lines.get(chunk as usize).map(Vec::as_slice).unwrap_or_default();
        spans.iter().map(|l| ChunkLines { file: self.files.get(l.file as usize).cloned().unwrap_or_default(), first: l.first, last: l.last }).collect()
    }
}

/// A file's line range, named (a failed chunk's, in its report).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkLines {
    pub file: String,
    pub first: u64,
    pub last: u64,
}

/// Job status as seen by users.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Chunks still outstanding.
    Running,
    /// Every accepted transaction was processed.
    Complete,
    /// Finished, but some chunks failed (dead-lettered).
    Partial,
    /// Never sealed within the controller's limit, or abandoned by `initiator abandon`: the report
    /// holds what was processed; chunks without a result are listed as failed when the manifest names them.
    Abandoned,
    /// Its own state could not be read (a corrupt checkpoint or checkpoint part, an unreadable or
    /// oversized manifest): nothing more is applied; the report's note says why, the messages that
    /// arrive for it are kept in the quarantine, and what its checkpoint held is left in place.
    Quarantined,
}

impl JobStatus {
    pub fn is_finished(self) -> bool {
        !matches!(self, JobStatus::Running)
    }
}

/// A chunk that could not be processed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedChunk {
    pub chunk: u32,
    pub transactions: u64,
    pub reason: String,
    /// Where its rows are in the input (filled in the report from the manifest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lines: Vec<ChunkLines>,
}

/// The controller's durable per-job state, `checkpoints/{job}/checkpoint.json.zst`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub v: u32,
    pub job_id: String,
    pub status: JobStatus,
    /// Known once the job's `Sealed` message has arrived.
    pub total_chunks: Option<u32>,
    /// Chunks already counted (processed or failed); a result for one of these is a duplicate.
    pub accounted: BTreeSet<u32>,
    pub processed_transactions: u64,
    pub failed_chunks: Vec<FailedChunk>,
    /// The per-account totals, inline (small jobs); empty when they are kept in `parts`.
    pub accounts: Vec<AccountTotals>,
    /// Large jobs: the totals as a base snapshot and the rows changed since, each a separate object
    /// written once; restored in order, a later row replacing an earlier one of its (account,
    /// currency). A checkpoint rewrites only what changed since the last one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<CheckpointPart>,
    /// Calls counted so far for this job by processors and the controller.
    pub requests: RequestCounts,
    pub updated_at: String,
    /// The job's ending is decided and committed here (its status, the failed chunks it ends with,
    /// its note), with its rows still kept, but its report may not be written yet: whichever
    /// controller loads it writes the report from this state (always the same report), then clears
    /// this and drops the rows.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub finishing: bool,
    /// Why the job ended as it did, when that is not plain (abandoned, stalled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The results partition the job's messages travel on, once a message from a partition was
    /// applied (absent before partitions): a controller that does not read it leaves the job to the
    /// partition's owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<u16>,
    /// When the job's ending was committed (RFC 3339): the report's `finished_at` and the day its
    /// warehouse rows are filed under, the same whoever writes them (absent before the ending, and
    /// in checkpoints written before it was kept: then `updated_at` stands in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    /// Its claims settled (an ending job's, see `controller_core::claims`): the rows another job
    /// billed first, taken out of these totals already. Absent until then: a job loaded without it
    /// claims again (its own claims found as its own), and takes them out of the totals it loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duplicates: Option<Vec<Rejected>>,
}

impl Checkpoint {
    /// When the job's ending was committed: `ended_at`, or `updated_at` in a checkpoint written
    /// before it was kept (the ending's commit was its last write then).
    pub fn ending_time(&self) -> &str {
        self.ended_at.as_deref().unwrap_or(&self.updated_at)
    }
}

/// One object of a checkpoint's totals (`checkpoints/{job}/parts/...`): zstd CSV rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointPart {
    pub key: String,
    pub rows: u64,
    /// Compressed size.
    pub bytes: u64,
    pub sha256: String,
    /// Every row of the job (a base), or only the rows changed since the part before.
    pub full: bool,
}

/// A checkpoint's progress, also stored as the checkpoint object's user metadata, so a follower
/// (`initiator --wait`, `status`) reads it with a HEAD request instead of downloading every account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub status: JobStatus,
    /// Its `Sealed` message has arrived (the number of chunks is known).
    pub sealed: bool,
    /// The job's number of chunks, once sealed (absent from checkpoints of older controllers).
    pub total: Option<u32>,
    pub accounted: u32,
    pub failed: u32,
    pub processed: u64,
    /// When the checkpoint last recorded news of the job (a chunk's first result or failure, its seal,
    /// an abandon, its ending), Unix seconds: a checkpoint that covers only duplicates keeps the time.
    pub updated_unix: i64,
    /// The results partition the job's messages travel on, when the checkpoint says.
    pub partition: Option<u16>,
}

impl Progress {
    pub fn of(cp: &Checkpoint) -> Progress {
        let updated = time::OffsetDateTime::parse(&cp.updated_at, &time::format_description::well_known::Rfc3339);
        Progress {
            // Finished for a follower once its report is there.
            status: if cp.finishing { JobStatus::Running } else { cp.status },
            sealed: cp.total_chunks.is_some(),
            total: cp.total_chunks,
            accounted: cp.accounted.len() as u32,
            failed: cp.failed_chunks.len() as u32,
            processed: cp.processed_transactions,
            updated_unix: updated.map_or(0, |t| t.unix_timestamp()),
            partition: cp.partition,
        }
    }

    pub fn to_meta(self) -> std::collections::BTreeMap<String, String> {
        let status = serde_json::to_value(self.status).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        let total = self.total.map(|t| ("total", t.to_string()));
        let partition = self.partition.map(|p| ("partition", p.to_string()));
        [
            ("status", status),
            ("sealed", self.sealed.to_string()),
            ("accounted", self.accounted.to_string()),
            ("failed", self.failed.to_string()),
            ("processed", self.processed.to_string()),
            ("updated", self.updated_unix.to_string()),
        ]
        .into_iter()
        .chain(total)
        .chain(partition)
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// How long ago the checkpoint last recorded news of the job (zero when unknown or in the future).
    pub fn age(&self) -> std::time::Duration {
        let secs = time::OffsetDateTime::now_utc().unix_timestamp().saturating_sub(self.updated_unix);
        std::time::Duration::from_secs(u64::try_from(secs).unwrap_or(0))
    }

    /// `None` when the metadata is missing or not this format (an older checkpoint: read the body).
    pub fn from_meta(m: &std::collections::BTreeMap<String, String>) -> Option<Progress> {
        Some(Progress {
            status: serde_json::from_value(serde_json::Value::String(m.get("status")?.clone())).ok()?,
            sealed: m.get("sealed")?.parse().ok()?,
            total: m.get("total").and_then(|t| t.parse().ok()),
            accounted: m.get("accounted")?.parse().ok()?,
            failed: m.get("failed")?.parse().ok()?,
            processed: m.get("processed")?.parse().ok()?,
            updated_unix: m.get("updated")?.parse().ok()?,
            partition: m.get("partition").and_then(|p| p.parse().ok()),
        })
    }
}

/// Current UTC time in RFC 3339.
pub fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

/// Parses and checks a work item body (version, chunk key, tariff): what a processor accepts.
pub fn parse_work_item(body: &str) -> crate::Result<WorkItem> {
    let w: WorkItem = serde_json::from_str(body)?;
    if w.v != WIRE_VERSION {
        return Err(crate::Error::Corrupt(format!("work item version {} (this processor reads {WIRE_VERSION})", w.v)));
    }
    crate::layout::check_chunk_key(&w.job_id, w.chunk, &w.blob.key)?;
    w.tariff.check().map_err(|e| crate::Error::Corrupt(format!("tariff: {e}")))?;
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_submission_travels_in_metadata_whatever_its_names() {
        let names = vec!["day 1.csv".to_string(), "ümlaut,comma%.csv".to_string(), String::new()];
        let s = Submission::new(&names, "2026-12-07T21:00:00Z".into());
        let meta = s.to_meta();
        assert!(meta.values().all(|v| v.is_ascii()), "{meta:?}");
        assert_eq!(Submission::from_meta(&meta), Some(Submission { files: names, more_files: 0, submitted_at: "2026-12-07T21:00:00Z".into() }));
        let many: Vec<String> = (0..500).map(|i| format!("part-{i:05}.csv")).collect();
        let s = Submission::new(&many, "t".into());
        assert!(s.to_meta()["files"].len() <= Submission::FILES_BYTES);
        assert_eq!(s.files.len() + s.more_files, 500);
        assert_eq!(Submission::from_meta(&s.to_meta()).unwrap().files, many[..s.files.len()]);
        assert_eq!(Submission::from_meta(&Default::default()), None, "an older job's");
    }
}
