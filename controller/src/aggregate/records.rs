//! The job's own records as the authority, never a message's word. Every result, failure report, dead
//! letter and seal is checked against what the initiator recorded for its job before anything of it is
//! counted, decoded, or makes a job in memory (a lease, a checkpoint, a report):
//!
//! - a chunk's record is written with its blob, before its work item is sent (the blob's metadata:
//!   transactions and decompressed size, `ChunkRecord`), and the manifest, written before the seal,
//!   names every chunk and its transactions;
//! - a message that contradicts them (a chunk outside the job, a count that differs from the chunk's, a
//!   seal whose size differs from the manifest's) is *refused*: quarantined with the reason, never counted;
//! - a message the job has no record of (no chunk blob, no manifest; or no job at all) waits a bounded
//!   time (a few receives, never into the dead-letter queue) and is then quarantined: S3 reads what was
//!   written before the message was sent, so a record that is still missing never comes;
//! - what a result's payload may decompress and decode to is capped by its chunk's recorded figures
//!   (rows by its transactions, bytes by its size), and held against the aggregator's memory budget.
//!
//! Deciding is pure (`JobRecords::judge`); looking records up is `Records::check`, which fetches
//! only what the judgement lacks and caches what it found, per job, until the job finishes (its
//! calls counted by the caller, for the job).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use fleet_domain::layout::{checkpoint_keys, chunk_key, manifest_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{ChunkRecord, Manifest, Progress, ResultMessage};
use fleet_io::blob::BlobStore;
use fleet_io::error::Result;
use fleet_io::lock;

use super::item::Item;
use super::limits::Figures;

/// Jobs whose records are kept in memory at once (a cache: a job dropped from it is looked up again).
const MAX_JOBS: usize = 10_000;

/// What the job's records say of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It agrees with them: counted, its payload capped by these figures (`None`: it carries none).
    Agrees(Option<Figures>),
    /// It contradicts them: quarantined with the reason, never counted.
    Refused(String),
    /// The job has no record of it: it waits a bounded time, then is quarantined with the reason.
    Unrecorded(String),
}

/// What is known of one job's records.
#[derive(Debug, Clone, Default)]
pub(super) struct JobRecords {
    /// Its manifest, once read (written before the seal; never changed after).
    pub(super) manifest: Option<Arc<Manifest>>,
    /// Its chunks' records as their blobs' metadata gave them.
    pub(super) chunks: BTreeMap<u32, ChunkRecord>,
    /// Chunks whose blob exists without a record (written by an initiator before records): until the
    /// manifest names them, a message about one is held to its own count, its payload capped by that
    /// count alone, as before records.
    pub(super) unrecorded_blobs: std::collections::BTreeSet<u32>,
    /// Its checkpoint exists (the job is known to a controller; a chunk blob may be purged).
    pub(super) checkpointed: bool,
    /// Its manifest exists but cannot be read: no authority for a seal, which is let through so that
    /// the job is quarantined when it would finish (see `quarantine`).
    pub(super) manifest_unreadable: bool,
}

impl JobRecords {
    /// The results partition the job's messages travel on, as its records say (the manifest's, else
    /// any chunk's; `None`: written by an initiator before partitions were recorded, or nothing
    /// looked up yet). Records are written once, by the submitter: no message can move a job.
    pub(super) fn partition(&self) -> Option<u16> {
        match &self.manifest {
            Some(m) => Some(m.partition),
            None => self.chunks.values().find_map(|r| r.partition),
        }
    }

    /// Something of the job is on record.
    fn known(&self) -> bool {
        self.manifest.is_some() || self.manifest_unreadable || self.checkpointed || !self.chunks.is_empty() || !self.unrecorded_blobs.is_empty()
    }

    /// Takes what a HEAD of chunk `c`'s blob found (its metadata; `None`: no blob).
    fn found_chunk(&mut self, c: u32, meta: Option<&BTreeMap<String, String>>) {
        match meta.map(ChunkRecord::from_meta) {
            Some(Some(r)) => {
                self.chunks.insert(c, r);
            }
            Some(None) => {
                self.unrecorded_blobs.insert(c);
            }
            None => {}
        }
    }

