//! The controller's timings checked against one another at start (pure): a combination that could
//! finish a job before a real result held by a live peer reaches it, or abandon a job whose seal waits
//! on a queue, is refused with an error that names the flags and the value that would do.
//!
//! - **Settle** (`--settle-secs`): the longest a real result can be away from the job's owner is a
//!   peer cut off from S3 holding it: the calls of one try under way when S3 stopped answering (a load,
//!   a checkpoint and a finish: three call deadlines, `--call-deadline`), then its hold, which hands
//!   back what it held after a lease (`--lease-secs`); or a controller that received it and died,
//!   until the results queue's visibility timeout brings it back, whichever is longer; and a result
//!   can come after its work item was dead-lettered by up to a visibility timeout of the work queue.
//!   A job whose chunks are all in, some failed, must wait longer than that before it is finished.
//! - **Abandon** (`--abandon-after`): a seal sent while the controller's listeners are parked and no
//!   trigger reaches them waits for their safety poll (`--park-poll-secs`) and a long poll
//!   (`--receive-wait-secs`); a job must not be abandoned before its seal can be read.

use std::time::Duration;

/// A job whose chunks are all accounted for, some of them failed (a failure report, a dead letter,
/// an unreadable result), is finished only this long after its last news (`--settle-secs`): the
/// chunk's real result may still be on its way (a work item dead-lettered after it was billed, a
/// failure reported before a retry succeeded, a hostile result ahead of the real one), and a real
/// result replaces a failure until the job is finished. Longer than a real result can be away from
/// its job at the shipped timings (see above: three 30 s call deadlines, a 30 s lease and the
/// work queue's 30 s visibility timeout).
pub const SETTLE: Duration = Duration::from_secs(180);

/// Default lease time of a job (`--lease-secs`).
pub const LEASE: Duration = Duration::from_secs(30);

/// Default `--abandon-after`: two hours, above a parked listener's hourly safety poll.
pub const ABANDON_AFTER: Duration = Duration::from_secs(7200);

/// What the check reads (from the controller's settings, the fleet's call policy and the work queue).
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    pub settle: Duration,
    pub lease: Duration,
    pub abandon_after: Duration,
    /// A parked listener's safety poll (`None`: it never parks without triggers).
    pub park_poll: Option<Duration>,
    pub receive_wait: Duration,
    pub call_deadline: Duration,
    /// The work queue's visibility timeout (`None`: not known; the provisioned 30 s is assumed).
    pub work_visibility: Option<Duration>,
    /// The results queues' visibility timeout (the longest of the partitions'; `None`: not known,
    /// the provisioned 30 s is assumed).
    pub results_visibility: Option<Duration>,
}

/// Calls under way in one try of a job (its load, a checkpoint, its finish).
const CALLS_PER_TRY: u32 = 3;
/// The work queue's visibility timeout as provisioned, when it could not be read.
const PROVISIONED_VISIBILITY: Duration = Duration::from_secs(30);

impl Timings {
    /// The least settle time these timings allow.
    pub fn least_settle(&self) -> Duration {
        let held = (self.call_deadline * CALLS_PER_TRY + self.lease).max(self.results_visibility.unwrap_or(PROVISIONED_VISIBILITY));
        held + self.work_visibility.unwrap_or(PROVISIONED_VISIBILITY)
    }

    /// The least abandon time these timings allow (`None`: no bound, listeners never park blind).
    pub fn least_abandon(&self) -> Option<Duration> {
        self.park_poll.map(|p| p + self.receive_wait * 2)
    }

    /// Every rule broken, each said with the flags it names and the value that would do.
    pub fn check(&self) -> Result<(), Vec<String>> {
        let secs = |d: Duration| d.as_secs_f64();
        let mut broken = Vec::new();
        let settle = self.least_settle();
        if self.settle < settle {
            broken.push(format!(
                "--settle-secs {} is shorter than a real result can be away from its job: the longer of {CALLS_PER_TRY} x --call-deadline {} + --lease-secs {} \
                 and the results queue's visibility timeout {}{}, plus the work queue's visibility timeout {}{}; \
                 a job with a failed chunk could be finished before that chunk's real result reaches it: use --settle-secs {} or more",
                secs(self.settle),
                secs(self.call_deadline),
                secs(self.lease),
                secs(self.results_visibility.unwrap_or(PROVISIONED_VISIBILITY)),
                if self.results_visibility.is_none() { " (assumed: not read)" } else { "" },
                secs(self.work_visibility.unwrap_or(PROVISIONED_VISIBILITY)),
                if self.work_visibility.is_none() { " (assumed: not read)" } else { "" },
                settle.as_secs_f64().ceil()
            ));
        }
        if let (Some(least), Some(poll)) = (self.least_abandon(), self.park_poll) {
            if self.abandon_after < least {
                broken.push(format!(
                    "--abandon-after {} is shorter than a seal can wait for a parked listener: --park-poll-secs {} + 2 x --receive-wait-secs {}; \
                     a job could be abandoned while its seal waits on the queue: use --abandon-after {} or more, or a shorter --park-poll-secs",
                    secs(self.abandon_after),
                    secs(poll),
                    secs(self.receive_wait),
                    least.as_secs_f64().ceil()
                ));
            }
        }
        if broken.is_empty() {
            Ok(())
        } else {
            Err(broken)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> Timings {
        Timings {
            settle: SETTLE,
            lease: LEASE,
            abandon_after: ABANDON_AFTER,
            park_poll: Some(Duration::from_secs(3600)),
            receive_wait: Duration::from_secs(20),
            call_deadline: Duration::from_secs(30),
            work_visibility: Some(Duration::from_secs(30)),
            results_visibility: Some(Duration::from_secs(30)),
        }
    }

    #[test]
    fn the_shipped_defaults_pass() {
        assert_eq!(shipped().check(), Ok(()));
        // With the visibility timeout the deploy's docs name (45 s) too.
        assert_eq!(Timings { work_visibility: Some(Duration::from_secs(45)), ..shipped() }.check(), Ok(()));
    }

    #[test]
    fn a_settle_shorter_than_a_held_result_can_be_away_is_refused_naming_the_flags() {
        // The case: settle 120 s at a 30 s lease and 30 s call deadlines.
        let t = Timings { settle: Duration::from_secs(120), ..shipped() };
        let e = t.check().unwrap_err();
        assert_eq!(e.len(), 1);
        assert!(e[0].contains("--settle-secs 120") && e[0].contains("--call-deadline 30") && e[0].contains("--lease-secs 30"), "{}", e[0]);
        assert!(e[0].contains("use --settle-secs 150 or more"), "{}", e[0]);
    }

    #[test]
    fn a_settle_shorter_than_the_results_visibility_is_refused() {
        // A result received by a controller that died comes back after the results queue's
        // visibility timeout (found by the simulation, seed 299: 180 s against a settle of 136 s).
        let t = Timings { results_visibility: Some(Duration::from_secs(180)), ..shipped() };
        let e = t.check().unwrap_err();
        assert!(e[0].contains("the results queue's visibility timeout 180") && e[0].contains("use --settle-secs 210 or more"), "{}", e[0]);
    }

    #[test]
    fn abandoning_before_a_parked_listener_reads_the_seal_is_refused() {
        let t = Timings { abandon_after: Duration::from_secs(3600), ..shipped() };
        let e = t.check().unwrap_err();
        assert!(e[0].contains("--abandon-after 3600") && e[0].contains("--park-poll-secs 3600"), "{e:?}");
        // Without a safety poll there is nothing to race.
        assert_eq!(Timings { park_poll: None, ..t }.check(), Ok(()));
    }
}
