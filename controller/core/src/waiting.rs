//! Where the jobs that wait for results wait: the partitions whose listeners should look now rather
//! than at their safety poll, because what their quiet jobs wait for may come unannounced (a result
//! SQS moved to a dead-letter queue with the scaling agent down). Decided from what the driver sees
//! of its jobs (their last news and partition), without I/O.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// The partitions to look at now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Waiting {
    /// The partitions their messages travel on.
    pub partitions: BTreeSet<u16>,
    /// A job whose partition is not known (its checkpoint came from the release before partitions).
    pub any: bool,
}

impl Waiting {
    /// The partitions of the jobs that have had no news for `quiet` at `now` (never counted from before
    /// `floor`): `open`, the jobs in memory that take results and are not being worked on, each with its
    /// last news and partition; `dormant`, the jobs known from their open marker only, each with when it
    /// was last seen to change and its partition, of which only those whose partition `loads_here` count
    /// (the others are their readers'). Skipping the dormant jobs made a result of one dead-lettered
    /// unannounced wait for the hourly safety poll, and its news then restarted the job's abandon time
    /// (the simulation, seed 9103683: a report 2 h past its bound).
    pub fn of(
        now: Instant,
        floor: Instant,
        quiet: Duration,
        open: impl IntoIterator<Item = (Instant, Option<u16>)>,
        dormant: impl IntoIterator<Item = (Instant, Option<u16>)>,
        loads_here: impl Fn(Option<u16>) -> bool,
    ) -> Waiting {
        let mut out = Waiting::default();
        let quiet_since = |since: Instant| now.saturating_duration_since(since.max(floor)) >= quiet;
        if !crate::undo::is(crate::undo::Fix::WaitingLooks) {
            for (since, partition) in dormant {
                if quiet_since(since) && loads_here(partition) {
                    out.add(partition);
                }
            }
        }
        for (news, partition) in open {
            if quiet_since(news) {
                out.add(partition);
            }
        }
        out
    }

    fn add(&mut self, partition: Option<u16>) {
        match partition {
            Some(p) => {
                self.partitions.insert(p);
            }
            None => self.any = true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_jobs_name_their_partitions_and_dormant_ones_only_where_they_load() {
        let t0 = Instant::now();
        let quiet = Duration::from_secs(60);
        let now = t0 + Duration::from_secs(100);
        let open = [(t0, Some(1)), (now, Some(2)), (t0, None)];
        let dormant = [(t0, Some(3)), (t0, Some(4)), (now, Some(5))];
        let w = Waiting::of(now, t0, quiet, open, dormant, |p| p != Some(4));
        assert_eq!(w, Waiting { partitions: BTreeSet::from([1, 3]), any: true }, "2 and 5 had news; 4 is another reader's");
        let floor = t0 + Duration::from_secs(50);
        assert_eq!(Waiting::of(now, floor, quiet, open, dormant, |_| true), Waiting::default(), "no quiet time from before the floor");
    }
}
