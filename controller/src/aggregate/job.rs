//! Long because the job is one state machine and its transitions belong together (with their unit
//! tests at the end): a newcomer reads `impl Job` first, then `apply_item`.
//!
//! A job in memory and the items applied to it: parsing a message into an item (a chunk result, a
//! seal, an abandon, a dead-lettered work item), fetching and decoding a result's payload before the
//! job is locked, and applying an item to the job exactly once (a chunk already accounted for is a
//! duplicate however often it arrives). `Pending` holds the deliveries applied but not yet covered by a
//! checkpoint.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::billing::{AccountTotals, CheckedTotals, RowBatch};
use fleet_domain::codec::{accounts_from_zstd_csv_rows, base64_decode, sha256_hex};
use fleet_domain::layout::{check_job_id, result_key};
use fleet_domain::model::{AccountsPayload, Checkpoint, ChunkOutcome, ChunkResult, FailedChunk, JobStatus, Manifest, ResultMessage, WorkItem};
use fleet_domain::requests::RequestCounts;
use fleet_engine::Kept;
use fleet_io::blob::BlobStore;
use fleet_io::error::{Error, Result};
use tokio::time::Instant;

use super::records::Figures;
use super::{Source, DEAD_LETTER_REASON, DECODES};
use crate::clock::Clock;
use crate::lease::Held;
use fleet_io::queue::Message;

pub(super) enum Item {
    Result(ResultMessage),
    /// `reason`: set when a listener dead-lettered it itself (e.g. `expired`).
    Dead {
        item: WorkItem,
        receives: u32,
        reason: Option<String>,
    },
}

/// The job as a state machine: its transitions are these methods, pure (no I/O, no clock but the
/// instants they are given); the aggregator takes, saves and finishes jobs around them.
impl Job {
    /// Sealed, with every chunk accounted for (processed or failed).
    pub(super) fn all_in(&self) -> bool {
        self.cp.total_chunks == Some(self.cp.accounted.len() as u32)
    }

    /// How long the job has had no news at `now` (never counted from before `floor`).
    pub(super) fn quiet_for(&self, now: Instant, floor: Instant) -> Duration {
        now.saturating_duration_since(self.last_activity.max(floor))
    }

    /// Whether it is to be finished now from memory: its ending is committed, or every chunk is in
    /// and none failed, or some failed and nothing came for `settle` (no real result is coming).
    pub(super) fn due_to_finish(&self, now: Instant, floor: Instant, settle: Duration) -> bool {
        self.cp.finishing || (self.all_in() && (self.cp.failed_chunks.is_empty() || self.quiet_for(now, floor) >= settle))
    }

    /// Hands it over to the controller that owns it now (fenced, or its lease lost): what it had applied
    /// since its last checkpoint, to go back to the queue for the owner.
    pub(super) fn hand_over(mut self) -> Vec<Kept> {
        self.pending.take()
    }

    /// Drops it after a failure: the messages it had applied since its last checkpoint, with the
    /// queue each came from (held, to be applied again to the job reloaded from that checkpoint, or
    /// left to come back after their visibility timeout).
    pub(super) fn drop_unsaved(mut self) -> Vec<(Source, Kept)> {
        self.pending.take_all()
    }

    /// Ends it as abandoned for `reason` (a finish that failed before keeps the reason it had).
    pub(super) fn abandon(&mut self, reason: String) {
        self.abandon.get_or_insert(reason);
    }

    /// Ends it as stalled for `reason`: its missing chunks fail (the first reason is kept).
    pub(super) fn stall(&mut self, reason: String) {
        self.stalled.get_or_insert(reason);
    }

