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
use controller_core::take::{self, Answer, Effect, Take};

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

    /// Gives back the leases of the jobs `which` picks, their jobs dropped from memory (every job on
    /// shutdown, after the last checkpoint, so that other controllers take them over at once; a
    /// partition's when it is let go).
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
    /// Takes a job's lease and loads it from its checkpoint (a new job when there is none). The steps
    /// and what becomes of a job not taken are the core's (`controller_core::take`); this performs
    /// them.
    pub(super) async fn take(&self, job_id: &str) -> Result<Taken> {
        let mut take = Take::new(job_id, self.known.dormant(|d| d.take(job_id)));
        let mut answer = Answer::Start;
        let mut lease = None;
        let mut job = None;
        loop {
            answer = match take.next(answer, || Error::Conflict(format!("the checkpoint of job {job_id} changed on every read"))) {
                Effect::Acquire => match self.leases.acquire(job_id).await {
                    Ok(Acquired::Ours(h)) => {
                        lease = Some(h);
                        Answer::Ours
                    }
                    Ok(Acquired::Busy { expires_in, live, .. }) => Answer::Busy {
                        after: self.leases.hand_back_after(live, expires_in, HAND_BACK),
                        ttl: self.leases.ttl(),
                        at: tokio::time::Instant::now().into_std(),
                    },
                    Err(e) => Answer::Failed(e),
                },
                Effect::Load => match self.load(job_id, lease.clone().expect("loaded under its lease")).await {
                    Ok(Loaded::Job(loaded)) => {
                        job = Some(loaded);
                        Answer::Loaded
                    }
                    Ok(Loaded::AlreadyFinished(status)) => Answer::Finished(status),
                    Err((e @ Error::Corrupt(_), Some(etag))) => Answer::Unreadable(e, etag),
                    Err((e, _)) => Answer::Failed(e),
                },
                Effect::Quarantine(e, etag) => {
                    match self.quarantine_unreadable(job_id, lease.as_ref().expect("quarantined under its lease"), &e, &etag).await {
                        Ok(()) => Answer::Done,
                        Err(e) => Answer::Failed(e),
                    }
                }
                Effect::Release => {
                    let _ = self.leases.release(job_id, lease.as_ref().expect("given back once taken")).await;
                    Answer::Done
                }
                Effect::KeepDormant(d) => {
                    self.known.dormant(|dormant| dormant.keep(job_id, d));
                    Answer::Done
                }
                Effect::Remember(status) => {
                    self.remember_finished(job_id, status);
                    Answer::Done
                }
                Effect::Taken(taken) => {
                    return match taken {
                        take::Taken::Open => {
                            let job = job.expect("a job taken open was loaded");
                            self.memory.with(|r| r.hold_lease(job_id, job.lease().downgrade()));
                            Ok(Taken::Open(job))
                        }
                        take::Taken::AlreadyFinished => Ok(Taken::AlreadyFinished),
                        take::Taken::Busy(after) => Ok(Taken::Busy(after)),
                        take::Taken::Failed(e) => Err(e),
                    }
                }
            };
        }
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
