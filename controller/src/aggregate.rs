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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::billing::Tariff;
use fleet_domain::billing::{AccountTotals, CheckedTotals};
use fleet_domain::codec::{accounts_from_zstd_csv, accounts_to_zstd_csv, base64_decode, from_zstd_json, sha256_hex, to_zstd_json};
use fleet_domain::layout::{accounts_key, check_job_id, checkpoint_key, checkpoint_parts_prefix, manifest_key, open_key, report_key, OPEN_PREFIX};
use fleet_domain::model::{
    now_rfc3339, AccountsPayload, Checkpoint, CheckpointPart, ChunkResult, FailedChunk, JobStatus, Manifest, Outcome, Progress, ResultMessage, WorkItem,
    WIRE_VERSION,
};
use fleet_domain::report;
use fleet_domain::requests::RequestCounts;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::error::{Error, Result};
use fleet_io::lock;
use fleet_io::queue::Message;
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
    /// Loaded, this controller's.
    Open(Box<Job>),
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
    /// Accounts whose rows changed since the last checkpoint (large jobs write only these).
    changed: HashSet<String>,
    /// Applied in memory, not yet covered by a checkpoint: deleted after the next one.
    pending: Pending,
    /// When it was last checkpointed (or loaded).
    saved: Instant,
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

/// Receipts applied in memory and waiting for a checkpoint, counted for the whole aggregator (also
/// when a job is dropped with them).
struct Pending {
    list: Vec<(Source, String)>,
    count: Arc<AtomicUsize>,
}

impl Pending {
    fn new(count: Arc<AtomicUsize>) -> Pending {
        Pending { list: Vec::new(), count }
    }

    fn extend(&mut self, receipts: Vec<(Source, String)>) {
        self.count.fetch_add(receipts.len(), Ordering::Relaxed);
        self.list.extend(receipts);
    }

    fn take(&mut self) -> Vec<(Source, String)> {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
        std::mem::take(&mut self.list)
    }

    fn len(&self) -> usize {
        self.list.len()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
    }
}

/// One job's place in memory: `None` while it is not loaded (or was dropped after a failure). Each job
/// has its own lock, held across that job's S3 calls only, so jobs progress in parallel.
type Slot = Arc<tokio::sync::Mutex<Option<Job>>>;

/// What checkpoints have written (logged when the controller stops; read by the benchmark).
#[derive(Debug, Default)]
pub struct CheckpointStats {
    /// Checkpoint objects written (documents and parts).
    pub writes: AtomicU64,
    /// Their compressed bytes.
    pub bytes: AtomicU64,
    /// Parts written holding every row of a job (bases).
    pub full_parts: AtomicU64,
    /// Parts written holding only the rows changed since the last checkpoint.
    pub delta_parts: AtomicU64,
}