    /// Decides how a job ends (in its checkpoint, not yet written): the chunks it ends with as failed
    /// (for an abandoned or stalled job also those its manifest names without a result; each counting
    /// the transactions its manifest gives it, not what a result declared), its status and its note.
    pub(super) fn decide(&mut self, manifest: &Manifest) {
        let placeholder = manifest.created_at.is_empty();
        let mut failed = std::mem::take(&mut self.cp.failed_chunks);
        let note = match (&self.abandon, &self.stalled) {
            (None, None) => None,
            (None, Some(reason)) => {
                let missing = fail_missing(&self.cp, manifest, &mut failed, &format!("no result: {reason}"));
                let shown: Vec<String> = missing.iter().take(20).map(u32::to_string).collect();
                let more = if missing.len() > shown.len() { ", ..." } else { "" };
                Some(format!("finished without {} of its {} chunks ({}{more}): {reason}", missing.len(), manifest.total_chunks, shown.join(", ")))
            }
            (Some(reason), _) if placeholder => Some(format!(
                "abandoned: {reason}; the submission never finished (no manifest): submitted and accepted count only the transactions of chunks that reported; files, rejected rows and tariff are unknown"
            )),
            (Some(reason), _) => {
                fail_missing(&self.cp, manifest, &mut failed, &format!("no result before the job was abandoned: {reason}"));
                Some(format!("abandoned: {reason}"))
            }
        };
        for f in &mut failed {
            if let Some(&n) = manifest.chunk_transactions.get(f.chunk as usize) {
                f.transactions = n;
            }
        }
        self.cp.status = match (&self.abandon, failed.is_empty()) {
            (Some(_), _) => JobStatus::Abandoned,
            (None, true) => JobStatus::Complete,
            (None, false) => JobStatus::Partial,
        };
        self.cp.failed_chunks = failed;
        self.cp.note = note;
        self.cp.finishing = true;
    }
}

impl Item {
    pub(super) fn job_id(&self) -> &str {
        match self {
            Item::Result(r) => r.job_id(),
            Item::Dead { item, .. } => &item.job_id,
        }
    }

    /// The chunk it is about (a result or a dead-lettered work item).
    pub(super) fn chunk(&self) -> Option<u32> {
        match self {
            Item::Result(ResultMessage::Chunk(c)) => Some(c.chunk),
            Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => Some(item.chunk),
            Item::Result(_) => None,
        }
    }
}

pub(super) struct Job {
    pub(super) cp: Checkpoint,
    pub(super) totals: CheckedTotals,
    /// Applied in memory, not yet covered by a checkpoint: deleted after the next one.
    pub(super) pending: Pending,
    /// When it was last checkpointed (or loaded).
    pub(super) saved: Instant,
    /// Last message of this job (or when it was resumed, less its checkpoint's age).
    pub(super) last_activity: Instant,
    /// Its `open/{job}` marker is known to exist.
    pub(super) marked_open: bool,
    /// Set by an `Abandon` message: finish now, with this reason.
    pub(super) abandon: Option<String>,
    /// Set when a sealed job stalled (see `scan`): finish now, its missing chunks failed for this reason.
    pub(super) stalled: Option<String>,
    /// This controller's lease on the job.
    pub(super) lease: Held,
    /// ETag of the checkpoint as last read or written (`None`: there is none yet): checkpoints are
    /// written only if it still matches (fencing).
    pub(super) cp_etag: Option<String>,
    /// The aggregator's clock (a checkpoint's `updated_at`).
    pub(super) clock: Clock,
}

/// Deliveries applied in memory and waiting for a checkpoint, counted for the whole aggregator (also
/// when a job is dropped with them: they come back after their visibility timeout).
pub(super) struct Pending {
    list: Vec<(Source, Kept)>,
    count: Arc<AtomicUsize>,
}

impl Pending {
    pub(super) fn new(count: Arc<AtomicUsize>) -> Pending {
        Pending { list: Vec::new(), count }
    }

    pub(super) fn extend(&mut self, kept: Vec<(Source, Kept)>) {
        self.count.fetch_add(kept.len(), Ordering::Relaxed);
        self.list.extend(kept);
    }

    /// The messages, for their completion.
    pub(super) fn take(&mut self) -> Vec<Kept> {
        self.take_all().into_iter().map(|(_, k)| k).collect()
    }

