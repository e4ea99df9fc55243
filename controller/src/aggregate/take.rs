//! Taking a job (its lease, then its state from the checkpoint) and keeping it (renewing the lease;
//! dropping the job when the lease is lost), and giving every lease back on shutdown (seed 003).

use bytes::Bytes;
use fleet_domain::codec::from_zstd_json;
use fleet_domain::layout::checkpoint_keys;
use fleet_domain::model::{Checkpoint, JobStatus, Progress};
use fleet_io::blob::BlobStore;
use fleet_io::call::counted;
use fleet_io::error::{Error, Result};

use super::books::Books;
use super::checkpoint::restore_totals;
use super::job::{hand_over, Held, Job, Unsaved};
use super::limits::{HAND_BACK, MAX_DOC_BYTES};
use super::{Aggregator, Slot, Taken};
use crate::lease::{Acquired, Lease};

impl Aggregator {
    /// Renews the lease of a job in memory. The job is dropped (its messages were not deleted and go
    /// to the new owner) when the lease is lost, or could not be renewed and is no longer fresh.
    pub(super) async fn keep_lease(&self, job_id: &str, loaded: &mut Option<Job>) -> bool {
        let Some(job) = loaded.as_mut() else { return false };
        let (renewed, calls) = counted(self.books.leases.renew(job_id, job.lease())).await;
        job.count(&calls);
        let (kept, failed) = match renewed {
            Ok(renewed) => (renewed, None),
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "could not renew a lease");
                (self.books.leases.fresh(job.lease()).await, Some(e))
            }
        };
        if !kept {
            match failed {
                // Lapsed while the store did not answer: its messages are held and applied again.
                Some(e) => {
                    tracing::warn!(job = %job_id, unsaved = job.unsaved().len(), error = %e, "lease lapsed while the store did not answer; the job is reloaded later");
                    self.holding.drop_job(loaded, Vec::new(), &e);
                }
                None => {
                    tracing::warn!(job = %job_id, unsaved = job.unsaved().len(), "lease lost; the job's messages go to its next owner");
                    hand_over(loaded);
                }
            }
        }
        kept
    }

    /// Renews the leases that are due, all at once and whether or not their jobs are busy (a job in
    /// the middle of a long finish keeps its lease); then lets go of the idle jobs whose lease was
    /// lost (their messages go to the new owner) or could not be renewed and is no longer fresh.
    pub async fn renew_leases(&self) {
        let leases: Vec<(String, Lease)> = self.memory.with(|r| r.live_leases(crate::lease::WeakLease::upgrade));
        futures::future::join_all(leases.iter().map(|(job_id, h)| async move {
            if self.books.leases.due(h).await {
                // Made for the job outside its lock: kept for it until it takes them.
                let (renewed, calls) = counted(self.books.leases.renew(job_id, h)).await;
                self.memory.carried().keep(job_id, &calls);
                match renewed {
                    Ok(true) => {}
                    // Our own newer lease of the job (dropped after a failure and taken again
                    // meanwhile) made this one stale: nobody else has the job.
                    Ok(false) if !self.memory.with(|r| r.lease(job_id).is_some_and(|w| w.is(h))) => {
                        tracing::debug!(job = %job_id, "an older lease of ours was replaced by a newer one")
                    }
                    // Given back meanwhile (the job finished, or was let go).
                    Ok(false) if self.books.leases.given_back(h).await => tracing::debug!(job = %job_id, "a lease given back meanwhile"),
                    Ok(false) => tracing::warn!(job = %job_id, "lease lost to another controller; the job goes to it"),
                    Err(e) => tracing::warn!(job = %job_id, error = %e, "could not renew a lease"),
                }
            }
        }))
        .await;
        let slots = self.memory.slots();
        futures::future::join_all(slots.iter().map(|(job_id, slot)| async move {
            let Ok(mut loaded) = slot.try_lock() else { return };
            let stale = match loaded.as_ref() {
                Some(j) => !self.books.leases.fresh(j.lease()).await,
                None => false,
            };
            if stale {
                self.keep_lease(job_id, &mut loaded).await;
            }
        }))
        .await;
        self.memory.prune_all(slots);
    }

    /// Gives back every lease held (on shutdown, after the last checkpoint), so other controllers take
    /// the jobs over at once.
    /// Gives back the leases of the jobs `which` picks (their jobs dropped from memory).
    pub async fn release_leases(&self, which: impl Fn(&str) -> bool) {
        let slots: Vec<(String, Slot)> = self.memory.slots().into_iter().filter(|(j, _)| which(j)).collect();
        for (job_id, slot) in &slots {
            let Some(job) = slot.lock().await.take() else { continue };
            if let Err(e) = self.books.leases.release(job_id, job.lease()).await {
                tracing::warn!(job = %job_id, error = %e, "could not give a lease back; it expires on its own");
            }
            self.memory.carried().keep_dropped(job_id, job.writes().carry());
        }
        self.memory.prune_all(slots);
    }
}

