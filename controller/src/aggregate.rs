//! Per-job aggregation, exactly once under at-least-once delivery. Batches are applied in memory; a
//! job's state (which chunks are accounted for, the running per-account totals, failed chunks, request
//! counts) is checkpointed to S3 by `flush`, and only the messages a checkpoint covers are handed back
//! for deletion. A chunk already accounted for is a duplicate however often it arrives. When a sealed
//! job has every chunk accounted for, its report is written at once.
//!
//! Nothing strands: results that reached the results dead-letter queue are applied like any other;
//! a result whose payload can never be read (missing or corrupt blob) counts its chunk as failed; an
//! unreadable message is quarantined in S3 and deleted; a job that never seals is finished as
//! `abandoned` after `abandon_after` without news (or at once on an `Abandon` message). Every job has an
//! `open/{job}` marker until it finishes: a controller scans them at start and every `abandon_after`,
//! remembering unsealed jobs by their checkpoint's time only (a HEAD request), so that one whose owner
//! died and whose messages never come back is still abandoned in time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shared::billing::Tariff;
use shared::billing::{AccountTotals, CheckedTotals};
use shared::blob::{BlobStore, Cond};
use shared::codec::{accounts_from_zstd_csv, base64_decode, from_zstd_json, sha256_hex, to_zstd_json};
use shared::error::{Error, Result};
use shared::layout::{accounts_key, check_job_id, checkpoint_key, manifest_key, open_key, report_key, OPEN_PREFIX};
use shared::model::{
    now_rfc3339, AccountsPayload, Checkpoint, ChunkResult, FailedChunk, JobStatus, Manifest, Outcome, Progress, ResultMessage, WorkItem, WIRE_VERSION,
};
use shared::queue::Message;
use shared::report;
use shared::requests::RequestCounts;
use tokio::time::Instant;

use crate::lease::{Acquired, Held, Leases};

/// Largest decompressed checkpoint, result payload or manifest accepted.
const MAX_DOC_BYTES: u64 = 1 << 30;
/// Finished jobs remembered in memory (to drop late duplicates without an S3 read).
const FINISHED_MEMORY: usize = 10_000;

/// Reason recorded for a chunk known only from its dead-lettered work item.
pub const DEAD_LETTER_REASON: &str = "work item reached the dead-letter queue: processing failed on every allowed attempt";

/// Most open-job markers read back at start.
const MAX_OPEN_JOBS: usize = 100_000;

/// Which queue a batch came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// Chunk results from processors, seals and abandons from initiators.
    Results,
    /// Work items that exhausted their receives.
    WorkDeadLetter,
    /// Results (or seals) that exhausted their receives on the results queue, e.g. while S3 was down:
    /// applied like results.
    ResultsDeadLetter,
}

impl Source {
    pub const ALL: [Source; 3] = [Source::Results, Source::WorkDeadLetter, Source::ResultsDeadLetter];

    fn default_queue(self) -> &'static str {
        match self {
            Source::Results => "billing-results",
            Source::WorkDeadLetter => "billing-work-dlq",
            Source::ResultsDeadLetter => "billing-results-dlq",
        }
    }
}

/// What to do with the messages of a batch once applied.
#[derive(Debug, Default)]
pub struct Applied {
    /// Durably applied (or duplicates of finished jobs, or quarantined): delete.
    pub delete: Vec<(Source, String)>,
    /// Messages of jobs another controller owns: hand them back to the queue for their owner.
    pub release: Vec<(Source, String)>,
}

/// What taking a job's lease found.
enum Taken {
    /// In memory now, this controller's.
    Open,
    /// Finished before (remembered; its lease given back).
    Finished,
    /// Another controller holds it.
    Busy,
}