    /// The messages with the queue each came from (to apply them again).
    pub(super) fn take_all(&mut self) -> Vec<(Source, Kept)> {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
        std::mem::take(&mut self.list)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Kept> {
        self.list.iter().map(|(_, k)| k)
    }

    pub(super) fn len(&self) -> usize {
        self.list.len()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
    }
}

pub(super) fn parse(source: Source, m: &Message) -> Result<Item> {
    let item = match source {
        Source::Results | Source::ResultsDeadLetter => match serde_json::from_str(&m.body)? {
            // A dead-lettered work item forwarded to its job's partition (see `crate::forward`).
            ResultMessage::DeadLettered { item, receives, reason, .. } => Item::Dead { item, receives, reason },
            r => Item::Result(r),
        },
        Source::WorkDeadLetter => Item::Dead { item: serde_json::from_str(&m.body)?, receives: m.receive_count, reason: m.attrs.reason.clone() },
    };
    check_job_id(item.job_id()).map_err(Error::corrupt)?;
    Ok(item)
}

/// An item with its result payload fetched and decoded before its job is locked (`None`: it carries
/// no payload).
pub(super) struct Ready {
    pub(super) item: Item,
    pub(super) accounts: Option<Result<RowBatch>>,
    /// GetObject calls made for it.
    pub(super) gets: u64,
}

impl Ready {
    pub(super) fn is_seal(&self) -> bool {
        matches!(self.item, Item::Result(ResultMessage::Sealed { .. }))
    }
}

/// Fetches and decodes a result's payload, within `figures`: its chunk's recorded figures (see
/// `records`), which it has been checked against.
pub(super) async fn prepare(mut item: Item, figures: Option<Figures>, store: &dyn BlobStore, offload: bool) -> Ready {
    if let Item::Result(ResultMessage::Chunk(ChunkResult { job_id, chunk, transactions, outcome: ChunkOutcome::Processed { payload }, .. })) = &mut item {
        let payload = std::mem::replace(payload, AccountsPayload::Inline { accounts: Vec::new() });
        let gets = u64::from(matches!(payload, AccountsPayload::Blob { .. }));
        // What the payload may decompress and decode to follows from its chunk's record (one account
        // row per transaction at most, no longer than the chunk's rows and their figures), never from
        // what the message declares, and its blob is the one its job and chunk name: a hostile result
        // can neither make the controller inflate a gigabyte nor point it at another job's objects.
        let figures = figures.unwrap_or(Figures { transactions: *transactions, raw_bytes: None });
        let accounts = Some(match &payload {
            AccountsPayload::Blob { blob } if blob.key != result_key(job_id, *chunk) => {
                Err(Error::corrupt(format!("result blob key {:?} is not the key of job {job_id} chunk {chunk}", blob.key)))
            }
            AccountsPayload::Inline { accounts } if accounts.len() as u64 > figures.max_rows() => {
                Err(Error::corrupt(format!("result has {} account rows; its chunk has {} transactions", accounts.len(), figures.transactions)))
            }
            _ => decode_payload(payload, store, figures, offload).await,
        });
        return Ready { item, accounts, gets };
    }
    Ready { item, accounts: None, gets: 0 }
}

/// Applies one item to the job (the transition every message makes).
pub(super) fn apply_item(job: &mut Job, ready: Ready, ctl: &mut RequestCounts) -> Result<()> {
    ctl.add("s3.GetObject", ready.gets);
    let Ready { item, accounts, .. } = ready;
    let cp = &mut job.cp;
    let (chunk, transactions) = match &item {
        Item::Result(ResultMessage::Sealed { total_chunks, .. }) => {
            let total = *total_chunks;
            match cp.total_chunks {
                Some(t) if t != total => tracing::error!(job = %cp.job_id, total, sealed_before = t, "conflicting seal ignored"),
                _ => {
                    if let Some(c) = cp.accounted.iter().find(|&&c| c >= total) {
                        tracing::error!(job = %cp.job_id, chunk = c, total, "a counted chunk lies beyond the sealed size");
                    }
                    cp.total_chunks = Some(total);
                }
            }
            return Ok(());
        }
        Item::Result(ResultMessage::Abandon { reason, .. }) => {
            tracing::warn!(job = %cp.job_id, %reason, accounted = cp.accounted.len(), "job abandoned on request");
            job.abandon = Some(reason.clone());
            return Ok(());
        }
        Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions),
        Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => (item.chunk, item.transactions),
    };
    if cp.total_chunks.is_some_and(|t| chunk >= t) {
        // Not from this job as we know it: drop it loudly rather than corrupt the totals.
        tracing::error!(job = %cp.job_id, chunk, total = ?cp.total_chunks, "chunk beyond the job's size; ignored");
        return Ok(());
    }
    if cp.accounted.contains(&chunk) {
        let real = matches!(&item, Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Processed { .. }, .. })));
        match cp.failed_chunks.iter().position(|f| f.chunk == chunk) {
            // A real result beats a dead letter or a failure report (a work item dead-lettered after
            // it was billed, a processor that died between sending a result and deleting its item):
            // the chunk is counted from it instead, as the job is not finished yet.
            Some(i) if real => {
                let failed = cp.failed_chunks.remove(i);
                cp.accounted.remove(&chunk);
                tracing::warn!(job = %cp.job_id, chunk, was = %failed.reason, "a chunk recorded as failed has its real result: counted from it");
            }
            failed => {
                // The processor's own failure report says more than the dead letter: keep its reason.
                if let (Some(i), Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Failed { reason }, .. }))) = (failed, &item) {
                    if cp.failed_chunks[i].reason == DEAD_LETTER_REASON {
                        cp.failed_chunks[i].reason = reason.clone();
                    }
                }
                tracing::debug!(job = %cp.job_id, chunk, "duplicate; already counted");
                return Ok(());
            }
        }
    }
    match item {
        Item::Result(ResultMessage::Chunk(c)) => {
            match c.outcome {
                ChunkOutcome::Processed { .. } => match accounts.expect("prepared with its payload") {
                    Ok(accounts) => match accounts.transactions() {
                        Some(counted) if counted == c.transactions => match job.totals.try_add_all(accounts.iter()) {
                            Ok(()) => cp.processed_transactions = cp.processed_transactions.saturating_add(counted),
                            Err(e) => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: format!("result not added: {e}") }),
                        },
                        counted => cp.failed_chunks.push(FailedChunk {
                            chunk,
                            transactions,
                            reason: match counted {
                                Some(n) => format!("result counts {n} transactions, the chunk has {}", c.transactions),
                                None => "result counts more transactions than a count can hold".to_string(),
                            },
                        }),
                    },
                    // S3 unreachable: leave the message; it comes back.
                    Err(e) if e.is_retryable() => return Err(e),
                    // Missing or corrupt payload: it never becomes readable; the chunk failed.
                    Err(e) => {
                        tracing::error!(job = %cp.job_id, chunk, error = %e, "result payload unreadable; chunk recorded as failed");
                        cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: format!("result unreadable: {e}") })
                    }
                },
                ChunkOutcome::Failed { reason } => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason }),
            }
            cp.requests.merge(&c.requests);
        }
        Item::Dead { receives, reason, .. } | Item::Result(ResultMessage::DeadLettered { receives, reason, .. }) => {
            tracing::warn!(job = %cp.job_id, chunk, receives, ?reason, "work item dead-lettered; chunk recorded as failed");
            cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: reason.unwrap_or_else(|| DEAD_LETTER_REASON.to_string()) });
        }
        Item::Result(ResultMessage::Sealed { .. } | ResultMessage::Abandon { .. }) => {}
    }
    cp.accounted.insert(chunk);
    Ok(())
}