impl Books {
    /// Takes a job's lease and loads it from its checkpoint (a new job when there is none).
    pub(super) async fn take(&self, job_id: &str) -> Result<Taken> {
        let dormant = self.known.dormant(|d| d.take(job_id));
        // Put back when the job is not taken for a store error (the scan's path puts it back too;
        // a batch's does not): forgotten, its partition's listeners no longer look for it.
        let restore = |d: Option<super::scan::Dormant>| {
            if let Some(d) = d.filter(|_| !crate::undo::is(crate::undo::Fix::BusyStaysDormant)) {
                self.known.dormant(|dormant| dormant.keep(job_id, d));
            }
        };
        let acquired = match self.leases.acquire(job_id).await {
            Ok(a) => a,
            Err(e) => {
                restore(dormant);
                return Err(e);
            }
        };
        let lease = match acquired {
            Acquired::Ours(h) => h,
            Acquired::Busy { expires_in, live, .. } => {
                let after = self.leases.hand_back_after(live, expires_in, HAND_BACK);
                // Still dormant here, tried again once the lease may have run out: its partition's
                // listeners keep looking every minute meanwhile. Forgotten, a job whose messages
                // were handed back until a dead owner's lease ran out was nobody's: when those
                // messages reached the dead-letter queue after their last receive (each reader
                // that sees a dead owner's lease first waits a lease, spending one), nobody looked
                // there until the hourly safety poll with the scaling agent down (found by the
                // simulation, seed 228242485: a report 53 min past its bound).
                let not_before = Some((tokio::time::Instant::now() + after.max(self.leases.ttl() / 2)).into_std());
                restore(dormant.map(|d| super::scan::Dormant { not_before, ..d }));
                return Ok(Taken::Busy(after));
            }
        };
        let job = match self.load_unchanged(job_id, &lease).await {
            Ok(job) => job,
            // Its checkpoint can never be read: the same document (ETag) failed twice.
            Err((e @ Error::Corrupt(_), Some(etag))) => {
                self.quarantine_unreadable(job_id, &lease, &e, &etag).await?;
                return Ok(Taken::AlreadyFinished);
            }
            Err((e, _)) => {
                // Not loaded: let another controller (or a later attempt) have it at once.
                let _ = self.leases.release(job_id, &lease).await;
                restore(dormant);
                return Err(e);
            }
        };
        let job = match job {
            Loaded::AlreadyFinished(status) => {
                self.remember_finished(job_id, status);
                let _ = self.leases.release(job_id, &lease).await;
                return Ok(Taken::AlreadyFinished);
            }
            Loaded::Job(job) => job,
        };
        self.memory.with(|r| r.hold_lease(job_id, job.lease().downgrade()));
        Ok(Taken::Open(job))
    }