/// What became of a job's messages.
enum Step {
    /// Applied (deletable now, or after the next checkpoint when empty).
    Delete(Vec<(Source, String)>),
    /// The job is another controller's.
    NotMine,
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
    totals: CheckedTotals,
    /// Applied in memory, not yet covered by a checkpoint: deleted after the next one.
    pending: Vec<(Source, String)>,
    /// Last message of this job (or when it was resumed, less its checkpoint's age).
    last_activity: Instant,
    /// Its `open/{job}` marker is known to exist.
    marked_open: bool,
    /// Set by an `Abandon` message: finish now, with this reason.
    abandon: Option<String>,
    /// This controller's lease on the job.
    lease: Held,
    /// ETag of the checkpoint as last read or written (`None`: there is none yet): checkpoints are
    /// written only if it still matches (fencing).
    cp_etag: Option<String>,
}

/// The controller's in-memory view of the jobs it is aggregating.
pub struct Aggregator {
    store: Arc<dyn BlobStore>,
    jobs: HashMap<String, Job>,
    finished: HashMap<String, JobStatus>,
    finished_order: VecDeque<String>,
    queues: HashMap<Source, String>,
    leases: Leases,
    /// Unsealed jobs known only by their open marker, with their last checkpoint's time: loaded when
    /// they are due to be abandoned, or when a message of theirs arrives.
    dormant: HashMap<String, Instant>,
    /// When the open markers were last scanned.
    scanned: Option<Instant>,
}

/// Default lease time of a job (`--lease-secs`).
pub const LEASE: Duration = Duration::from_secs(30);

impl Aggregator {
    /// An aggregator with a random owner name and the default lease time.
    pub fn new(store: Arc<dyn BlobStore>) -> Aggregator {
        Self::with_owner(store, format!("controller-{}", uuid::Uuid::now_v7().simple()), LEASE)
    }

    /// An aggregator that holds job leases as `owner` for `lease` at a time.
    pub fn with_owner(store: Arc<dyn BlobStore>, owner: String, lease: Duration) -> Aggregator {
        let queues = Source::ALL.iter().map(|s| (*s, s.default_queue().to_string())).collect();
        let leases = Leases::new(store.clone(), owner, lease);
        Aggregator {
            store,
            jobs: HashMap::new(),
            finished: HashMap::new(),
            finished_order: VecDeque::new(),
            queues,
            leases,
            dormant: HashMap::new(),
            scanned: None,
        }
    }

    /// Names the queue of a source (recorded with what is quarantined from it).
    pub fn set_queue(&mut self, source: Source, name: &str) {
        self.queues.insert(source, name.to_string());
    }

