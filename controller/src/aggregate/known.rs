//! What this controller knows of the jobs not in memory (finished lately; dormant, known from their
//! open marker only), and the expiry's own clock (when the markers were last scanned, the idle floor,
//! how far the fleet's queues have emptied, when each open job's checkpoint time was first seen).
//! Each under its own lock, never held across an await; the rules are the core's
//! (`controller_core::finished`, `controller_core::expiry`, `controller_core::sighting`).

use std::sync::Mutex;
use std::time::Duration;

use controller_core::expiry::{DormantJobs, Emptied};
use controller_core::finished::FinishedJobs;
use controller_core::sighting::Sightings;
use fleet_domain::model::JobStatus;
use fleet_io::lock;
use tokio::time::Instant;

use crate::clock::Clock;

/// What this controller knows of jobs not in memory, under one lock.
#[derive(Default)]
pub(super) struct Known(Mutex<KnownJobs>);

#[derive(Default)]
struct KnownJobs {
    /// Finished before (to drop late duplicates without an S3 read).
    finished: FinishedJobs,
    /// Unsealed or sealed jobs known only by their open marker, with their last checkpoint's time:
    /// loaded when they are due to be finished, or when a message of theirs arrives.
    dormant: DormantJobs,
}

impl Known {
    /// Job `job_id` finished lately (here, or as a checkpoint read here said).
    pub(super) fn is_finished(&self, job_id: &str) -> bool {
        lock(&self.0).finished.contains(job_id)
    }

    /// How job `job_id` finished, if it finished lately.
    pub(super) fn status(&self, job_id: &str) -> Option<JobStatus> {
        lock(&self.0).finished.status(job_id)
    }

    /// Job `job_id` finished with `status`.
    pub(super) fn finished(&self, job_id: &str, status: JobStatus) {
        lock(&self.0).finished.remember(job_id, status);
    }

    /// Runs `f` on the dormant jobs, under the lock (not to be held across an await).
    pub(super) fn dormant<T>(&self, f: impl FnOnce(&mut DormantJobs) -> T) -> T {
        f(&mut lock(&self.0).dormant)
    }
}

/// The expiry's own clock, under one lock.
pub(super) struct Expiry {
    state: Mutex<ExpiryState>,
    /// Wall time (a checkpoint's time read on it when the `one-clock` fix is undone).
    clock: Clock,
}

/// When the open markers were last scanned; the idle floor (no job's idle time counts from before
/// it: the aggregator's start, so that a controller that was down longer than `abandon_after` reads
/// its queues before it abandons anything, or the end of the last store outage, so that results held
/// through it are applied first); how far the fleet's queues have emptied (for the stall rule).
struct ExpiryState {
    scanned: Option<Instant>,
    idle_floor: Instant,
    emptied: Emptied,
    /// Each open job's checkpoint time (Unix s, its writer's clock) as this controller saw it: a
    /// job's news is dated by when this controller first saw that time, never by comparing the
    /// writer's clock with its own (`sighting`). Kept to the jobs with open markers at each scan.
    seen: Sightings<String, i64>,
}

impl Expiry {
    /// Never scanned; the idle floor now.
    pub(super) fn new(clock: Clock) -> Expiry {
        let state = ExpiryState { scanned: None, idle_floor: Instant::now(), emptied: Emptied::default(), seen: Sightings::new(Duration::MAX) };
        Expiry { state: Mutex::new(state), clock }
    }

    /// No job's idle time counts from before this.
    pub(super) fn idle_floor(&self) -> Instant {
        lock(&self.state).idle_floor
    }

    /// The store did not answer until now: no job's idle time counts from before now.
    pub(super) fn raise_floor(&self) {
        lock(&self.state).idle_floor = Instant::now();
    }

    /// The open markers are due to be scanned (never scanned, or `every` ago).
    pub(super) fn scan_due(&self, every: Duration) -> bool {
        lock(&self.state).scanned.is_none_or(|t| t.elapsed() >= every)
    }

    /// Scans the open markers again at the next expiry tick.
    pub(super) fn rescan_soon(&self) {
        lock(&self.state).scanned = None;
    }

    /// The open markers are scanned now.
    pub(super) fn scanning(&self) {
        lock(&self.state).scanned = Some(Instant::now());
    }

    /// Only the jobs `open` names have open markers: the others' sightings go.
    pub(super) fn still_open(&self, open: impl Fn(&str) -> bool) {
        lock(&self.state).seen.retain(|j| open(j.as_str()));
    }

    /// When this controller first saw job `job` with checkpoint time `updated_unix` (now, on a first
    /// sight); with the `one-clock` fix undone, that time read on its own wall clock.
    pub(super) fn news_at(&self, job: &str, updated_unix: i64) -> Instant {
        if crate::undo::is(crate::undo::Fix::OneClock) {
            return Clock::instant_ago(self.clock.since_unix(updated_unix));
        }
        let now = Instant::now();
        now.checked_sub(lock(&self.state).seen.age(&job.to_string(), updated_unix, now.into_std())).unwrap_or(now)
    }

    /// Runs `f` on how far the fleet's queues have emptied, under the lock.
    pub(super) fn emptied<T>(&self, f: impl FnOnce(&mut Emptied) -> T) -> T {
        f(&mut lock(&self.state).emptied)
    }
}
