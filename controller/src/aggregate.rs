//! Per-job aggregation, exactly once under at-least-once delivery. Batches are applied in memory; a
//! job's state (which chunks are accounted for, the running per-account totals, failed chunks, request
//! counts) is checkpointed to S3 by `flush`, and only the messages a checkpoint covers are handed back
//! for deletion. A chunk already accounted for is a duplicate however often it arrives. When a sealed
//! job has every chunk accounted for, its report is written at once.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use shared::billing::{AccountTotals, Totals};
use shared::blob::BlobStore;
use shared::codec::{accounts_from_zstd_csv, base64_decode, from_zstd_json, sha256_hex, to_zstd_json};
use shared::error::{Error, Result};
use shared::layout::{accounts_key, check_job_id, checkpoint_key, manifest_key, report_key};
use shared::model::{now_rfc3339, AccountsPayload, Checkpoint, ChunkResult, FailedChunk, JobStatus, Manifest, Outcome, ResultMessage, WorkItem, WIRE_VERSION};
use shared::queue::Message;
use shared::report;
use shared::requests::RequestCounts;

/// Largest decompressed checkpoint, result payload or manifest accepted.
const MAX_DOC_BYTES: u64 = 1 << 30;
/// Finished jobs remembered in memory (to drop late duplicates without an S3 read).
const FINISHED_MEMORY: usize = 10_000;

/// Reason recorded for a chunk known only from its dead-lettered work item.
pub const DEAD_LETTER_REASON: &str = "work item reached the dead-letter queue: processing failed on every allowed attempt";

/// Which queue a batch came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Chunk results from processors.
    Results,
    /// Work items that exhausted their receives.
    WorkDeadLetter,
}

/// What to do with the messages of a batch once applied.
#[derive(Debug, Default)]
pub struct Applied {
    /// Durably applied (or duplicates of finished jobs): delete.
    pub delete: Vec<(Source, String)>,
    /// Unreadable dead letters: hide them for a long time rather than spin on them.
    pub park: Vec<String>,
}

enum Item {
    Result(ResultMessage),
    /// `reason`: set when a listener dead-lettered it itself (e.g. `expired`).
    Dead {
        item: WorkItem,
        receives: u32,
        reason: Option<String>,
    },
}

impl Item {
    fn job_id(&self) -> &str {
        match self {
            Item::Result(r) => r.job_id(),
            Item::Dead { item, .. } => &item.job_id,
        }
    }
}

struct Job {
    cp: Checkpoint,
    totals: Totals,
    /// Applied in memory, not yet covered by a checkpoint: deleted after the next one.
    pending: Vec<(Source, String)>,
}

/// The controller's in-memory view of the jobs it is aggregating.
pub struct Aggregator {
    store: Arc<dyn BlobStore>,
    jobs: HashMap<String, Job>,
    finished: HashMap<String, JobStatus>,
    finished_order: VecDeque<String>,
}

impl Aggregator {
    pub fn new(store: Arc<dyn BlobStore>) -> Aggregator {
        Aggregator { store, jobs: HashMap::new(), finished: HashMap::new(), finished_order: VecDeque::new() }
    }