/// The accounts of a result's payload, decompressed to at most `cap` bytes. Decompression runs on
/// the blocking pool (`offload`; the simulation decodes in place, on its one thread), at most
/// [`DECODES`] at once: a batch of large results neither stalls the async workers nor holds more
/// than that many inflated payloads.
pub(super) async fn decode_payload(payload: AccountsPayload, store: &dyn BlobStore, figures: Figures, offload: bool) -> Result<RowBatch> {
    let (cap, rows) =
        if crate::undo::is(crate::undo::Fix::DecodeCapFromRecord) { (super::MAX_RESULT_BYTES, u64::MAX) } else { (figures.max_bytes(), figures.max_rows()) };
    let (data, cap) = match payload {
        AccountsPayload::Inline { accounts } => return Ok(accounts.iter().map(AccountTotals::borrowed).collect()),
        AccountsPayload::ZstdCsv { data } => (Bytes::from(base64_decode(&data).map_err(Error::corrupt)?), cap),
        AccountsPayload::Blob { blob } => {
            // Compressed, a payload is never larger than it may inflate to (plus zstd's framing).
            let data = store
                .get_capped(&blob.key, cap.saturating_add(1024))
                .await?
                .ok_or_else(|| Error::NotFound { service: fleet_io::error::Service::S3, what: format!("result blob {} does not exist", blob.key) })?;
            if sha256_hex(&data) != blob.sha256 {
                return Err(Error::Corrupt(format!("result blob {} checksum mismatch", blob.key)));
            }
            (data, blob.raw_bytes.min(cap))
        }
    };
    static DECODES_AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(DECODES);
    let _permit = DECODES_AT_ONCE.acquire().await.map_err(|_| Error::Corrupt("decoder closed".into()))?;
    if !offload {
        return accounts_from_zstd_csv_rows(&data, cap, rows).map_err(Error::corrupt);
    }
    match tokio::task::spawn_blocking(move || accounts_from_zstd_csv_rows(&data, cap, rows)).await {
        Ok(r) => r.map_err(Error::corrupt),
        Err(e) => Err(Error::Corrupt(format!("result payload decoder failed: {e}"))),
    }
}