    /// Adds what another look at the job found (two batches of one job may look at once).
    fn merge(&mut self, other: JobRecords) {
        if self.manifest.is_none() {
            self.manifest = other.manifest;
        }
        self.chunks.extend(other.chunks);
        self.unrecorded_blobs.extend(other.unrecorded_blobs);
        self.checkpointed |= other.checkpointed;
        self.manifest_unreadable |= other.manifest_unreadable;
    }

    /// The figures of chunk `c` as recorded (`Err`: the manifest says the job has no such chunk; `Ok(None)`:
    /// nothing recorded yet).
    /// `looked`: the manifest was looked up (a chunk blob without a record is judged by it when it exists).
    fn chunk(&self, c: u32, declared: u64, looked: bool) -> std::result::Result<Option<Figures>, String> {
        let blob = self.chunks.get(&c).map(|r| Figures { transactions: r.transactions, raw_bytes: Some(r.raw_bytes) });
        match &self.manifest {
            Some(m) if c >= m.total_chunks => Err(format!("chunk {c} is outside the job: its manifest has {} chunks", m.total_chunks)),
            Some(m) => {
                let n = m.chunk_transactions.get(c as usize).copied();
                Ok(match (blob, n) {
                    (Some(f), _) => Some(f),
                    (None, Some(n)) => Some(Figures { transactions: n, raw_bytes: None }),
                    (None, None) => None,
                })
            }
            // A chunk from the release before records: held to the manifest once it exists (looked
            // up first), and only without one to the message's own count.
            None if blob.is_none() && self.unrecorded_blobs.contains(&c) && looked => Ok(Some(Figures { transactions: declared, raw_bytes: None })),
            None if blob.is_none() && self.unrecorded_blobs.contains(&c) => Ok(None),
            None => Ok(blob),
        }
    }

    /// Judges one message from what is known (`None`: a record it needs has not been looked up).
    /// `looked`: every lookup was made, so what is missing is missing.
    pub(super) fn judge(&self, item: &Item, looked: bool) -> Option<Verdict> {
        let job = item.job_id();
        let (chunk, declared, what) = match item {
            Item::Result(ResultMessage::Sealed { total_chunks, .. }) => {
                return match &self.manifest {
                    Some(m) if m.total_chunks == *total_chunks || crate::undo::is(crate::undo::Fix::SealAgainstManifest) => Some(Verdict::Agrees(None)),
                    Some(m) => Some(Verdict::Refused(format!(
                        "the seal of job {job} says {total_chunks} chunks, its manifest {}: a seal that disagrees with the manifest is never applied",
                        m.total_chunks
                    ))),
                    None if self.manifest_unreadable => Some(Verdict::Agrees(None)),
                    None if looked => Some(Verdict::Unrecorded(format!("job {job} has no manifest: a seal is sent only after it is written"))),
                    None => None,
                };
            }
            Item::Result(ResultMessage::Abandon { .. }) => {
                return if self.known() {
                    Some(Verdict::Agrees(None))
                } else if looked {
                    Some(Verdict::Unrecorded(format!("job {job} has no records (no manifest, checkpoint or first chunk)")))
                } else {
                    None
                };
            }
            Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions, "result"),
            Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => (item.chunk, item.transactions, "dead-lettered work item"),
        };
        match self.chunk(chunk, declared, looked) {
            Err(why) => Some(Verdict::Refused(format!("{what} for job {job}: {why}"))),
            Ok(Some(f)) if f.transactions != declared && !crate::undo::is(crate::undo::Fix::CountAgainstRecord) => Some(Verdict::Refused(format!(
                "{what} for job {job} chunk {chunk} declares {declared} transactions; the chunk has {} as recorded",
                f.transactions
            ))),
            Ok(Some(f)) => Some(Verdict::Agrees(Some(f))),
            Ok(None) if looked => Some(Verdict::Unrecorded(if self.checkpointed || self.manifest.is_some() {
                format!("{what} for job {job} chunk {chunk}: the job has no record of the chunk (no chunk blob)")
            } else {
                format!("{what} for job {job} chunk {chunk}: the job has no records (no chunk blob, manifest or checkpoint)")
            })),
            Ok(None) => None,
        }
    }
}