    /// Applies one received batch. Messages of a job whose state could not be saved are not deleted
    /// (they come back), and that job is reloaded from its last checkpoint next time. Unreadable
    /// messages are quarantined, then deleted.
    pub async fn apply(&mut self, source: Source, msgs: &[Message]) -> Applied {
        let mut applied = Applied::default();
        let mut groups: BTreeMap<String, Vec<(usize, Item)>> = BTreeMap::new();
        for (i, m) in msgs.iter().enumerate() {
            match parse(source, m) {
                Ok(item) => groups.entry(item.job_id().to_string()).or_default().push((i, item)),
                Err(e) => {
                    let queue = self.queues.get(&source).map_or("unknown", String::as_str);
                    match shared::quarantine::put(self.store.as_ref(), queue, m, &e.to_string()).await {
                        Ok(_) => applied.delete.push((source, m.receipt.clone())),
                        Err(qe) => tracing::warn!(queue, message_id = %m.id, error = %qe, "could not quarantine an unreadable message; it will be redelivered"),
                    }
                }
            }
        }
        for (job_id, items) in groups {
            let receipts: Vec<(Source, String)> = items.iter().map(|(i, _)| (source, msgs[*i].receipt.clone())).collect();
            let items: Vec<Item> = items.into_iter().map(|(_, it)| it).collect();
            match self.apply_job(&job_id, items, receipts.clone()).await {
                Ok(Step::Delete(deletable)) => applied.delete.extend(deletable),
                Ok(Step::NotMine) => applied.release.extend(receipts),
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
    async fn apply_job(&mut self, job_id: &str, items: Vec<Item>, receipts: Vec<(Source, String)>) -> Result<Step> {
        if self.finished.contains_key(job_id) {
            tracing::debug!(job = %job_id, n = items.len(), "late duplicates of a finished job");
            return Ok(Step::Delete(receipts));
        }
        let mut ctl = RequestCounts::default();
        ctl.add("sqs.ReceiveMessage", 1);
        // A job in memory whose lease could not be kept fresh is reloaded (or left to its new owner).
        if self.jobs.get(job_id).is_some_and(|j| !self.leases.fresh(&j.lease)) {
            self.keep_lease(job_id).await;
        }
        if !self.jobs.contains_key(job_id) {
            match self.take(job_id, &mut ctl).await? {
                Taken::Open => {}
                Taken::Finished => return Ok(Step::Delete(receipts)),
                Taken::Busy => {
                    tracing::debug!(job = %job_id, n = receipts.len(), "job owned by another controller; messages handed back");
                    return Ok(Step::NotMine);
                }
            }
        }
        let store = self.store.clone();
        let job = self.jobs.get_mut(job_id).expect("job loaded above");
        job.last_activity = Instant::now();
        for item in items {
            apply_item(job, item, store.as_ref(), &mut ctl).await?;
        }
        job.pending.extend(receipts);
        job.cp.requests.merge(&ctl);
        if job.abandon.is_none() && job.cp.total_chunks != Some(job.cp.accounted.len() as u32) {
            return Ok(Step::Delete(Vec::new()));
        }
        self.finish(job_id).await.map(Step::Delete)
    }

    /// Takes a job's lease and loads it from its checkpoint (a new job when there is none).
    async fn take(&mut self, job_id: &str, ctl: &mut RequestCounts) -> Result<Taken> {
        self.dormant.remove(job_id);
        ctl.add("s3.GetObject", 1);
        ctl.add("s3.PutObject", 1);
        let lease = match self.leases.acquire(job_id).await? {
            Acquired::Held(h) => h,
            Acquired::Busy { .. } => return Ok(Taken::Busy),
        };
        let job = self.load(job_id, lease, ctl).await?;
        if job.cp.status.is_finished() {
            self.remember_finished(job_id, job.cp.status);
            let _ = self.leases.release(job_id, &job.lease).await;
            return Ok(Taken::Finished);
        }
        self.jobs.insert(job_id.to_string(), job);
        Ok(Taken::Open)
    }

    /// Renews the lease of a job in memory. The job is dropped (its messages were not deleted and go
    /// to the new owner) when the lease is lost, or could not be renewed and is no longer fresh.
    async fn keep_lease(&mut self, job_id: &str) -> bool {
        let Some(job) = self.jobs.get_mut(job_id) else { return false };
        let kept = match self.leases.renew(job_id, &mut job.lease).await {
            Ok(renewed) => renewed,
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "could not renew a lease");
                self.leases.fresh(&job.lease)
            }
        };
        if !kept {
            tracing::warn!(job = %job_id, pending = job.pending.len(), "lease lost; the job's messages go to its next owner");
            self.jobs.remove(job_id);
        }
        kept
    }

    /// Renews the leases that are due.
    pub async fn renew_leases(&mut self) {
        let due: Vec<String> = self.jobs.iter().filter(|(_, j)| self.leases.due(&j.lease)).map(|(k, _)| k.clone()).collect();
        for job_id in due {
            self.keep_lease(&job_id).await;
        }
    }

    /// Gives back every lease held (on shutdown, after the last checkpoint), so other controllers take
    /// the jobs over at once.
    pub async fn release_leases(&mut self) {
        for (job_id, job) in self.jobs.drain() {
            if let Err(e) = self.leases.release(&job_id, &job.lease).await {
                tracing::warn!(job = %job_id, error = %e, "could not give a lease back; it expires on its own");
            }
        }
    }

    /// Writes the report of a job in memory (complete, or abandoned when it says so) and forgets it;
    /// returns its messages for deletion.
    async fn finish(&mut self, job_id: &str) -> Result<Vec<(Source, String)>> {
        // Still the owner? (A paused owner whose lease lapsed must not write a report.)
        {
            let job = self.jobs.get_mut(job_id).expect("the job is in memory");
            if !self.leases.renew(job_id, &mut job.lease).await? {
                tracing::warn!(job = %job_id, "lease lost before the report; the new owner writes it");
                self.jobs.remove(job_id);
                return Ok(Vec::new());
            }
        }
        let mut job = self.jobs.remove(job_id).expect("the job is in memory");
        let mut done = RequestCounts::default();
        done.add("s3.GetObject", 1); // the manifest
        done.add("s3.PutObject", 3); // report, accounts.csv, checkpoint
        done.add("s3.DeleteObject", 1); // the open marker
        done.add("sqs.DeleteMessageBatch", delete_calls(&job.pending));
        job.cp.requests.merge(&done);
        let status = match finalize(&mut job, self.store.as_ref()).await {
            Ok(s) => s,
            Err(Error::Conflict(why)) => {
                tracing::warn!(job = %job_id, %why, "fenced while finishing: another controller owns the job now");
                return Ok(Vec::new());
            }
            Err(e) => {
                job.cp.requests.sub(&done);
                self.jobs.insert(job_id.to_string(), job);
                return Err(e);
            }
        };
        if let Err(e) = self.store.delete(&open_key(job_id)).await {
            tracing::warn!(job = %job_id, error = %e, "could not remove the open-job marker; the next start removes it");
        }
        let _ = self.leases.release(job_id, &job.lease).await;
        self.remember_finished(job_id, status);
        Ok(job.pending)
    }

    /// Finishes as `abandoned` every unsealed job without news for `after` (in memory, or dormant:
    /// known from its open marker only); returns the messages the reports cover, for deletion. Scans
    /// the open markers again when the last scan is `after` old.
    pub async fn expire(&mut self, after: Duration) -> Vec<(Source, String)> {
        // At start (the first tick) and every `after`: jobs whose owner died and whose messages never
        // come back are found here.
        if self.scanned.is_none_or(|t| t.elapsed() >= after) {
            match self.scan_open().await {
                Ok(n) => tracing::info!(open = n, dormant = self.dormant.len(), "open jobs scanned"),
                Err(e) => tracing::warn!(error = %e, "could not scan the open jobs; trying again later"),
            }
        }
        let now = Instant::now();
        let due: Vec<(String, Instant)> =
            self.dormant.iter().filter(|(_, t)| now.saturating_duration_since(**t) >= after).map(|(k, t)| (k.clone(), *t)).collect();
        for (job_id, since) in due {
            let mut ctl = RequestCounts::default();
            match self.take(&job_id, &mut ctl).await {
                Ok(Taken::Open) => {
                    if let Some(job) = self.jobs.get_mut(&job_id) {
                        job.last_activity = since;
                    }
                }
                Ok(Taken::Finished) => {
                    let _ = self.store.delete(&open_key(&job_id)).await;
                }
                // Its owner abandons it.
                Ok(Taken::Busy) => {}
                Err(e) => {
                    tracing::warn!(job = %job_id, error = %e, "could not load a job due to be abandoned; trying again later");
                    self.dormant.insert(job_id, since);
                }
            }
        }
        let stale: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.cp.total_chunks.is_none() && now.saturating_duration_since(j.last_activity) >= after)
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::new();
        for job_id in stale {
            let job = self.jobs.get_mut(&job_id).expect("listed above");
            tracing::warn!(job = %job_id, accounted = job.cp.accounted.len(), idle_secs = now.saturating_duration_since(job.last_activity).as_secs(), "job never sealed; abandoning it");
            job.abandon = Some(format!("not sealed within {} s of its last result: the submission did not finish", after.as_secs()));
            match self.finish(&job_id).await {
                Ok(done) => out.extend(done),
                Err(e) => tracing::warn!(job = %job_id, error = %e, "could not write the abandoned job's report; trying again later"),
            }
        }
        out
    }