impl CheckpointStats {
    fn wrote(&self, bytes: usize) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Finished {
    status: HashMap<String, JobStatus>,
    order: VecDeque<String>,
}

/// The controller's in-memory view of the jobs it is aggregating. Shared by every listener: each job
/// is locked on its own, and no lock spans two jobs.
pub struct Aggregator {
    store: Arc<dyn BlobStore>,
    jobs: Mutex<HashMap<String, Slot>>,
    finished: Mutex<Finished>,
    queues: HashMap<Source, String>,
    leases: Leases,
    /// Unsealed jobs known only by their open marker, with their last checkpoint's time: loaded when
    /// they are due to be abandoned, or when a message of theirs arrives.
    dormant: Mutex<HashMap<String, Instant>>,
    /// When the open markers were last scanned.
    scanned: Mutex<Option<Instant>>,
    pending: Arc<AtomicUsize>,
    stats: CheckpointStats,
    /// Jobs whose S3 calls just failed (store unreachable or hung), until when: their messages are
    /// left for redelivery at once instead of each batch waiting out another call deadline.
    failing: Mutex<HashMap<String, Instant>>,
}

/// How long a job's messages are turned back without a try after its S3 calls failed.
const FAILING_FOR: Duration = Duration::from_secs(2);

/// A job with pending messages is checkpointed at least this often (by the controller's timer while
/// it is idle, by its own next batch while busy) ...
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(250);
/// ... and as soon as this many of its messages are pending.
pub const FLUSH_MESSAGES: usize = 100;

/// Default lease time of a job (`--lease-secs`).
pub const LEASE: Duration = Duration::from_secs(30);

/// Jobs with at most this many (account, currency) rows keep them inside the checkpoint document
/// (one PUT per checkpoint); larger ones keep them in parts.
pub const INLINE_ROWS: usize = 4096;
/// A new base part is written when the parts after the last one hold more rows than the job has (so
/// restoring reads at most about twice the job's rows), or when there are this many parts.
const MAX_PARTS: usize = 64;

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
            jobs: Mutex::default(),
            finished: Mutex::default(),
            queues,
            leases,
            dormant: Mutex::default(),
            scanned: Mutex::default(),
            pending: Arc::default(),
            stats: CheckpointStats::default(),
            failing: Mutex::default(),
        }
    }

    /// Names the queue of a source (recorded with what is quarantined from it).
    pub fn set_queue(&mut self, source: Source, name: &str) {
        self.queues.insert(source, name.to_string());
    }

    /// What checkpoints have written so far.
    pub fn stats(&self) -> &CheckpointStats {
        &self.stats
    }

    fn slot(&self, job_id: &str) -> Slot {
        lock(&self.jobs).entry(job_id.to_string()).or_default().clone()
    }

    /// Forgets a job's slot when it is empty and nobody else holds it (clones are only made under the
    /// map's lock, so a count of one there means no task can be about to use it).
    fn prune(&self, job_id: &str) {
        let mut jobs = lock(&self.jobs);
        let unused = jobs.get(job_id).is_some_and(|s| Arc::strong_count(s) == 1 && s.try_lock().is_ok_and(|j| j.is_none()));
        if unused {
            jobs.remove(job_id);
        }
    }

    fn slots(&self) -> Vec<(String, Slot)> {
        lock(&self.jobs).iter().map(|(k, s)| (k.clone(), s.clone())).collect()
    }

    fn is_finished(&self, job_id: &str) -> bool {
        lock(&self.finished).status.contains_key(job_id)
    }

    /// Applies one received batch. Messages of a job whose state could not be saved are not deleted
    /// (they come back), and that job is reloaded from its last checkpoint next time. Unreadable
    /// messages are quarantined, then deleted. Result payloads are fetched before any job is locked,
    /// and the batch's jobs are applied concurrently.
    pub async fn apply(&self, source: Source, msgs: &[Message]) -> Applied {
        let mut applied = Applied::default();
        let mut groups: BTreeMap<String, Vec<(usize, Item)>> = BTreeMap::new();
        for (i, m) in msgs.iter().enumerate() {
            match parse(source, m) {
                Ok(item) => groups.entry(item.job_id().to_string()).or_default().push((i, item)),
                Err(e) => {
                    let queue = self.queues.get(&source).map_or("unknown", String::as_str);
                    match fleet_io::quarantine::put(self.store.as_ref(), queue, m, &e.to_string()).await {
                        Ok(_) => applied.delete.push((source, m.receipt.clone())),
                        Err(qe) => tracing::warn!(queue, message_id = %m.id, error = %qe, "could not quarantine an unreadable message; it will be redelivered"),
                    }
                }
            }
        }
        let steps = futures::future::join_all(groups.into_iter().map(|(job_id, items)| async move {
            let receipts: Vec<(Source, String)> = items.iter().map(|(i, _)| (source, msgs[*i].receipt.clone())).collect();
            let items = if self.is_finished(&job_id) {
                Vec::new()
            } else {
                futures::future::join_all(items.into_iter().map(|(_, it)| prepare(it, self.store.as_ref()))).await
            };
            let step = self.apply_job(&job_id, items, receipts.clone()).await;
            (job_id, receipts, step)
        }))
        .await;
        for (job_id, receipts, step) in steps {
            match step {
                Ok(Step::Delete(deletable)) => applied.delete.extend(deletable),
                Ok(Step::NotMine) => applied.release.extend(receipts),
                Err(e) => tracing::warn!(job = %job_id, error = %e, "could not apply results; they will be redelivered"),
            }
        }
        applied
    }

    /// Applies a job's items under its lock; returns the receipts that may be deleted now (the job
    /// finished or was checkpointed, or the messages belong to a job finished before). On an error
    /// everything applied since the last checkpoint is dropped with the job; those messages were not
    /// deleted and come back.
    async fn apply_job(&self, job_id: &str, items: Vec<Ready>, receipts: Vec<(Source, String)>) -> Result<Step> {
        if self.is_finished(job_id) {
            tracing::debug!(job = %job_id, n = receipts.len(), "late duplicates of a finished job");
            return Ok(Step::Delete(receipts));
        }
        let slot = self.slot(job_id);
        let step = {
            let mut held = slot.lock().await;
            let marked = lock(&self.failing).get(job_id).copied();
            let failing = marked.is_some_and(|until| Instant::now() < until);
            let step = if held.is_none() && failing {
                Err(Error::Timeout { service: fleet_io::error::Service::S3, operation: "(job state, failed just before)", after: FAILING_FOR, attempts: 0 })
            } else {
                self.apply_locked(job_id, &mut held, items, receipts).await
            };
            match &step {
                Err(e) => {
                    if e.is_retryable() && !failing {
                        lock(&self.failing).insert(job_id.to_string(), Instant::now() + FAILING_FOR);
                    }
                    *held = None;
                }
                Ok(_) if marked.is_some() => {
                    lock(&self.failing).remove(job_id);
                }
                Ok(_) => {}
            }
            step
        };
        drop(slot);
        self.prune(job_id);
        step
    }

    async fn apply_locked(&self, job_id: &str, held: &mut Option<Job>, items: Vec<Ready>, receipts: Vec<(Source, String)>) -> Result<Step> {
        let mut ctl = RequestCounts::default();
        ctl.add("sqs.ReceiveMessage", 1);
        // A job in memory whose lease could not be kept fresh is reloaded (or left to its new owner).
        if held.as_ref().is_some_and(|j| !self.leases.fresh(&j.lease)) {
            self.keep_lease(job_id, held).await;
        }
        if held.is_none() {
            match self.take(job_id, &mut ctl).await? {
                Taken::Open(job) => *held = Some(*job),
                Taken::Finished => return Ok(Step::Delete(receipts)),
                Taken::Busy => {
                    tracing::debug!(job = %job_id, n = receipts.len(), "job owned by another controller; messages handed back");
                    return Ok(Step::NotMine);
                }
            }
        }
        let job = held.as_mut().expect("loaded above");
        job.last_activity = Instant::now();
        for item in items {
            apply_item(job, item, &mut ctl)?;
        }
        job.pending.extend(receipts);
        job.cp.requests.merge(&ctl);
        if job.abandon.is_some() || job.cp.total_chunks == Some(job.cp.accounted.len() as u32) {
            return self.finish(job_id, held).await.map(Step::Delete);
        }
        // Under a steady stream the job is rarely idle when the timer looks: its own batches save it.
        if job.pending.len() >= FLUSH_MESSAGES || job.saved.elapsed() >= FLUSH_INTERVAL {
            return Ok(Step::Delete(self.flush_job(job_id, held).await));
        }
        Ok(Step::Delete(Vec::new()))
    }

    /// Takes a job's lease and loads it from its checkpoint (a new job when there is none).
    async fn take(&self, job_id: &str, ctl: &mut RequestCounts) -> Result<Taken> {
        lock(&self.dormant).remove(job_id);
        ctl.add("s3.GetObject", 1);
        ctl.add("s3.PutObject", 1);
        let lease = match self.leases.acquire(job_id).await? {
            Acquired::Held(h) => h,
            Acquired::Busy { .. } => return Ok(Taken::Busy),
        };
        let job = match self.load(job_id, lease.clone(), ctl).await {
            Ok(job) => job,
            Err(e) => {
                // Not loaded: let another controller (or a later attempt) have it at once.
                let _ = self.leases.release(job_id, &lease).await;
                return Err(e);
            }
        };
        if job.cp.status.is_finished() {
            self.remember_finished(job_id, job.cp.status);
            let _ = self.leases.release(job_id, &job.lease).await;
            return Ok(Taken::Finished);
        }
        Ok(Taken::Open(Box::new(job)))
    }

    /// Renews the lease of a job in memory. The job is dropped (its messages were not deleted and go
    /// to the new owner) when the lease is lost, or could not be renewed and is no longer fresh.
    async fn keep_lease(&self, job_id: &str, held: &mut Option<Job>) -> bool {
        let Some(job) = held.as_mut() else { return false };
        let kept = match self.leases.renew(job_id, &mut job.lease).await {
            Ok(renewed) => renewed,
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "could not renew a lease");
                self.leases.fresh(&job.lease)
            }
        };
        if !kept {
            tracing::warn!(job = %job_id, pending = job.pending.len(), "lease lost; the job's messages go to its next owner");
            *held = None;
        }
        kept
    }

    /// Renews the leases that are due, all jobs at once (a job being worked on is skipped: its next
    /// batch renews a lease that is no longer fresh itself).
    pub async fn renew_leases(&self) {
        let slots = self.slots();
        futures::future::join_all(slots.iter().map(|(job_id, slot)| async move {
            let Ok(mut held) = slot.try_lock() else { return };
            if held.as_ref().is_some_and(|j| self.leases.due(&j.lease)) {
                self.keep_lease(job_id, &mut held).await;
            }
        }))
        .await;
        self.prune_all(slots);
    }

    fn prune_all(&self, slots: Vec<(String, Slot)>) {
        let ids: Vec<String> = slots.into_iter().map(|(k, _)| k).collect();
        for job_id in ids {
            self.prune(&job_id);
        }
    }

    /// Gives back every lease held (on shutdown, after the last checkpoint), so other controllers take
    /// the jobs over at once.
    pub async fn release_leases(&self) {
        let slots = self.slots();
        for (job_id, slot) in &slots {
            let Some(job) = slot.lock().await.take() else { continue };
            if let Err(e) = self.leases.release(job_id, &job.lease).await {
                tracing::warn!(job = %job_id, error = %e, "could not give a lease back; it expires on its own");
            }
        }
        self.prune_all(slots);
    }

    /// Writes the report of a job in memory (complete, or abandoned when it says so) and forgets it;
    /// returns its messages for deletion.
    async fn finish(&self, job_id: &str, held: &mut Option<Job>) -> Result<Vec<(Source, String)>> {
        // Still the owner? (A paused owner whose lease lapsed must not write a report.)
        {
            let job = held.as_mut().expect("the job is in memory");
            if !self.leases.renew(job_id, &mut job.lease).await? {
                tracing::warn!(job = %job_id, "lease lost before the report; the new owner writes it");
                *held = None;
                return Ok(Vec::new());
            }
        }
        let mut job = held.take().expect("the job is in memory");
        let mut done = RequestCounts::default();
        done.add("s3.GetObject", 1); // the manifest
        done.add("s3.PutObject", 3); // report, accounts.csv, checkpoint
        done.add("s3.DeleteObject", 1); // the open marker
        done.add("sqs.DeleteMessageBatch", delete_calls(&job.pending.list));
        if !job.cp.parts.is_empty() {
            done.add("s3.ListObjectsV2", 1);
        }
        job.cp.requests.merge(&done);
        let status = match finalize(&mut job, self.store.as_ref(), &self.stats).await {
            Ok(s) => s,
            Err(Error::Conflict(why)) => {
                tracing::warn!(job = %job_id, %why, "fenced while finishing: another controller owns the job now");
                return Ok(Vec::new());
            }
            Err(e) => {
                job.cp.requests.sub(&done);
                *held = Some(job);
                return Err(e);
            }
        };
        if let Err(e) = self.store.delete(&open_key(job_id)).await {
            tracing::warn!(job = %job_id, error = %e, "could not remove the open-job marker; the next start removes it");
        }
        let _ = self.leases.release(job_id, &job.lease).await;
        self.remember_finished(job_id, status);
        Ok(job.pending.take())
    }

    /// Finishes as `abandoned` every unsealed job without news for `after` (in memory, or dormant:
    /// known from its open marker only); returns the messages the reports cover, for deletion. Scans
    /// the open markers again when the last scan is `after` old.
    pub async fn expire(&self, after: Duration) -> Vec<(Source, String)> {
        // At start (the first tick) and every `after`: jobs whose owner died and whose messages never
        // come back are found here.
        let scan = lock(&self.scanned).is_none_or(|t| t.elapsed() >= after);
        if scan {
            match self.scan_open().await {
                Ok(n) => tracing::info!(open = n, dormant = lock(&self.dormant).len(), "open jobs scanned"),
                Err(e) => tracing::warn!(error = %e, "could not scan the open jobs; trying again later"),
            }
        }
        let now = Instant::now();
        let due: Vec<(String, Instant)> =
            lock(&self.dormant).iter().filter(|(_, t)| now.saturating_duration_since(**t) >= after).map(|(k, t)| (k.clone(), *t)).collect();
        for (job_id, since) in due {
            let mut ctl = RequestCounts::default();
            let slot = self.slot(&job_id);
            {
                let mut held = slot.lock().await;
                if held.is_none() {
                    match self.take(&job_id, &mut ctl).await {
                        Ok(Taken::Open(mut job)) => {
                            job.last_activity = since;
                            *held = Some(*job);
                        }
                        Ok(Taken::Finished) => {
                            let _ = self.store.delete(&open_key(&job_id)).await;
                        }
                        // Its owner abandons it.
                        Ok(Taken::Busy) => {}
                        Err(e) => {
                            tracing::warn!(job = %job_id, error = %e, "could not load a job due to be abandoned; trying again later");
                            lock(&self.dormant).insert(job_id.clone(), since);
                        }
                    }
                }
            }
            drop(slot);
            self.prune(&job_id);
        }
        let mut out = Vec::new();
        let slots = self.slots();
        for (job_id, slot) in &slots {
            // A job being worked on is not idle.
            let Ok(mut held) = slot.try_lock() else { continue };
            let Some(job) = held.as_mut() else { continue };
            let idle = now.saturating_duration_since(job.last_activity);
            if job.cp.total_chunks.is_some() || idle < after {
                continue;
            }
            tracing::warn!(job = %job_id, accounted = job.cp.accounted.len(), idle_secs = idle.as_secs(), "job never sealed; abandoning it");
            job.abandon = Some(format!("not sealed within {} s of its last result: the submission did not finish", after.as_secs()));
            match self.finish(job_id, &mut held).await {
                Ok(done) => out.extend(done),
                Err(e) => tracing::warn!(job = %job_id, error = %e, "could not write the abandoned job's report; trying again later"),
            }
        }
        self.prune_all(slots);
        out
    }

    /// Reads the open-job markers: finished jobs lose theirs, unsealed jobs not in memory are
    /// remembered as dormant with their checkpoint's age (one HEAD request each: no lease is taken and
    /// no checkpoint loaded until one is due). Returns how many unfinished jobs it found.
    pub async fn scan_open(&self) -> Result<usize> {
        *lock(&self.scanned) = Some(Instant::now());
        let keys = self.store.list(OPEN_PREFIX, MAX_OPEN_JOBS).await?;
        let mut open = 0;
        for key in keys {
            let job_id = &key[OPEN_PREFIX.len()..];
            if check_job_id(job_id).is_err() || self.is_finished(job_id) {
                continue;
            }
            if lock(&self.jobs).contains_key(job_id) {
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
            lock(&self.dormant).entry(job_id.to_string()).or_insert_with(|| Instant::now().checked_sub(age).unwrap_or_else(Instant::now));
        }
        Ok(open)
    }

    /// Jobs held in memory (being aggregated).
    pub fn open_jobs(&self) -> usize {
        lock(&self.jobs).values().filter(|s| s.try_lock().map_or(true, |j| j.is_some())).count()
    }

    /// Messages applied in memory and waiting for a checkpoint.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// Checkpoints every job with pending messages (concurrently) and returns those messages for
    /// deletion. A job whose checkpoint fails is dropped from memory (reloaded from its last
    /// checkpoint later); its messages are not returned, so they come back.
    pub async fn flush(&self) -> Vec<(Source, String)> {
        self.flush_jobs(true).await
    }

    /// [`flush`](Self::flush), skipping the jobs being worked on (the timer's: a job whose S3 calls
    /// hang holds up nobody else's deletes).
    pub async fn flush_idle(&self) -> Vec<(Source, String)> {
        self.flush_jobs(false).await
    }

    async fn flush_jobs(&self, wait: bool) -> Vec<(Source, String)> {
        let slots = self.slots();
        let done = futures::future::join_all(slots.iter().map(|(job_id, slot)| async move {
            let mut held = if wait {
                slot.lock().await
            } else {
                match slot.try_lock() {
                    Ok(held) => held,
                    Err(_) => return Vec::new(),
                }
            };
            match held.as_ref() {
                Some(job) if job.pending.len() > 0 => self.flush_job(job_id, &mut held).await,
                _ => Vec::new(),
            }
        }))
        .await;
        self.prune_all(slots);
        done.into_iter().flatten().collect()
    }

    /// Checkpoints one job; returns the messages it covers.
    async fn flush_job(&self, job_id: &str, held: &mut Option<Job>) -> Vec<(Source, String)> {
        let job = held.as_mut().expect("the job is in memory");
        let mut ctl = RequestCounts::default();
        ctl.add("s3.PutObject", 1);
        ctl.add("sqs.DeleteMessageBatch", delete_calls(&job.pending.list));
        job.cp.requests.merge(&ctl);
        let marked = if job.marked_open {
            Ok(())
        } else {
            // Before the first checkpoint: a restarted controller finds the job through it.
            job.cp.requests.add("s3.PutObject", 1);
            self.store.put(&open_key(job_id), Bytes::new(), "application/octet-stream").await
        };
        let saved = match marked {
            Ok(()) => save_checkpoint(job, self.store.as_ref(), &self.stats, Rows::Keep).await,
            Err(e) => Err(e),
        };
        match saved {
            Ok(()) => {
                job.marked_open = true;
                job.saved = Instant::now();
                job.pending.take()
            }
            Err(Error::Conflict(why)) => {
                tracing::warn!(job = %job_id, %why, pending = job.pending.len(), "fenced: another controller owns the job now; its messages go there");
                *held = None;
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "checkpoint failed; its messages will be redelivered");
                if e.is_retryable() {
                    lock(&self.failing).insert(job_id.to_string(), Instant::now() + FAILING_FOR);
                }
                *held = None;
                Vec::new()
            }
        }
    }

    async fn load(&self, job_id: &str, lease: Held, ctl: &mut RequestCounts) -> Result<Job> {
        ctl.add("s3.GetObject", 1);
        let new = |cp: Checkpoint, totals: CheckedTotals, etag: Option<String>| Job {
            marked_open: etag.is_some(),
            cp,
            totals,
            changed: HashSet::new(),
            pending: Pending::new(self.pending.clone()),
            saved: Instant::now(),
            last_activity: Instant::now(),
            abandon: None,
            lease,
            cp_etag: etag,
        };
        match self.store.get_tagged(&checkpoint_key(job_id)).await? {
            Some((data, etag)) => {
                let mut cp: Checkpoint = from_zstd_json(&data, MAX_DOC_BYTES).map_err(corrupt)?;
                let totals = if cp.status.is_finished() {
                    // Only its status is needed; its rows are in the warehouse.
                    CheckedTotals::new()
                } else {
                    restore_totals(&mut cp, self.store.as_ref(), ctl).await?
                };
                cp.accounts = Vec::new();
                tracing::info!(job = %job_id, accounted = cp.accounted.len(), total = cp.total_chunks, status = ?cp.status, parts = cp.parts.len(), "resumed job from checkpoint");
                Ok(new(cp, totals, Some(etag)))
            }
            None => Ok(new(
                Checkpoint {
                    v: WIRE_VERSION,
                    job_id: job_id.to_string(),
                    status: JobStatus::Running,
                    total_chunks: None,
                    accounted: Default::default(),
                    processed_transactions: 0,
                    failed_chunks: Vec::new(),
                    accounts: Vec::new(),
                    parts: Vec::new(),
                    requests: RequestCounts::default(),
                    updated_at: now_rfc3339(),
                },
                CheckedTotals::new(),
                None,
            )),
        }
    }

    fn remember_finished(&self, job_id: &str, status: JobStatus) {
        let mut f = lock(&self.finished);
        if f.status.insert(job_id.to_string(), status).is_none() {
            f.order.push_back(job_id.to_string());
            if f.order.len() > FINISHED_MEMORY {
                if let Some(old) = f.order.pop_front() {
                    f.status.remove(&old);
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
    check_job_id(item.job_id()).map_err(corrupt)?;
    Ok(item)
}

/// An item with its result payload fetched and decoded before its job is locked (`None`: it carries
/// no payload).
struct Ready {
    item: Item,
    accounts: Option<Result<Vec<AccountTotals>>>,
    /// GetObject calls made for it.
    gets: u64,
}

async fn prepare(mut item: Item, store: &dyn BlobStore) -> Ready {
    if let Item::Result(ResultMessage::Chunk(ChunkResult { outcome: Outcome::Processed { payload }, .. })) = &mut item {
        let payload = std::mem::replace(payload, AccountsPayload::Inline { accounts: Vec::new() });
        let gets = u64::from(matches!(payload, AccountsPayload::Blob { .. }));
        let accounts = Some(decode_payload(payload, store).await);
        return Ready { item, accounts, gets };
    }
    Ready { item, accounts: None, gets: 0 }
}

fn apply_item(job: &mut Job, ready: Ready, ctl: &mut RequestCounts) -> Result<()> {
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
                Outcome::Processed { .. } => match accounts.expect("prepared with its payload") {
                    Ok(accounts) => match checked_count(&accounts) {
                        Some(counted) if counted == c.transactions => match job.totals.try_add_all(accounts.iter()) {
                            Ok(()) => {
                                cp.processed_transactions = cp.processed_transactions.saturating_add(counted);
                                // Until a job has parts its next part is a base with every row: nothing to track.
                                if !cp.parts.is_empty() {
                                    job.changed.extend(accounts.into_iter().map(|a| a.account_id));
                                }
                            }
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

async fn decode_payload(payload: AccountsPayload, store: &dyn BlobStore) -> Result<Vec<AccountTotals>> {
    match payload {
        AccountsPayload::Inline { accounts } => Ok(accounts),
        AccountsPayload::ZstdCsv { data } => accounts_from_zstd_csv(&base64_decode(&data).map_err(corrupt)?, MAX_DOC_BYTES).map_err(corrupt),
        AccountsPayload::Blob { blob } => {
            let data = store
                .get(&blob.key)
                .await?
                .ok_or_else(|| Error::NotFound { service: fleet_io::error::Service::S3, what: format!("result blob {} does not exist", blob.key) })?;
            if sha256_hex(&data) != blob.sha256 {
                return Err(Error::Corrupt(format!("result blob {} checksum mismatch", blob.key)));
            }
            accounts_from_zstd_csv(&data, blob.raw_bytes.min(MAX_DOC_BYTES)).map_err(corrupt)
        }
    }
}

/// Restores a job's totals from its checkpoint: the rows inline, then its parts in order.
async fn restore_totals(cp: &mut Checkpoint, store: &dyn BlobStore, ctl: &mut RequestCounts) -> Result<CheckedTotals> {
    ctl.add("s3.GetObject", cp.parts.len() as u64);
    let job_id = cp.job_id.as_str();
    let parts = futures::future::try_join_all(cp.parts.iter().map(|p| async move {
        let data = store.get(&p.key).await?.ok_or_else(|| Error::Corrupt(format!("checkpoint part {} of job {job_id} does not exist", p.key)))?;
        if sha256_hex(&data) != p.sha256 {
            return Err(Error::Corrupt(format!("checkpoint part {} of job {job_id}: checksum mismatch", p.key)));
        }
        accounts_from_zstd_csv(&data, MAX_DOC_BYTES).map_err(corrupt)
    }))
    .await?;
    let inline = std::mem::take(&mut cp.accounts);
    CheckedTotals::restore(std::iter::once(&inline).chain(parts.iter())).map_err(|e| Error::Corrupt(format!("checkpoint of job {}: {e}", cp.job_id)))
}

/// What a checkpoint keeps of a job's totals.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// Every row, inline or in parts (only the rows changed since the last checkpoint are written).
    Keep,
    /// None (the job finished: its rows are in the warehouse); its parts are deleted.
    Drop,
}

/// Writes the job's checkpoint, fenced by the ETag last read or written. A small job's rows travel
/// inside the document; a large job's in parts: the rows of the accounts changed since the last
/// checkpoint, or, when the parts since the last base would outweigh the job, a new base with every
/// row (the parts it replaces are deleted once the document naming it is written).
async fn save_checkpoint(job: &mut Job, store: &dyn BlobStore, stats: &CheckpointStats, rows: Rows) -> Result<()> {
    job.cp.updated_at = now_rfc3339();
    let before = job.cp.parts.clone();
    let result = write_checkpoint(job, store, stats, rows).await;
    job.cp.accounts = Vec::new();
    match result {
        Ok(()) if rows == Rows::Drop => Ok(()),
        Ok(()) => {
            job.changed.clear();
            let kept: HashSet<&str> = job.cp.parts.iter().map(|p| p.key.as_str()).collect();
            let stale: Vec<String> = before.iter().filter(|p| !kept.contains(p.key.as_str())).map(|p| p.key.clone()).collect();
            for key in stale {
                job.cp.requests.add("s3.DeleteObject", 1);
                if let Err(e) = store.delete(&key).await {
                    tracing::warn!(job = %job.cp.job_id, %key, error = %e, "could not delete a replaced checkpoint part; the job's end removes it");
                }
            }
            Ok(())
        }
        Err(e) => {
            // Not written: the document on S3 still names the parts it named.
            job.cp.parts = before;
            Err(e)
        }
    }
}

async fn write_checkpoint(job: &mut Job, store: &dyn BlobStore, stats: &CheckpointStats, rows: Rows) -> Result<()> {
    let n = job.totals.len();
    match rows {
        Rows::Drop => job.cp.parts.clear(),
        Rows::Keep if job.cp.parts.is_empty() && n <= INLINE_ROWS => job.cp.accounts = job.totals.rows(),
        Rows::Keep => {
            let since_base: usize = job.cp.parts.iter().skip(1).map(|p| p.rows as usize).sum();
            let full = job.cp.parts.is_empty() || job.cp.parts.len() >= MAX_PARTS || since_base + job.changed.len() > n;
            // Borrowed from the totals: a base of a million rows is not copied before it is encoded.
            let part_rows = if full {
                job.totals.sorted_rows()
            } else {
                let mut changed: Vec<&String> = job.changed.iter().collect();
                changed.sort_unstable();
                changed.into_iter().flat_map(|a| job.totals.account_rows(a)).collect()
            };
            let rows = part_rows.len() as u64;
            let data = accounts_to_zstd_csv(part_rows.into_iter());
            let part = CheckpointPart {
                key: format!("{}{}.csv.zst", checkpoint_parts_prefix(&job.cp.job_id), uuid::Uuid::now_v7().simple()),
                rows,
                bytes: data.len() as u64,
                sha256: sha256_hex(&data),
                full,
            };
            job.cp.requests.add("s3.PutObject", 1);
            // A key of its own: a stale owner's part can never replace one the document names.
            store.put(&part.key, Bytes::from(data), "application/zstd").await?;
            stats.wrote(part.bytes as usize);
            let counter = if full { &stats.full_parts } else { &stats.delta_parts };
            counter.fetch_add(1, Ordering::Relaxed);
            if full {
                job.cp.parts.clear();
            }
            job.cp.parts.push(part);
        }
    }
    let bytes = to_zstd_json(&job.cp).map_err(corrupt)?;
    let len = bytes.len();
    let meta = Progress::of(&job.cp).to_meta();
    let cond = match &job.cp_etag {
        Some(e) => Cond::Matches(e.clone()),
        None => Cond::Absent,
    };
    match store.put_if(&checkpoint_key(&job.cp.job_id), Bytes::from(bytes), "application/zstd", &meta, &cond).await? {
        Some(etag) => {
            stats.wrote(len);
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
async fn finalize(job: &mut Job, store: &dyn BlobStore, stats: &CheckpointStats) -> Result<JobStatus> {
    let job_id = job.cp.job_id.clone();
    let manifest: Option<Manifest> = match store.get(&manifest_key(&job_id)).await? {
        Some(b) => Some(serde_json::from_slice(&b)?),
        None => None,
    };
    let mut failed = job.cp.failed_chunks.clone();
    let (manifest, note) = match (manifest, &job.abandon) {
        (Some(m), None) => (m, None),
        (None, None) => {
            return Err(Error::NotFound { service: fleet_io::error::Service::S3, what: format!("the manifest of job {job_id} does not exist") });
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
    let mut r = report::build_borrowed(&manifest, &job.totals, failed, &requests);
    if let Some(note) = note {
        r.status = JobStatus::Abandoned;
        r.note = Some(note);
    }
    if r.transactions.accepted != r.transactions.processed + r.transactions.failed {
        tracing::error!(job = %job_id, accepted = r.transactions.accepted, processed = r.transactions.processed, failed = r.transactions.failed,
            "accepted != processed + failed: the results disagree with the manifest");
    }
    store.put(&report_key(&job_id), Bytes::from(report::to_json(&r)?), "application/json").await?;
    store.put(&accounts_key(&job_id), Bytes::from(report::accounts_csv(&r)), "text/csv").await?;
    // Written: the rows borrowed from the job's totals are let go before the job is changed.
    let r = r.map_accounts(|_| ());
    job.cp.status = r.status;
    let had_parts = !job.cp.parts.is_empty();
    save_checkpoint(job, store, stats, Rows::Drop).await?;
    if had_parts {
        // Also what a fenced (stale) owner may have left there.
        match store.list(&checkpoint_parts_prefix(&job_id), MAX_OPEN_JOBS).await {
            Ok(keys) => {
                for key in keys {
                    if let Err(e) = store.delete(&key).await {
                        tracing::warn!(job = %job_id, %key, error = %e, "could not delete a checkpoint part of a finished job");
                    }
                }
            }
            Err(e) => tracing::warn!(job = %job_id, error = %e, "could not list the checkpoint parts of a finished job"),
        }
    }
    tracing::info!(job = %job_id, status = ?r.status, processed = r.transactions.processed, failed = r.transactions.failed,
        requests = r.requests.total, "job finished; report written");
    Ok(r.status)
}

#[cfg(test)]
mod tests;

/// A document or payload that failed the domain's checks: corrupt, never retryable.
fn corrupt(e: fleet_domain::Error) -> Error {
    let fleet_domain::Error::Corrupt(msg) = e;
    Error::Corrupt(msg)
}