/// Lists every chunk the manifest names that the checkpoint has not accounted for as failed with
/// `reason`; returns those chunks.
fn fail_missing(cp: &Checkpoint, m: &Manifest, failed: &mut Vec<FailedChunk>, reason: &str) -> Vec<u32> {
    let missing: Vec<u32> = (0..m.total_chunks).filter(|c| !cp.accounted.contains(c)).collect();
    for &chunk in &missing {
        let transactions = m.chunk_transactions.get(chunk as usize).copied().unwrap_or(0);
        failed.push(FailedChunk { chunk, transactions, reason: reason.to_string() });
    }
    missing
}

#[cfg(test)]
mod tests {
    //! The job's transitions alone: no store, no queue, no clock but the instants given.
    use super::*;
    use rust_decimal::Decimal;

    fn job() -> Job {
        let clock = Clock::System;
        Job {
            cp: super::super::take::fresh_checkpoint("j", &clock),
            totals: CheckedTotals::new(),
            pending: Pending::new(Arc::default()),
            saved: Instant::now(),
            last_activity: Instant::now(),
            marked_open: false,
            abandon: None,
            stalled: None,
            lease: Held::detached(),
            cp_etag: None,
            clock,
        }
    }

    fn ready(msg: ResultMessage) -> Ready {
        let accounts = match &msg {
            ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts } }, .. }) => {
                Some(Ok(accounts.iter().map(AccountTotals::borrowed).collect()))
            }
            _ => None,
        };
        Ready { item: Item::Result(msg), accounts, gets: 0 }
    }

    fn chunk(c: u32, n: u64) -> Ready {
        let a = AccountTotals { account_id: "a".into(), currency: "EUR".into(), count: n, gross: Decimal::new(100 * n as i64, 2), fees: Decimal::ZERO };
        ready(ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: "j".into(),
            chunk: c,
            transactions: n,
            outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![a] } },
            requests: RequestCounts::default(),
        }))
    }

    fn failed(c: u32) -> Ready {
        ready(ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: "j".into(),
            chunk: c,
            transactions: 99,
            outcome: ChunkOutcome::Failed { reason: "bad".into() },
            requests: RequestCounts::default(),
        }))
    }

    fn manifest(chunks: &[u64]) -> Manifest {
        let mut m = super::super::quarantine::placeholder_manifest("j", chunks.len() as u32, chunks.iter().sum());
        m.created_at = "2026-11-26T00:00:00Z".into();
        m.chunk_transactions = chunks.to_vec();
        m
    }

    #[test]
    fn a_chunk_counts_once_a_real_result_replaces_a_failure_and_the_seal_bounds_the_job() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        apply_item(&mut j, chunk(0, 2), &mut ctl).unwrap();
        apply_item(&mut j, chunk(0, 2), &mut ctl).unwrap();
        apply_item(&mut j, failed(1), &mut ctl).unwrap();
        assert!(!j.all_in(), "not sealed");
        apply_item(&mut j, ready(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: 2 }), &mut ctl).unwrap();
        assert!(j.all_in());
        assert_eq!(j.cp.failed_chunks.len(), 1);
        apply_item(&mut j, chunk(1, 3), &mut ctl).unwrap();
        assert_eq!((j.cp.failed_chunks.len(), j.cp.processed_transactions), (0, 5), "the real result replaced the failure");
        apply_item(&mut j, chunk(7, 50), &mut ctl).unwrap();
        assert_eq!(j.cp.processed_transactions, 5, "beyond the sealed size: ignored");
        j.decide(&manifest(&[2, 3]));
        assert_eq!((j.cp.status, j.cp.finishing, j.cp.note.as_deref()), (JobStatus::Complete, true, None));
    }

    #[test]
    fn a_job_with_a_failure_finishes_only_once_settled_and_its_ending_is_kept() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        for r in [chunk(0, 1), failed(1), ready(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: 2 })] {
            apply_item(&mut j, r, &mut ctl).unwrap();
        }
        let settle = Duration::from_secs(120);
        let t0 = j.last_activity;
        assert!(!j.due_to_finish(t0 + Duration::from_secs(119), t0, settle));
        assert!(j.due_to_finish(t0 + settle, t0, settle));
        assert!(!j.due_to_finish(t0 + settle, t0 + Duration::from_secs(60), settle), "no idle time from before the floor");
        j.decide(&manifest(&[1, 4]));
        assert_eq!(j.cp.status, JobStatus::Partial);
        assert_eq!(j.cp.failed_chunks[0].transactions, 4, "the manifest's count, not the 99 the result declared");
        let mut a = job();
        apply_item(&mut a, chunk(0, 1), &mut ctl).unwrap();
        a.abandon("first".into());
        a.abandon("second".into());
        a.decide(&manifest(&[1, 2, 3]));
        assert_eq!(a.cp.status, JobStatus::Abandoned);
        assert_eq!(a.cp.failed_chunks.iter().map(|f| (f.chunk, f.transactions)).collect::<Vec<_>>(), [(1, 2), (2, 3)]);
        assert_eq!(a.cp.note.as_deref(), Some("abandoned: first"), "a retried finish keeps its ending");
    }

    /// Handing a job over gives back exactly the messages applied since its last checkpoint (for the
    /// new owner), dropping it gives them back with their queues (to hold), and the aggregator's count
    /// of pending messages follows both.
    #[tokio::test]
    async fn a_job_handed_over_or_dropped_gives_back_exactly_its_unsaved_messages() {
        let q = fleet_io::memory::MemoryQueue::new("billing-results", Duration::from_secs(30));
        let done = fleet_engine::Completions::start(q, Default::default());
        let kept = |id: &str| {
            let m = Message { id: id.into(), body: String::new(), receive_count: 1, attrs: Default::default() };
            done.keep(fleet_io::queue::Delivery::new(m, format!("r-{id}")))
        };
        let count = Arc::new(AtomicUsize::new(0));
        let mut a = job();
        a.pending = Pending::new(count.clone());
        a.pending.extend(vec![(Source::Results, kept("1")), (Source::ResultsDeadLetter, kept("2"))]);
        let mut b = job();
        b.pending = Pending::new(count.clone());
        b.pending.extend(vec![(Source::WorkDeadLetter, kept("3"))]);
        assert_eq!(count.load(Ordering::Relaxed), 3);
        let handed: Vec<String> = a.hand_over().iter().map(|k| k.id.clone()).collect();
        assert_eq!(handed, ["1", "2"]);
        assert_eq!(count.load(Ordering::Relaxed), 1);
        let dropped: Vec<(Source, String)> = b.drop_unsaved().into_iter().map(|(s, k)| (s, k.id.clone())).collect();
        assert_eq!(dropped, [(Source::WorkDeadLetter, "3".to_string())]);
        assert_eq!(count.load(Ordering::Relaxed), 0);
    }
}