    /// Reads the open-job markers: finished jobs lose theirs, unsealed jobs not in memory are
    /// remembered as dormant with their checkpoint's age (one HEAD request each: no lease is taken and
    /// no checkpoint loaded until one is due). Returns how many unfinished jobs it found.
    pub async fn scan_open(&mut self) -> Result<usize> {
        self.scanned = Some(Instant::now());
        let keys = self.store.list(OPEN_PREFIX, MAX_OPEN_JOBS).await?;
        let mut open = 0;
        for key in keys {
            let job_id = &key[OPEN_PREFIX.len()..];
            if check_job_id(job_id).is_err() || self.finished.contains_key(job_id) {
                continue;
            }
            if self.jobs.contains_key(job_id) {
                open += 1;
                continue;
            }
            // No checkpoint yet (the marker is written just before the first): as good as new.
            let progress = self.store.head(&checkpoint_key(job_id)).await?.and_then(|m| Progress::from_meta(&m));
            if progress.is_some_and(|p| p.status.is_finished()) {
                self.store.delete(&key).await?;
                continue;
            }
            open += 1;
            if progress.is_some_and(|p| p.sealed) {
                // Its results are on their way; a message brings it back.
                continue;
            }
            let age = progress.map_or(Duration::ZERO, |p| p.age());
            self.dormant.entry(job_id.to_string()).or_insert_with(|| Instant::now().checked_sub(age).unwrap_or_else(Instant::now));
        }
        Ok(open)
    }

