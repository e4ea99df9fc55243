//! Checkpoints: `flush` (every job with pending messages, or only the idle ones for the timer) writes
//! each job's checkpoint and returns the messages it covers for deletion. The format: the document (`jobs/{job}/checkpoint.json.zst`, the commit point, written
//! If-Match its ETag so a stale owner is fenced) with a small job's rows inline, or for a large job a
//! base part with every row plus change parts with the rows of the accounts changed since, each under
//! a key of its own; restoring is "later rows replace earlier ones".

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use fleet_domain::billing::{AccountTotals, CheckedTotals, RowBatch};
use fleet_domain::codec::{accounts_from_zstd_csv, accounts_to_zstd_csv, sha256_hex, to_zstd_json};
use fleet_domain::layout::{checkpoint_key, checkpoint_parts_prefix, open_key};
use fleet_domain::model::{Checkpoint, CheckpointPart, Progress};
use fleet_domain::requests::RequestCounts;
use fleet_engine::Kept;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::error::{Error, Result};
use fleet_io::lock;
use tokio::time::Instant;

use super::job::Job;
use super::{delete_calls, Aggregator, CheckpointStats, FAILING_FOR, INLINE_ROWS, MAX_DOC_BYTES, MAX_PARTS};

impl Aggregator {
    /// Checkpoints every job with pending messages (concurrently) and returns those messages for
    /// deletion. A job whose checkpoint fails is dropped from memory (reloaded from its last
    /// checkpoint later); its messages are not returned: held (see `hold`), or they come back.
    pub async fn flush(&self) -> Vec<Kept> {
        self.flush_jobs(true).await
    }

    /// [`flush`](Self::flush), skipping the jobs being worked on (the timer's: a job whose S3 calls
    /// hang holds up nobody else's deletes).
    pub async fn flush_idle(&self) -> Vec<Kept> {
        self.flush_jobs(false).await
    }

    pub(super) async fn flush_jobs(&self, wait: bool) -> Vec<Kept> {
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
            let floor = lock(&self.expiry).idle_floor;
            match held.as_ref() {
                // Every chunk in, some failed, and no news for the settle time: no real result is
                // coming any more.
                Some(job) if job.due_to_finish(Instant::now(), floor, self.settle) => {
                    tracing::info!(job = %job_id, failed = job.cp.failed_chunks.len(), "every chunk in, some failed, nothing new since: finishing");
                    match self.finish(job_id, &mut held).await {
                        Ok(done) => done,
                        Err(e) => {
                            tracing::warn!(job = %job_id, error = %e, "could not finish the job; trying again later");
                            Vec::new()
                        }
                    }
                }
                Some(job) if job.pending.len() > 0 => self.flush_job(job_id, &mut held).await,
                _ => Vec::new(),
            }
        }))
        .await;
        self.prune_all(slots);
        done.into_iter().flatten().collect()
    }

    /// Checkpoints one job; returns the messages it covers.
    pub(super) async fn flush_job(&self, job_id: &str, held: &mut Option<Job>) -> Vec<Kept> {
        let job = held.as_mut().expect("the job is in memory");
        let mut ctl = RequestCounts::default();
        ctl.add("s3.PutObject", 1);
        ctl.add("sqs.DeleteMessageBatch", delete_calls(job.pending.iter()));
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
                self.hand_over(held);
                Vec::new()
            }
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "checkpoint failed; its messages are held when the store may answer later, else redelivered");
                if e.is_retryable() {
                    lock(&self.memory).failing.insert(job_id.to_string(), Instant::now() + FAILING_FOR);
                }
                self.drop_job(held, Vec::new(), &e);
                Vec::new()
            }
        }
    }
}

/// Restores a job's totals from its checkpoint: the rows inline, then its parts in order.
pub(super) async fn restore_totals(cp: &mut Checkpoint, store: &dyn BlobStore, ctl: &mut RequestCounts) -> Result<CheckedTotals> {
    ctl.add("s3.GetObject", cp.parts.len() as u64);
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

/// What a checkpoint keeps of a job's totals.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Rows {
    /// Every row, inline or in parts (only the rows changed since the last checkpoint are written).
    Keep,
    /// None (the job finished: its rows are in the warehouse); its parts are deleted.
    Drop,
}

/// Writes the job's checkpoint, fenced by the ETag last read or written. A small job's rows travel
/// inside the document; a large job's in parts: the rows of the accounts changed since the last
/// checkpoint, or, when the parts since the last base would outweigh the job, a new base with every
/// row (the parts it replaces are deleted once the document naming it is written).
pub(super) async fn save_checkpoint(job: &mut Job, store: &dyn BlobStore, stats: &CheckpointStats, rows: Rows) -> Result<()> {
    job.cp.updated_at = job.clock.rfc3339();
    let before = job.cp.parts.clone();
    let started = tokio::time::Instant::now();
    let result = write_checkpoint(job, store, stats, rows).await;
    if result.is_ok() {
        let part_bytes = job.cp.parts.iter().filter(|p| !before.iter().any(|b| b.key == p.key)).map(|p| p.bytes).sum();
        crate::events::CheckpointWritten { job: &job.cp.job_id, part_bytes, took: started.elapsed() }.emit();
    }
    job.cp.accounts = Vec::new();
    match result {
        Ok(()) if rows == Rows::Drop => Ok(()),
        Ok(()) => {
            job.totals.clear_changed();
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

pub(super) async fn write_checkpoint(job: &mut Job, store: &dyn BlobStore, stats: &CheckpointStats, rows: Rows) -> Result<()> {
    let n = job.totals.len();
    match rows {
        Rows::Drop => job.cp.parts.clear(),
        Rows::Keep if job.cp.parts.is_empty() && n <= INLINE_ROWS => job.cp.accounts = job.totals.rows(),
        Rows::Keep => {
            let since_base: usize = job.cp.parts.iter().skip(1).map(|p| p.rows as usize).sum();
            let full = job.cp.parts.is_empty() || job.cp.parts.len() >= MAX_PARTS || since_base + job.totals.changed_accounts() > n;
            // Borrowed from the totals: a base of a million rows is not copied before it is encoded.
            let (rows, data) = if full {
                let sorted = job.totals.sorted_rows();
                (sorted.len() as u64, accounts_to_zstd_csv(sorted.iter()))
            } else {
                let rows = job.totals.changed_rows().count();
                (rows as u64, accounts_to_zstd_csv(job.totals.changed_rows()))
            };
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
    let bytes = to_zstd_json(&job.cp).map_err(Error::corrupt)?;
    let len = bytes.len();
    let meta = Progress::of(&job.cp).to_meta();
    let cond = match &job.cp_etag {
        Some(e) => Cond::Matches(e.clone()),
        None => Cond::Absent,
    };
    let written = if crate::undo::is(crate::undo::Fix::LostAnswerReadBack) {
        store.put_if(&checkpoint_key(&job.cp.job_id), Bytes::from(bytes), "application/zstd", &meta, &cond).await?
    } else {
        fleet_io::blob::put_if_owned(store, &checkpoint_key(&job.cp.job_id), Bytes::from(bytes), "application/zstd", &meta, &cond).await?
    };
    match written {
        Some(etag) => {
            stats.wrote(len);
            job.cp_etag = Some(etag);
            Ok(())
        }
        None => Err(Error::Conflict(format!("the checkpoint of job {} was written by another controller", job.cp.job_id))),
    }
}
