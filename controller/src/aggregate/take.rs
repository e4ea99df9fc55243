//! Taking a job (its lease, then its state from the checkpoint) and keeping it (renewing the lease;
//! dropping the job when the lease is lost), and giving every lease back on shutdown (seed 003).

use super::*;

impl Aggregator {
    /// Takes a job's lease and loads it from its checkpoint (a new job when there is none).
    pub(super) async fn take(&self, job_id: &str, ctl: &mut RequestCounts) -> Result<Taken> {
        lock(&self.dormant).remove(job_id);
        ctl.add("s3.GetObject", 1);
        ctl.add("s3.PutObject", 1);
        let lease = match self.leases.acquire(job_id).await? {
            Acquired::Held(h) => h,
            Acquired::Busy { .. } => return Ok(Taken::Busy),
        };
        let job = match self.load(job_id, lease.clone(), ctl).await {
            Ok(job) => job,
            // Its checkpoint can never be read.
            Err(e @ Error::Corrupt(_)) => {
                self.quarantine_unreadable(job_id, &lease, &e).await?;
                return Ok(Taken::Finished);
            }
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
    pub(super) async fn keep_lease(&self, job_id: &str, held: &mut Option<Job>) -> bool {
        let Some(job) = held.as_mut() else { return false };
        let (kept, failed) = match self.leases.renew(job_id, &mut job.lease).await {
            Ok(renewed) => (renewed, None),
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "could not renew a lease");
                (self.leases.fresh(&job.lease), Some(e))
            }
        };
        if !kept {
            match failed {
                // Lapsed while the store did not answer: its messages are held and applied again.
                Some(e) => {
                    tracing::warn!(job = %job_id, pending = job.pending.len(), error = %e, "lease lapsed while the store did not answer; the job is reloaded later");
                    self.drop_job(held, Vec::new(), &e);
                }
                None => {
                    tracing::warn!(job = %job_id, pending = job.pending.len(), "lease lost; the job's messages go to its next owner");
                    self.hand_over(held);
                }
            }
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

    pub(super) fn prune_all(&self, slots: Vec<(String, Slot)>) {
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

    pub(super) async fn load(&self, job_id: &str, lease: Held, ctl: &mut RequestCounts) -> Result<Job> {
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
            stalled: None,
            lease,
            cp_etag: etag,
        };
        match self.store.get_tagged(&checkpoint_key(job_id)).await? {
            Some((data, etag)) => {
                let mut cp: Checkpoint = from_zstd_json(&data, MAX_DOC_BYTES).map_err(Error::corrupt)?;
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
            None => Ok(new(fresh_checkpoint(job_id), CheckedTotals::new(), None)),
        }
    }
}

/// The checkpoint of a job nothing is known of yet.
pub(super) fn fresh_checkpoint(job_id: &str) -> Checkpoint {
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
    }
}