    /// Jobs held in memory (being aggregated).
    pub fn open_jobs(&self) -> usize {
        self.jobs.len()
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
            let marked = if job.marked_open {
                Ok(())
            } else {
                // Before the first checkpoint: a restarted controller finds the job through it.
                job.cp.requests.add("s3.PutObject", 1);
                self.store.put(&open_key(&job_id), Bytes::new(), "application/octet-stream").await
            };
            let saved = match marked {
                Ok(()) => save_checkpoint(job, self.store.as_ref()).await,
                Err(e) => Err(e),
            };
            match saved {
                Ok(()) => {
                    job.marked_open = true;
                    out.append(&mut job.pending)
                }
                Err(Error::Conflict(why)) => {
                    tracing::warn!(job = %job_id, %why, pending = job.pending.len(), "fenced: another controller owns the job now; its messages go there");
                    self.jobs.remove(&job_id);
                }
                Err(e) => {
                    tracing::warn!(job = %job_id, error = %e, "checkpoint failed; its messages will be redelivered");
                    self.jobs.remove(&job_id);
                }
            }
        }
        out
    }

    async fn load(&self, job_id: &str, lease: Held, ctl: &mut RequestCounts) -> Result<Job> {
        ctl.add("s3.GetObject", 1);
        match self.store.get_tagged(&checkpoint_key(job_id)).await? {
            Some((data, etag)) => {
                let mut cp: Checkpoint = from_zstd_json(&data, MAX_DOC_BYTES)?;
                let mut totals = CheckedTotals::new();
                totals.try_add_all(cp.accounts.iter()).map_err(|e| Error::Corrupt(format!("checkpoint of job {job_id}: {e}")))?;
                cp.accounts = Vec::new();
                tracing::info!(job = %job_id, accounted = cp.accounted.len(), total = cp.total_chunks, status = ?cp.status, "resumed job from checkpoint");
                Ok(Job { cp, totals, pending: Vec::new(), last_activity: Instant::now(), marked_open: true, abandon: None, lease, cp_etag: Some(etag) })
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
                totals: CheckedTotals::new(),
                pending: Vec::new(),
                last_activity: Instant::now(),
                marked_open: false,
                abandon: None,
                lease,
                cp_etag: None,
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
    Source::ALL.iter().map(|s| receipts.iter().filter(|(r, _)| r == s).count().div_ceil(10) as u64).sum()
}

fn parse(source: Source, m: &Message) -> Result<Item> {
    let item = match source {
        Source::Results | Source::ResultsDeadLetter => Item::Result(serde_json::from_str(&m.body)?),
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
        Item::Result(ResultMessage::Abandon { reason, .. }) => {
            tracing::warn!(job = %cp.job_id, %reason, accounted = cp.accounted.len(), "job abandoned on request");
            job.abandon = Some(reason.clone());
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
                Outcome::Processed { payload } => match decode_payload(payload, store, ctl).await {
                    Ok(accounts) => match checked_count(&accounts) {
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
                Outcome::Failed { reason } => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason }),
            }
            cp.requests.merge(&c.requests);
        }
        Item::Dead { receives, reason, .. } => {
            tracing::warn!(job = %cp.job_id, chunk, receives, ?reason, "work item dead-lettered; chunk recorded as failed");
            cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: reason.unwrap_or_else(|| DEAD_LETTER_REASON.to_string()) });
        }
        Item::Result(ResultMessage::Sealed { .. } | ResultMessage::Abandon { .. }) => {}
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
    let meta = Progress::of(&job.cp).to_meta();
    let cond = match &job.cp_etag {
        Some(e) => Cond::Matches(e.clone()),
        None => Cond::Absent,
    };
    match store.put_if(&checkpoint_key(&job.cp.job_id), Bytes::from(bytes?), "application/zstd", &meta, &cond).await? {
        Some(etag) => {
            job.cp_etag = Some(etag);
            Ok(())
        }
        None => Err(Error::Conflict(format!("the checkpoint of job {} was written by another controller", job.cp.job_id))),
    }
}

