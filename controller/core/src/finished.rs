//! The jobs this controller finished lately, with how each ended: the last [`REMEMBERED`], so that a
//! late duplicate of a finished job is dropped without a store read (older ones are read from their
//! checkpoint, which says the same).

use std::collections::{HashMap, VecDeque};

use fleet_domain::model::JobStatus;

/// Finished jobs remembered.
pub const REMEMBERED: usize = 10_000;

/// The finished jobs remembered, oldest first out.
#[derive(Debug)]
pub struct FinishedJobs {
    status: HashMap<String, JobStatus>,
    order: VecDeque<String>,
    capacity: usize,
}

impl Default for FinishedJobs {
    fn default() -> FinishedJobs {
        FinishedJobs::new(REMEMBERED)
    }
}

impl FinishedJobs {
    pub fn new(capacity: usize) -> FinishedJobs {
        FinishedJobs { status: HashMap::new(), order: VecDeque::new(), capacity }
    }

    /// `job` finished as `status` (a job remembered already keeps its place, its status updated).
    pub fn remember(&mut self, job: &str, status: JobStatus) {
        if self.status.insert(job.to_string(), status).is_none() {
            self.order.push_back(job.to_string());
            if self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.status.remove(&old);
                }
            }
        }
    }

    /// How `job` finished, if it is remembered.
    pub fn status(&self, job: &str) -> Option<JobStatus> {
        self.status.get(job).copied()
    }

    pub fn contains(&self, job: &str) -> bool {
        self.status.contains_key(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_is_forgotten_first_and_a_job_remembered_again_keeps_its_place() {
        let mut f = FinishedJobs::new(2);
        f.remember("a", JobStatus::Complete);
        f.remember("b", JobStatus::Partial);
        f.remember("a", JobStatus::Quarantined);
        assert_eq!((f.status("a"), f.status("b")), (Some(JobStatus::Quarantined), Some(JobStatus::Partial)));
        f.remember("c", JobStatus::Complete);
        assert!(!f.contains("a") && f.contains("b") && f.contains("c"), "a, the oldest, forgotten");
    }
}