/// The records of the jobs being aggregated (a bounded cache under one lock; see [`MAX_JOBS`]), and
/// the store they are looked up in.
pub(super) struct Records {
    jobs: Mutex<BTreeMap<String, JobRecords>>,
    store: Arc<dyn BlobStore>,
}

/// What checking a job's messages against its records found.
pub(super) struct Checked {
    pub(super) verdicts: Vec<Verdict>,
    /// The job's checkpoint says it finished (its blobs may be purged): its messages are late duplicates.
    pub(super) finished: Option<fleet_domain::model::JobStatus>,
    /// The results partition the job's records name (see [`JobRecords::partition`]).
    pub(super) partition: Option<u16>,
}

impl Records {
    /// No job's records known yet; they are looked up in `store`.
    pub(super) fn new(store: Arc<dyn BlobStore>) -> Records {
        Records { jobs: Mutex::default(), store }
    }

    /// Checks a job's messages against its records, looking up what is not known yet: the chunk
    /// blobs' records (a HEAD each), the manifest (when a seal needs it or a chunk has no blob), the
    /// checkpoint (when something is still missing: a finished job's purged blobs). A store that does
    /// not answer is an error (the messages are held, as any other).
    pub(super) async fn check(&self, job_id: &str, items: &[Item]) -> Result<Checked> {
        // Most batches are judged from what is known already: no call, no copy of the records.
        let mut rec = {
            let cache = lock(&self.jobs);
            let known = cache.get(job_id);
            let judged: Option<Vec<Verdict>> = known.and_then(|r| items.iter().map(|i| r.judge(i, false)).collect());
            if let Some(verdicts) = judged {
                let partition = known.and_then(JobRecords::partition);
                return Ok(Checked { verdicts, finished: None, partition });
            }
            known.cloned().unwrap_or_default()
        };
        let pending = |rec: &JobRecords| items.iter().any(|i| rec.judge(i, false).is_none());
        // Chunk records first (the manifest names them all, but is written only at the end); an
        // abandon of a job nothing else is known of looks for its first chunk.
        let mut wanted: Vec<u32> = items
            .iter()
            .filter(|i| rec.judge(i, false).is_none())
            .filter_map(|i| if matches!(i, Item::Result(ResultMessage::Abandon { .. })) { Some(0) } else { i.chunk() })
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        let store = self.store.as_ref();
        // The lookups' calls count for the job: the caller reads them off the store's own counter.
        let looked = async {
            let heads = futures::future::join_all(wanted.iter().map(|&c| async move { (c, store.head(&chunk_key(job_id, c)).await) })).await;
            for (c, found) in heads {
                rec.found_chunk(c, found?.as_ref());
            }
            if pending(&rec) && rec.manifest.is_none() {
                if let Some(b) = self.store.get_capped(&manifest_key(job_id), MAX_MANIFEST_BYTES).await? {
                    // One that cannot be read or disagrees with itself is no authority: the job is
                    // quarantined when it is finished (see `quarantine`); its chunks' blobs still are.
                    match serde_json::from_slice::<Manifest>(&b) {
                        Ok(m) if m.chunk_transactions.len() == m.total_chunks as usize && m.job_id == job_id => rec.manifest = Some(Arc::new(m)),
                        _ => {
                            let why = "the job's manifest cannot be read or disagrees with itself: chunks are checked against their blobs' records";
                            tracing::warn!(job = %job_id, "{why}");
                            rec.manifest_unreadable = true;
                        }
                    }
                }
            }
            let mut finished = None;
            if pending(&rec) && !rec.checkpointed {
                if let Some(meta) = fleet_io::blob::head_first(self.store.as_ref(), &checkpoint_keys(job_id)).await? {
                    rec.checkpointed = true;
                    finished = Progress::from_meta(&meta).map(|p| p.status).filter(|s| s.is_finished());
                }
            }
            Ok::<_, fleet_io::Error>(finished)
        }
        .await;
        let finished = looked?;
        let verdicts = items.iter().map(|i| rec.judge(i, true).expect("every lookup made")).collect();
        let partition = rec.partition();
        if rec.known() {
            let mut cache = lock(&self.jobs);
            if cache.len() >= MAX_JOBS && !cache.contains_key(job_id) {
                cache.pop_first();
            }
            cache.entry(job_id.to_string()).or_default().merge(rec);
        }
        Ok(Checked { verdicts, finished, partition })
    }

