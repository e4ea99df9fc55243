//! The jobs in memory, under one lock (never held across an await): the core's bookkeeping
//! (`controller_core::resident`: slots, weak leases, failing marks, partitions) over this driver's
//! slots, the count of messages applied and waiting for a checkpoint, and where the calls made for
//! jobs not in memory are carried (`carried`, under a lock of its own).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use controller_core::resident::Resident;
use fleet_io::error::Error;
use fleet_io::lock;
use tokio::time::Instant;

use super::carried::CarriedCalls;
use super::job::Job;
use super::limits::FAILING_FOR;
use crate::lease::WeakLease;

/// One job's place in memory: `None` while it is not loaded (or was dropped after a failure). Each job
/// has its own lock, held across that job's S3 calls only, so jobs progress in parallel.
pub(super) type Slot = Arc<tokio::sync::Mutex<Option<Job>>>;

/// The jobs in memory.
#[derive(Default)]
pub struct Memory {
    jobs: Mutex<Resident<Slot, WeakLease>>,
    /// Messages applied in memory and waiting for a checkpoint (shared with each job's `Unsaved`).
    pending: Arc<AtomicUsize>,
    /// Calls made for jobs that were not in memory to take them (shared with each job).
    carried: CarriedCalls,
}

impl Memory {
    /// Runs `f` on the bookkeeping, under its lock (not to be held across an await).
    pub(super) fn with<T>(&self, f: impl FnOnce(&mut Resident<Slot, WeakLease>) -> T) -> T {
        f(&mut lock(&self.jobs))
    }

    /// Job `job_id`'s slot (made empty when it has none).
    pub(super) fn slot(&self, job_id: &str) -> Slot {
        self.with(|r| r.slot(job_id))
    }

    /// Every job's slot, in order.
    pub(super) fn slots(&self) -> Vec<(String, Slot)> {
        self.with(|r| r.slots())
    }

    /// Job `job_id` is loaded, or being worked on (its lock taken).
    pub(super) fn loaded(&self, job_id: &str) -> bool {
        self.with(|r| r.get(job_id).cloned()).is_some_and(|s| s.try_lock().map_or(true, |j| j.is_some()))
    }

    /// Forgets a job's slot when it is empty and nobody else holds it (clones are only made under the
    /// map's lock, so a count of one there means no task can be about to use it).
    pub(super) fn prune(&self, job_id: &str) {
        self.with(|r| r.forget_if(job_id, |s| Arc::strong_count(s) == 1 && s.try_lock().is_ok_and(|j| j.is_none())));
    }

    /// Prunes every job of `slots` (their clones dropped first).
    pub(super) fn prune_all(&self, slots: Vec<(String, Slot)>) {
        let ids: Vec<String> = slots.into_iter().map(|(k, _)| k).collect();
        for job_id in ids {
            self.prune(&job_id);
        }
    }

    /// Jobs in memory (loaded, or being worked on).
    pub fn open_jobs(&self) -> usize {
        self.with(|r| r.values().filter(|s| s.try_lock().map_or(true, |j| j.is_some())).count())
    }

    /// The error a job's messages are turned back with, without a call, while its S3 calls failed
    /// just before ([`FAILING_FOR`]) and it is not in memory (`loaded`).
    pub(super) fn turned_back(&self, job_id: &str, loaded: bool) -> Option<Error> {
        let failing = self.with(|r| r.failing(job_id, Instant::now().into_std()));
        (failing && !loaded).then_some(Error::Timeout {
            service: fleet_io::error::Service::S3,
            operation: "(job state, failed just before)",
            after: FAILING_FOR,
            attempts: 0,
        })
    }

    /// Messages applied in memory and waiting for a checkpoint.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// Handles to every message applied and not yet checkpointed (jobs being worked on skipped: their
    /// batch has them), taken before a stop's last flush: when that flush does not finish in time
    /// they are made visible at once for the partition's next owner, instead of staying invisible
    /// for as long as their last extension said (the hold's two minutes for messages applied again
    /// after a hold: found by the simulation's soak, seed 1518).
    pub fn unsaved_visibility(&self) -> Vec<fleet_engine::Visibility> {
        self.slots().iter().filter_map(|(_, slot)| slot.try_lock().ok()?.as_ref().map(|job| job.visibility())).flatten().collect()
    }

    /// The count each loaded job's `Unsaved` adds its messages to.
    pub(super) fn pending_counter(&self) -> Arc<AtomicUsize> {
        self.pending.clone()
    }

    /// The calls carried for jobs not in memory.
    pub(super) fn carried(&self) -> &CarriedCalls {
        &self.carried
    }
}
