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
//! Deciding is pure and the core's (`controller_core::records`: `JobRecords::judge`, and what becomes
//! of a message judged, `Verdict::disposition`); looking records up is `Records::check`, which fetches
//! only what the judgement lacks and caches what it found, per job, until the job finishes (its
//! calls counted by the caller, for the job).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use fleet_domain::layout::{checkpoint_keys, chunk_key, manifest_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{Manifest, Progress, ResultMessage};
use fleet_io::blob::BlobStore;
use fleet_io::error::Result;
use fleet_io::lock;

use super::item::Item;
pub(super) use controller_core::records::{JobRecords, Verdict};

/// Jobs whose records are kept in memory at once (a cache: a job dropped from it is looked up again).
const MAX_JOBS: usize = 10_000;

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