    /// Loads a job; a checkpoint that cannot be read is read again, and only one that failed twice
    /// as the same document (one ETag) is unreadable: `Err((Corrupt, Some(etag)))`. A read that fails
    /// because the document changed under it (a stale owner finishing, replacing its base part and
    /// deleting the old ones) is not corruption: the new document is read instead.
    async fn load_unchanged(&self, job_id: &str, lease: &Lease) -> std::result::Result<Loaded, (Error, Option<String>)> {
        let mut failed_at: Option<String> = None;
        for _ in 0..3 {
            match self.load(job_id, lease.clone()).await {
                Ok(job) => return Ok(job),
                Err((e @ Error::Corrupt(_), Some(etag))) => {
                    if failed_at.as_deref() == Some(etag.as_str()) || crate::undo::is(crate::undo::Fix::QuarantineSecondRead) {
                        return Err((e, Some(etag)));
                    }
                    tracing::warn!(job = %job_id, error = %e, "the job's checkpoint could not be read; reading it again");
                    failed_at = Some(etag);
                }
                Err((e, _)) => return Err((e, None)),
            }
        }
        Err((Error::Conflict(format!("the checkpoint of job {job_id} changed on every read")), None))
    }

    /// Loads a job from its checkpoint (a new job when there is none, only its status when it is
    /// finished); an error says which checkpoint (ETag) it was reading.
    pub(super) async fn load(&self, job_id: &str, lease: Lease) -> std::result::Result<Loaded, (Error, Option<String>)> {
        let held = Held { lease, clock: self.clock, unsaved: Unsaved::new(self.memory.pending_counter()), carried: self.memory.carried().clone() };
        match read_checkpoint(self.store.as_ref(), job_id).await.map_err(|e| (e, None))? {
            Some((data, etag, at)) => {
                let loaded = fleet_io::blob::digest(&data);
                let tagged = |e: Error| (e, Some(etag.clone()));
                let mut cp: Checkpoint = from_zstd_json(&data, MAX_DOC_BYTES).map_err(Error::corrupt).map_err(tagged)?;
                // Finished: only its status is needed; its rows are in the warehouse.
                if cp.status.is_finished() && !cp.finishing {
                    return Ok(Loaded::AlreadyFinished(cp.status));
                }
                let totals = restore_totals(&mut cp, self.store.as_ref()).await.map_err(tagged)?;
                tracing::info!(job = %job_id, accounted = cp.accounted.len(), total = cp.total_chunks, status = ?cp.status, parts = cp.parts.len(), "resumed job from checkpoint");
                let news = self.expiry.news_at(job_id, Progress::of(&cp).updated_unix);
                // A checkpoint found where an earlier release kept it is moved by the job's next save,
                // written where none is yet (If-None-Match): two controllers moving it cannot both.
                let etag = (at == At::Current).then_some(etag);
                if at == At::Legacy {
                    tracing::info!(job = %job_id, "the job's checkpoint is where an earlier release kept it: its next save moves it");
                }
                Ok(Loaded::Job(Box::new(Job::resume(cp, totals, etag, news, loaded, held))))
            }
            None => Ok(Loaded::Job(Box::new(Job::new(job_id, held)))),
        }
    }
}

/// Where a checkpoint was found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum At {
    /// Under `checkpoints/`, where this release writes it.
    Current,
    /// Beside the job's blobs, where releases before `checkpoints/` wrote it (read only).
    Legacy,
}

/// Reads a job's checkpoint where this release keeps it, else where an earlier release did:
/// the document, its ETag and where it was.
pub(super) async fn read_checkpoint(store: &dyn BlobStore, job_id: &str) -> Result<Option<(Bytes, String, At)>> {
    let [current, legacy] = checkpoint_keys(job_id);
    for (key, at) in [(current, At::Current), (legacy, At::Legacy)] {
        if let Some((data, etag)) = store.get_tagged(&key).await? {
            return Ok(Some((data, etag, at)));
        }
    }
    Ok(None)
}

/// What loading a job found.
pub(super) enum Loaded {
    Job(Box<Job>),
    /// Finished before, with this status.
    AlreadyFinished(JobStatus),
}
