//! Checkpoints: `flush` (every job with unsaved messages, or only the idle ones for the timer) writes
//! each job's checkpoint and returns the messages it covers for deletion; `commit` is the I/O of a
//! checkpoint the job planned (`save::plan`, pure: the format). The format: the document
//! (`checkpoints/{job}/checkpoint.json.zst`, the commit point, written If-Match its ETag so a stale owner is
//! fenced) with a small job's rows inline, or for a large job a base part with every row plus change
//! parts with the rows of the accounts changed since, each under a key of its own; restoring is
//! "later rows replace earlier ones".

use std::sync::atomic::Ordering;

use fleet_domain::billing::{AccountTotals, CheckedTotals, RowBatch};
use fleet_domain::codec::{accounts_from_zstd_csv, sha256_hex};
use fleet_domain::layout::checkpoint_key;
use fleet_domain::model::Checkpoint;
use fleet_domain::requests::{Billed, Op, RequestCounts};
use fleet_engine::Kept;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::call::counted;
use fleet_io::error::{Error, Result};
use tokio::time::Instant;

use super::books::Books;
use super::job::{hand_over, Asker, Job, Next};
use super::limits::{FAILING_FOR, MAX_DOC_BYTES};
use super::{delete_calls, Aggregator};
use controller_core::decision::Commit;
use controller_core::save::Precondition;

impl Aggregator {
    /// Checkpoints every job with unsaved messages (concurrently) and returns those messages for
    /// deletion; finishes the jobs due to be finished. A job whose checkpoint fails is dropped from
    /// memory (reloaded from its last checkpoint later); its messages are not returned: held (see
    /// `hold`), or they come back.
    pub async fn flush(&self) -> Vec<Kept> {
        self.flush_jobs(true).await
    }

    /// [`flush`](Self::flush), skipping the jobs being worked on (the timer's: a job whose S3 calls
    /// hang holds up nobody else's deletes).
    pub async fn flush_idle(&self) -> Vec<Kept> {
        self.flush_jobs(false).await
    }

    pub(super) async fn flush_jobs(&self, wait: bool) -> Vec<Kept> {
        let slots = self.memory.slots();
        let done = futures::future::join_all(slots.iter().map(|(job_id, slot)| async move {
            let mut loaded = if wait {
                slot.lock().await
            } else {
                match slot.try_lock() {
                    Ok(loaded) => loaded,
                    Err(_) => return Vec::new(),
                }
            };
            let floor = self.expiry.idle_floor();
            let next = loaded.as_ref().map(|job| job.next(Instant::now(), floor, self.settle, Asker::Timer));
            match next {
                // Its ending committed or asked for, or every chunk in (some failed, no news for the
                // settle time: no real result is coming any more).
                Some(Next::Finish) => {
                    tracing::info!(job = %job_id, failed = loaded.as_ref().map_or(0, |j| j.failed().len()), "due to be finished: finishing");
                    match self.books.finish(job_id, &mut loaded).await {
                        Ok(done) => done,
                        Err(e) => {
                            tracing::warn!(job = %job_id, error = %e, "could not finish the job; trying again later");
                            Vec::new()
                        }
                    }
                }
                Some(Next::Save) => self.flush_job(job_id, &mut loaded).await,
                Some(Next::Wait) | None => Vec::new(),
            }
        }))
        .await;
        self.memory.prune_all(slots);
        done.into_iter().flatten().collect()
    }

    /// Checkpoints one job (its open marker first, the first time); returns the messages it covers.
    pub(super) async fn flush_job(&self, job_id: &str, loaded: &mut Option<Job>) -> Vec<Kept> {
        let job = loaded.as_mut().expect("the job is in memory");
        // The deletes its messages take once covered: SQS's calls, shared by the jobs of a batch,
        // attributed to it by rule, in the checkpoint that covers them (see docs/requests.md).
        let mut deletes = RequestCounts::default();
        deletes.add(Billed::call(Op::SqsDeleteMessageBatch), delete_calls(job.unsaved().iter()));
        // Its S3 calls as the store counts them, every attempt: in its next checkpoint.
        let (saved, calls) = counted(async {
            if job.writes().needs_marker() {
                // Before the first checkpoint: a restarted controller finds the job through it.
                self.books.mark_open(job_id).await?;
                job.writes_mut().marked();
            }
            self.books.commit(job, Commit::Progress, &deletes).await
        })
        .await;
        job.count(&calls);
        match saved {
            Ok(()) => job.covered(),
            Err(Error::Conflict(why)) => {
                tracing::warn!(job = %job_id, %why, unsaved = job.unsaved().len(), "fenced: another controller owns the job now; its messages go there");
                hand_over(loaded);
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "checkpoint failed; its messages are held when the store may answer later, else redelivered");
                if e.is_retryable() {
                    self.memory.with(|r| r.failed(job_id, (Instant::now() + FAILING_FOR).into_std()));
                }
                self.holding.drop_job(loaded, Vec::new(), &e);
                Vec::new()
            }
        }
    }
}