    /// Applies one received batch. Messages of a job whose state could not be saved are not deleted
    /// (they come back), and that job is reloaded from its last checkpoint next time.
    pub async fn apply(&mut self, source: Source, msgs: &[Message]) -> Applied {
        let mut applied = Applied::default();
        let mut groups: BTreeMap<String, Vec<(usize, Item)>> = BTreeMap::new();
        for (i, m) in msgs.iter().enumerate() {
            match parse(source, m) {
                Ok(item) => groups.entry(item.job_id().to_string()).or_default().push((i, item)),
                Err(e) => {
                    tracing::error!(?source, message_id = %m.id, receive_count = m.receive_count, error = %e, "unreadable message");
                    // An unreadable result is left to reach the results dead-letter queue; an unreadable
                    // dead letter is parked where an operator can find it.
                    if source == Source::WorkDeadLetter {
                        applied.park.push(m.receipt.clone());
                    }
                }
            }
        }
        for (job_id, items) in groups {
            let receipts: Vec<(Source, String)> = items.iter().map(|(i, _)| (source, msgs[*i].receipt.clone())).collect();
            let items: Vec<Item> = items.into_iter().map(|(_, it)| it).collect();
            match self.apply_job(&job_id, items, receipts).await {
                Ok(deletable) => applied.delete.extend(deletable),
                Err(e) => {
                    // Everything applied since the last checkpoint is dropped with the job; those
                    // messages were not deleted and come back.
                    tracing::warn!(job = %job_id, error = %e, "could not apply results; they will be redelivered");
                    self.jobs.remove(&job_id);
                }
            }
        }
        applied
    }

    /// Applies a job's items; returns the receipts that may be deleted now (the job finished, or the
    /// messages belong to a job finished before).
    async fn apply_job(&mut self, job_id: &str, items: Vec<Item>, receipts: Vec<(Source, String)>) -> Result<Vec<(Source, String)>> {
        if self.finished.contains_key(job_id) {
            tracing::debug!(job = %job_id, n = items.len(), "late duplicates of a finished job");
            return Ok(receipts);
        }
        let mut ctl = RequestCounts::default();
        ctl.add("sqs.ReceiveMessage", 1);
        if !self.jobs.contains_key(job_id) {
            let job = self.load(job_id, &mut ctl).await?;
            if job.cp.status.is_finished() {
                self.remember_finished(job_id, job.cp.status);
                return Ok(receipts);
            }
            self.jobs.insert(job_id.to_string(), job);
        }
        let store = self.store.clone();
        let job = self.jobs.get_mut(job_id).expect("job loaded above");
        for item in items {
            apply_item(job, item, store.as_ref(), &mut ctl).await?;
        }
        job.pending.extend(receipts);
        job.cp.requests.merge(&ctl);
        if job.cp.total_chunks != Some(job.cp.accounted.len() as u32) {
            return Ok(Vec::new());
        }
        let mut job = self.jobs.remove(job_id).expect("job loaded above");
        let mut done = RequestCounts::default();
        done.add("s3.GetObject", 1); // the manifest
        done.add("s3.PutObject", 3); // report, accounts.csv, checkpoint
        done.add("sqs.DeleteMessageBatch", delete_calls(&job.pending));
        job.cp.requests.merge(&done);
        let status = match finalize(&mut job, store.as_ref()).await {
            Ok(s) => s,
            Err(e) => {
                self.jobs.insert(job_id.to_string(), job);
                return Err(e);
            }
        };
        self.remember_finished(job_id, status);
        Ok(job.pending)
    }

    /// Messages applied in memory and waiting for a checkpoint.
    pub fn pending(&self) -> usize {
        self.jobs.values().map(|j| j.pending.len()).sum()
    }

    /// Checkpoints every job with pending messages and returns those messages for deletion. A job
    /// whose checkpoint fails is dropped from memory (reloaded from its last checkpoint later); its
    /// messages are not returned, so they come back.
    pub async fn flush(&mut self) -> Vec<(Source, String)> {
        let mut out = Vec::new();
        let dirty: Vec<String> = self.jobs.iter().filter(|(_, j)| !j.pending.is_empty()).map(|(k, _)| k.clone()).collect();
        for job_id in dirty {
            let job = self.jobs.get_mut(&job_id).expect("listed above");
            let mut ctl = RequestCounts::default();
            ctl.add("s3.PutObject", 1);
            ctl.add("sqs.DeleteMessageBatch", delete_calls(&job.pending));
            job.cp.requests.merge(&ctl);
            match save_checkpoint(job, self.store.as_ref()).await {
                Ok(()) => out.append(&mut job.pending),
                Err(e) => {
                    tracing::warn!(job = %job_id, error = %e, "checkpoint failed; its messages will be redelivered");
                    self.jobs.remove(&job_id);
                }
            }
        }
        out
    }