/// The sum of the rows' counts, unless it does not fit.
fn checked_count(accounts: &[AccountTotals]) -> Option<u64> {
    accounts.iter().try_fold(0u64, |n, a| n.checked_add(a.count))
}

/// Writes the report and accounts.csv, then marks the job finished in its checkpoint. An abandoned job
/// lists the chunks its manifest names that have no result as failed; without a manifest (the
/// submission never finished) the report holds what was processed.
async fn finalize(job: &mut Job, store: &dyn BlobStore) -> Result<JobStatus> {
    let job_id = job.cp.job_id.clone();
    let manifest: Option<Manifest> = match store.get(&manifest_key(&job_id)).await? {
        Some(b) => Some(serde_json::from_slice(&b)?),
        None => None,
    };
    let mut failed = job.cp.failed_chunks.clone();
    let (manifest, note) = match (manifest, &job.abandon) {
        (Some(m), None) => (m, None),
        (None, None) => {
            return Err(Error::NotFound { service: shared::error::Service::S3, what: format!("the manifest of job {job_id} does not exist") });
        }
        (Some(m), Some(reason)) => {
            for chunk in (0..m.total_chunks).filter(|c| !job.cp.accounted.contains(c)) {
                let transactions = m.chunk_transactions.get(chunk as usize).copied().unwrap_or(0);
                failed.push(FailedChunk { chunk, transactions, reason: format!("no result before the job was abandoned: {reason}") });
            }
            (m, Some(format!("abandoned: {reason}")))
        }
        (None, Some(reason)) => {
            let known = job.cp.processed_transactions.saturating_add(failed.iter().fold(0u64, |n, f| n.saturating_add(f.transactions)));
            let m = Manifest {
                v: WIRE_VERSION,
                job_id: job_id.clone(),
                created_at: String::new(),
                files: Vec::new(),
                submitted: known,
                accepted: known,
                rejected: Vec::new(),
                total_chunks: job.cp.accounted.len() as u32,
                chunk_transactions: Vec::new(),
                tariff: Tariff::default(),
                requests: RequestCounts::default(),
            };
            let note = format!(
                "abandoned: {reason}; the submission never finished (no manifest): submitted and accepted count only the transactions of chunks that reported; files, rejected rows and tariff are unknown"
            );
            (m, Some(note))
        }
    };
    let mut requests = manifest.requests.clone();
    requests.merge(&job.cp.requests);
    let mut r = report::build(&manifest, &job.totals, failed, &requests);
    if let Some(note) = note {
        r.status = JobStatus::Abandoned;
        r.note = Some(note);
    }
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
