//! The calls made for jobs that were not in memory to take them, under one lock (the core's
//! `controller_core::resident::Carried`), shared by the jobs in memory and the aggregator: a leaf,
//! so that a job and the jobs in memory can both name it.

use std::sync::{Arc, Mutex};

use controller_core::resident::{Carried, Carry, Taken};
use fleet_domain::requests::RequestCounts;
use fleet_io::lock;

/// The calls made for jobs that were not in memory to take them (see
/// `controller_core::resident::Carried`): a job dropped carries its calls since its last checkpoint
/// here, the timer's lease renewals are kept here, and a job takes its own when it is loaded, saved or
/// finished.
#[derive(Clone, Default)]
pub(super) struct CarriedCalls(Arc<Mutex<Carried>>);

impl CarriedCalls {
    /// Keeps `calls` made for job `job_id` until it takes them.
    pub(super) fn keep(&self, job_id: &str, calls: &RequestCounts) {
        lock(&self.0).keep(job_id, calls);
    }

    /// Keeps what job `job_id` carried when it was dropped from memory.
    pub(super) fn keep_dropped(&self, job_id: &str, carry: Carry) {
        lock(&self.0).keep_dropped(job_id, carry);
    }

    /// What was kept for job `job_id`, less what the checkpoint it is loaded from (`loaded`: its
    /// body's digest) holds already.
    pub(super) fn take(&self, job_id: &str, loaded: Option<[u8; 32]>) -> Taken {
        lock(&self.0).take(job_id, loaded)
    }
}