    /// The job's manifest if its records hold it (read when its seal was checked).
    pub(super) fn manifest(&self, job_id: &str) -> Option<Arc<Manifest>> {
        lock(&self.jobs).get(job_id).and_then(|r| r.manifest.clone())
    }

    /// Forgets a finished job's records.
    pub(super) fn forget(&self, job_id: &str) {
        lock(&self.jobs).remove(job_id);
    }
}

#[cfg(test)]
mod tests {
    //! The judgement alone: no store.
    use super::*;
    use crate::aggregate::limits::{MAX_RESULT_BYTES, ROW_FIGURES_BYTES};
    use fleet_domain::codec::accounts_cap;
    use fleet_domain::model::{ChunkOutcome, ChunkResult};
    use fleet_domain::requests::RequestCounts;

    fn result(chunk: u32, n: u64) -> Item {
        Item::Result(ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: "j".into(),
            chunk,
            transactions: n,
            outcome: ChunkOutcome::Failed { reason: "x".into() },
            requests: RequestCounts::default(),
        }))
    }

    fn seal(n: u32) -> Item {
        Item::Result(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: n })
    }

    fn manifest(chunks: &[u64]) -> Arc<Manifest> {
        let mut m = controller_core::job::placeholder_manifest("j", chunks.len() as u32, chunks.iter().sum());
        m.chunk_transactions = chunks.to_vec();
        Arc::new(m)
    }

    #[test]
    fn messages_are_held_to_the_records_never_the_other_way() {
        let mut r = JobRecords::default();
        assert_eq!(r.judge(&result(0, 3), false), None, "not looked up yet");
        assert!(matches!(r.judge(&result(0, 3), true), Some(Verdict::Unrecorded(_))), "no records at all");
        assert!(matches!(r.judge(&seal(3), true), Some(Verdict::Unrecorded(_))), "a seal without a manifest");
        r.chunks.insert(0, ChunkRecord { transactions: 3, raw_bytes: 300, partition: None });
        let f = Figures { transactions: 3, raw_bytes: Some(300) };
        assert_eq!(r.judge(&result(0, 3), false), Some(Verdict::Agrees(Some(f))));
        assert!(matches!(r.judge(&result(0, 11), false), Some(Verdict::Refused(why)) if why.contains("declares 11 transactions; the chunk has 3")));
        assert_eq!(r.judge(&result(1, 3), false), None, "chunk 1 not looked up yet");
        r.manifest = Some(manifest(&[3, 4, 5]));
        assert_eq!(r.judge(&result(2, 5), false), Some(Verdict::Agrees(Some(Figures { transactions: 5, raw_bytes: None }))), "from the manifest");
        assert!(matches!(r.judge(&result(3, 1), false), Some(Verdict::Refused(why)) if why.contains("outside the job")));
        assert_eq!(r.judge(&seal(3), false), Some(Verdict::Agrees(None)));
        assert!(matches!(r.judge(&seal(1), false), Some(Verdict::Refused(why)) if why.contains("says 1 chunks, its manifest 3")));
    }

    #[test]
    fn a_payload_is_capped_by_its_chunk_not_by_what_it_declares() {
        let f = Figures { transactions: 3, raw_bytes: Some(120) };
        assert_eq!(f.max_rows(), 3);
        assert_eq!(f.max_bytes(), 120 + 3 * ROW_FIGURES_BYTES);
        assert!(f.max_memory() < 2048, "a 3-row chunk's result is held to a few kilobytes: {}", f.max_memory());
        let big = Figures { transactions: 200_000, raw_bytes: None };
        assert_eq!(big.max_bytes(), accounts_cap(200_000, MAX_RESULT_BYTES));
    }
}