impl Books {
    /// Writes the checkpoint that commits `commit` for the job (the I/O of [`Job::plan`]): a part
    /// first when the plan has one, then the document, fenced by the ETag last read or written; once
    /// written, the job takes what it committed ([`Job::saved`]) and the parts the document no longer
    /// names are deleted. A failed write leaves the job as it was.
    pub(super) async fn commit(&self, job: &mut Job, commit: Commit, attributed: &RequestCounts) -> Result<()> {
        // What was made for it outside its lock (the timer's lease renewals) goes in this one.
        job.take_carried();
        if let Some(p) = self.memory.with(|r| r.partition(job.id())) {
            job.travels_on(p);
        }
        let save = job.plan(commit, attributed)?;
        let started = Instant::now();
        if let Some((part, data)) = save.part() {
            // A key of its own: a stale owner's part can never replace one the document names.
            self.store.put(&part.key, data.clone(), "application/zstd").await?;
            self.stats.wrote(part.bytes as usize);
            let counter = if part.full { &self.stats.full_parts } else { &self.stats.delta_parts };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        let key = checkpoint_key(job.id());
        let cond = match save.cond() {
            Precondition::Absent => Cond::Absent,
            Precondition::Matches(etag) => Cond::Matches(etag.clone()),
        };
        let (body, meta) = (save.body(), save.meta());
        let written = if crate::undo::is(crate::undo::Fix::LostAnswerReadBack) {
            self.store.put_if(&key, body.clone(), "application/zstd", &meta, &cond).await
        } else {
            let earlier = if crate::undo::is(crate::undo::Fix::EarlierWriteReadBack) { &[][..] } else { job.writes().unconfirmed() };
            fleet_io::blob::put_if_owned_after(self.store.as_ref(), &key, body.clone(), "application/zstd", &meta, &cond, earlier).await
        };
        let written = match written {
            Ok(w) => w,
            Err(e) => {
                job.write_unconfirmed(body, attributed);
                return Err(e);
            }
        };
        let Some(etag) = written else {
            return Err(Error::Conflict(format!("the checkpoint of job {} was written by another controller", job.id())));
        };
        self.stats.wrote(body.len());
        let part_bytes = save.part().map_or(0, |(p, _)| p.bytes);
        let stale = job.saved(save, etag);
        crate::events::CheckpointWritten { job: job.id(), part_bytes, took: started.elapsed() }.emit();
        for key in stale {
            if let Err(e) = self.store.delete(&key).await {
                tracing::warn!(job = %job.id(), %key, error = %e, "could not delete a replaced checkpoint part; the job's end removes it");
            }
        }
        Ok(())
    }
}

/// Restores a job's totals from its checkpoint: the rows inline, then its parts in order.
pub(super) async fn restore_totals(cp: &mut Checkpoint, store: &dyn BlobStore) -> Result<CheckedTotals> {
    let job_id = cp.job_id.as_str();
    let parts = futures::future::try_join_all(cp.parts.iter().map(|p| async move {
        let data = store.get(&p.key).await?.ok_or_else(|| Error::Corrupt(format!("checkpoint part {} of job {job_id} does not exist", p.key)))?;
        if sha256_hex(&data) != p.sha256 {
            return Err(Error::Corrupt(format!("checkpoint part {} of job {job_id}: checksum mismatch", p.key)));
        }
        accounts_from_zstd_csv(&data, MAX_DOC_BYTES).map_err(Error::corrupt)
    }))
    .await?;
    // Inline rows are few (a job with more has parts).
    let inline: RowBatch = std::mem::take(&mut cp.accounts).iter().map(AccountTotals::borrowed).collect();
    CheckedTotals::restore(std::iter::once(&inline).chain(parts.iter()).map(RowBatch::iter))
        .map_err(|e| Error::Corrupt(format!("checkpoint of job {}: {e}", cp.job_id)))
}