    async fn load(&self, job_id: &str, ctl: &mut RequestCounts) -> Result<Job> {
        ctl.add("s3.GetObject", 1);
        match self.store.get(&checkpoint_key(job_id)).await? {
            Some(data) => {
                let mut cp: Checkpoint = from_zstd_json(&data, MAX_DOC_BYTES)?;
                let mut totals = Totals::new();
                totals.add_all(cp.accounts.iter());
                cp.accounts = Vec::new();
                tracing::info!(job = %job_id, accounted = cp.accounted.len(), total = cp.total_chunks, status = ?cp.status, "resumed job from checkpoint");
                Ok(Job { cp, totals, pending: Vec::new() })
            }
            None => Ok(Job {
                cp: Checkpoint {
                    v: WIRE_VERSION,
                    job_id: job_id.to_string(),
                    status: JobStatus::Running,
                    total_chunks: None,
                    accounted: Default::default(),
                    processed_transactions: 0,
                    failed_chunks: Vec::new(),
                    accounts: Vec::new(),
                    requests: RequestCounts::default(),
                    updated_at: now_rfc3339(),
                },
                totals: Totals::new(),
                pending: Vec::new(),
            }),
        }
    }

    fn remember_finished(&mut self, job_id: &str, status: JobStatus) {
        if self.finished.insert(job_id.to_string(), status).is_none() {
            self.finished_order.push_back(job_id.to_string());
            if self.finished_order.len() > FINISHED_MEMORY {
                if let Some(old) = self.finished_order.pop_front() {
                    self.finished.remove(&old);
                }
            }
        }
    }
}

/// DeleteMessageBatch calls needed for these receipts (per queue, ten at a time).
fn delete_calls(receipts: &[(Source, String)]) -> u64 {
    let results = receipts.iter().filter(|(s, _)| *s == Source::Results).count();
    let dead = receipts.len() - results;
    (results.div_ceil(10) + dead.div_ceil(10)) as u64
}

fn parse(source: Source, m: &Message) -> Result<Item> {
    let item = match source {
        Source::Results => Item::Result(serde_json::from_str(&m.body)?),
        Source::WorkDeadLetter => Item::Dead { item: serde_json::from_str(&m.body)?, receives: m.receive_count, reason: m.attrs.reason.clone() },
    };
    check_job_id(item.job_id())?;
    Ok(item)
}

async fn apply_item(job: &mut Job, item: Item, store: &dyn BlobStore, ctl: &mut RequestCounts) -> Result<()> {
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
        Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions),
        Item::Dead { item, .. } => (item.chunk, item.transactions),
    };
    if cp.total_chunks.is_some_and(|t| chunk >= t) {
        // Not from this job as we know it: drop it loudly rather than corrupt the totals.
        tracing::error!(job = %cp.job_id, chunk, total = ?cp.total_chunks, "chunk beyond the job's size; ignored");
        return Ok(());
    }
    if cp.accounted.contains(&chunk) {
        // The processor's own failure report says more than the dead letter: keep its reason.
        if let Item::Result(ResultMessage::Chunk(ChunkResult { outcome: Outcome::Failed { reason }, .. })) = &item {
            if let Some(f) = cp.failed_chunks.iter_mut().find(|f| f.chunk == chunk && f.reason == DEAD_LETTER_REASON) {
                f.reason = reason.clone();
            }
        }
        tracing::debug!(job = %cp.job_id, chunk, "duplicate; already counted");
        return Ok(());
    }
    match item {
        Item::Result(ResultMessage::Chunk(c)) => {
            match c.outcome {
                Outcome::Processed { payload } => {
                    let accounts = decode_payload(payload, store, ctl).await?;
                    let counted: u64 = accounts.iter().map(|a| a.count).sum();
                    if counted == c.transactions {
                        job.totals.add_all(accounts.iter());
                        cp.processed_transactions += counted;
                    } else {
                        cp.failed_chunks.push(FailedChunk {
                            chunk,
                            transactions,
                            reason: format!("result counts {counted} transactions, the chunk has {}", c.transactions),
                        });
                    }
                }
                Outcome::Failed { reason } => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason }),
            }
            cp.requests.merge(&c.requests);
        }
        Item::Dead { receives, reason, .. } => {
            tracing::warn!(job = %cp.job_id, chunk, receives, ?reason, "work item dead-lettered; chunk recorded as failed");
            cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: reason.unwrap_or_else(|| DEAD_LETTER_REASON.to_string()) });
        }
        Item::Result(ResultMessage::Sealed { .. }) => {}
    }
    cp.accounted.insert(chunk);
    Ok(())
}

async fn decode_payload(payload: AccountsPayload, store: &dyn BlobStore, ctl: &mut RequestCounts) -> Result<Vec<AccountTotals>> {
    match payload {
        AccountsPayload::Inline { accounts } => Ok(accounts),
        AccountsPayload::ZstdCsv { data } => accounts_from_zstd_csv(&base64_decode(&data)?, MAX_DOC_BYTES),
        AccountsPayload::Blob { blob } => {
            ctl.add("s3.GetObject", 1);
            let data = store
                .get(&blob.key)
                .await?
                .ok_or_else(|| Error::NotFound { service: shared::error::Service::S3, what: format!("result blob {} does not exist", blob.key) })?;
            if sha256_hex(&data) != blob.sha256 {
                return Err(Error::Corrupt(format!("result blob {} checksum mismatch", blob.key)));
            }
            accounts_from_zstd_csv(&data, blob.raw_bytes.min(MAX_DOC_BYTES))
        }
    }
}

async fn save_checkpoint(job: &mut Job, store: &dyn BlobStore) -> Result<()> {
    job.cp.updated_at = now_rfc3339();
    job.cp.accounts = job.totals.rows();
    let bytes = to_zstd_json(&job.cp);
    job.cp.accounts = Vec::new();
    store.put(&checkpoint_key(&job.cp.job_id), Bytes::from(bytes?), "application/zstd").await
}

/// Writes the report and accounts.csv, then marks the job finished in its checkpoint.
async fn finalize(job: &mut Job, store: &dyn BlobStore) -> Result<JobStatus> {
    let job_id = job.cp.job_id.clone();
    let manifest: Manifest = match store.get(&manifest_key(&job_id)).await? {
        Some(b) => serde_json::from_slice(&b)?,
        None => return Err(Error::NotFound { service: shared::error::Service::S3, what: format!("the manifest of job {job_id} does not exist") }),
    };
    let mut requests = manifest.requests.clone();
    requests.merge(&job.cp.requests);
    let r = report::build(&manifest, &job.totals, job.cp.failed_chunks.clone(), &requests);
    if r.transactions.accepted != r.transactions.processed + r.transactions.failed {
        tracing::error!(job = %job_id, accepted = r.transactions.accepted, processed = r.transactions.processed, failed = r.transactions.failed,
            "accepted != processed + failed: the results disagree with the manifest");
    }
    store.put(&report_key(&job_id), Bytes::from(serde_json::to_vec_pretty(&r)?), "application/json").await?;
    store.put(&accounts_key(&job_id), Bytes::from(report::accounts_csv(&r)), "text/csv").await?;
    job.cp.status = r.status;
    save_checkpoint(job, store).await?;
    tracing::info!(job = %job_id, status = ?r.status, processed = r.transactions.processed, failed = r.transactions.failed,
        requests = r.requests.total, "job finished; report written");
    Ok(r.status)
}

#[cfg(test)]
mod tests;
