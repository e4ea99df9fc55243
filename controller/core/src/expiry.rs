//! What expiry decides on, without I/O: the jobs known from their open marker only (dormant), which
//! of them are due to be loaded, and whether the fleet's queues have emptied since a job's last news
//! (the stall rule's condition). The controller's scan (`controller::aggregate::scan`) reads the
//! markers and the queues' depths and feeds them here; the caller passes each event's instant.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// When a quiet job is ended: unsealed after `abandon_after` without news (abandoned), sealed after
/// `stall_after` (finished `partial`, once [`Emptied`] says nothing more can arrive; never without a
/// stall limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuietRule {
    pub abandon_after: Duration,
    pub stall_after: Option<Duration>,
}

/// Why a quiet job is ended, with the reason its report gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// It never sealed.
    Abandon(String),
    /// It sealed, and what it lacks can no longer arrive.
    Stalled(String),
}

impl QuietRule {
    /// How long a sealed or an unsealed job may be quiet (`None`: for ever).
    pub fn limit(&self, sealed: bool) -> Option<Duration> {
        if sealed {
            self.stall_after
        } else {
            Some(self.abandon_after)
        }
    }

    /// How long a dormant job must be quiet before it is loaded: an unsealed one its abandon time; a
    /// sealed one the settle time (or its stall limit, if shorter), after which one with every chunk
    /// in is finished from memory and one still missing chunks waits for the stall rule.
    pub fn load_after(&self, sealed: bool, settle: Duration) -> Duration {
        if sealed {
            self.stall_after.map_or(settle, |s| s.min(settle))
        } else {
            self.abandon_after
        }
    }

    /// Whether a job quiet for `quiet_for` is due to be ended.
    pub fn is_due(&self, sealed: bool, quiet_for: Duration) -> bool {
        self.limit(sealed).is_some_and(|l| quiet_for >= l)
    }

    /// How a job due to be ended ends (a sealed one only once the fleet's queues have emptied since
    /// its news: the caller checks).
    pub fn ending(&self, sealed: bool, quiet_for: Duration) -> Ending {
        if sealed {
            Ending::Stalled(format!(
                "no result for {} s after the job's last news, and every queue of the fleet has emptied since: its work item was lost (queue retention, FIFO de-duplication) and can no longer arrive",
                quiet_for.as_secs()
            ))
        } else {
            Ending::Abandon(format!("not sealed within {} s of its last result: the submission did not finish", self.abandon_after.as_secs()))
        }
    }
}

/// An unfinished job known from its open marker only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dormant {
    /// Its last news (its checkpoint's time, dated when this controller first saw it), or the idle
    /// floor.
    pub since: Instant,
    pub sealed: bool,
    /// The results partition its checkpoint names.
    pub partition: Option<u16>,
    /// Not loaded before then: its lease was busy when it was due.
    pub not_before: Option<Instant>,
}

/// The dormant jobs, by id (ordered: the simulation visits them in the same order on every run).
#[derive(Debug, Default)]
pub struct DormantJobs(BTreeMap<String, Dormant>);

impl DormantJobs {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Dormant)> {
        self.0.iter()
    }

    /// Whether one names no partition (its checkpoint came from the release before partitions).
    pub fn any_unpartitioned(&self) -> bool {
        self.0.values().any(|d| d.partition.is_none())
    }

    /// A scan saw `job` open, its news at `since`: what an earlier scan saw is refreshed (the job may
    /// have had news elsewhere since), a busy lease's back-off kept (with scans every tick it would be
    /// wiped each time).
    pub fn seen(&mut self, job: &str, since: Instant, sealed: bool, partition: Option<u16>) {
        let not_before = self.0.get(job).and_then(|d| d.not_before);
        self.0.insert(job.to_string(), Dormant { since, sealed, partition, not_before });
    }

    /// `job` goes back to being dormant as `d` (its load failed, or it was left to its partition's
    /// reader), replacing what is known of it.
    pub fn put_back(&mut self, job: &str, d: Dormant) {
        self.0.insert(job.to_string(), d);
    }

    /// `job` stays dormant as `d` unless it was seen again meanwhile (a take that did not load it).
    pub fn keep(&mut self, job: &str, d: Dormant) {
        self.0.entry(job.to_string()).or_insert(d);
    }

    /// Takes `job` out (it is being loaded).
    pub fn take(&mut self, job: &str) -> Option<Dormant> {
        self.0.remove(job)
    }

    /// Forgets the jobs of results partition `p` (let go: another controller reads it now).
    pub fn let_go(&mut self, p: u16) {
        self.0.retain(|_, d| d.partition != Some(p));
    }

    /// The jobs due to be loaded at `now`: past their busy lease's back-off, not `skipped` (messages
    /// held for it, or another controller's partition), and quiet, since their news or `floor`
    /// whichever is later, for as long as `load_after` says for a sealed or an unsealed job (`None`:
    /// never).
    pub fn due(
        &self,
        now: Instant,
        floor: Instant,
        skipped: impl Fn(&str, &Dormant) -> bool,
        load_after: impl Fn(bool) -> Option<Duration>,
    ) -> Vec<(String, Dormant)> {
        self.0
            .iter()
            .filter(|(k, d)| {
                !skipped(k, d)
                    && d.not_before.is_none_or(|t| now >= t)
                    && load_after(d.sealed).is_some_and(|l| now.saturating_duration_since(d.since.max(floor)) >= l)
            })
            .map(|(k, d)| (k.clone(), *d))
            .collect()
    }
}

/// Which queues one look found empty, read in the order of the fields.
#[derive(Debug, Clone, Copy, Default)]
pub struct Look {
    pub work: bool,
    pub work_dlq: bool,
    pub results: bool,
    pub results_dlq: bool,
}

/// SQS's approximate counts may miss a message sent this recently: an empty queue counts only for
/// what was sent this long before the look.
pub const DEPTH_LAG: Duration = Duration::from_secs(60);

/// Passes over the fleet's queues in the order a message moves through them, so that a sealed job
/// stalls on a busy fleet too, whose queues are never all empty at one instant. A pass starts when the
/// work queue is seen empty (at `w`: every work item sent before is done, dead-lettered or lost); it
/// completes once, later, the work dead-letter queue has been seen empty (what was dead-lettered was
/// applied) and the results queue has been seen empty (at `r`: every result sent before `w` was
/// applied or dead-lettered) and after that its dead-letter queue (applied). Each look counts only
/// [`DEPTH_LAG`] after the one it follows. A completed pass says: every message that was in the
/// fleet's queues at `w - DEPTH_LAG` has left them for good, so a job whose last news is older than
/// that can get nothing more. `observe` is fed what the controller's look at the queues read.
#[derive(Debug, Default)]
pub struct Emptied {
    pass: Option<Pass>,
    /// The start (`w`) of the last pass completed.
    emptied_at: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Pass {
    work: Instant,
    work_dlq: bool,
    results: Option<Instant>,
    results_dlq: bool,
}

impl Emptied {
    /// Takes one look, made at `at`.
    pub fn observe(&mut self, at: Instant, look: Look) {
        if let Some(p) = self.pass.as_mut() {
            let lagged = |since: Instant| at.saturating_duration_since(since) >= DEPTH_LAG;
            if look.work_dlq && lagged(p.work) {
                p.work_dlq = true;
            }
            if let Some(r) = p.results {
                if look.results_dlq && lagged(r) {
                    p.results_dlq = true;
                }
            } else if look.results && lagged(p.work) {
                p.results = Some(at);
            }
            if p.work_dlq && p.results_dlq {
                self.emptied_at = Some(p.work);
                self.pass = None;
            }
        }
        if self.pass.is_none() && look.work {
            self.pass = Some(Pass { work: at, work_dlq: false, results: None, results_dlq: false });
        }
    }

    /// Whether a pass that started at least [`DEPTH_LAG`] after `news` has completed.
    pub fn emptied_after(&self, news: Instant) -> bool {
        self.emptied_at.is_some_and(|w| w.saturating_duration_since(news) >= DEPTH_LAG)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stall rule on a busy fleet (issue 30, sequence 6): the queues are never all empty at one
    /// instant, but each is seen empty in turn, in the order messages move, and that is enough; a look
    /// in the wrong order, or too soon after the one it follows, is not.
    #[test]
    fn the_fleet_s_queues_empty_in_turn_without_all_being_empty_at_once() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let look = |work, work_dlq, results, results_dlq| Look { work, work_dlq, results, results_dlq };
        let news = at(0);
        let mut d = Emptied::default();
        // Results and their dead letters empty, but the work queue busy: nothing starts.
        d.observe(at(100), look(false, true, true, true));
        assert!(!d.emptied_after(news));
        // The work queue empties for a moment while results are in flight: a pass starts.
        d.observe(at(200), look(true, true, false, false));
        assert!(!d.emptied_after(news), "results were in flight");
        // The results queue seen empty within the lag of the work queue's look does not count ...
        d.observe(at(230), look(false, true, true, false));
        assert!(!d.emptied_after(news));
        // ... past it, it does; the work queue busy again does not matter.
        d.observe(at(300), look(false, false, true, false));
        assert!(!d.emptied_after(news), "the results dead-letter queue not yet seen empty after the results queue");
        // The results DLQ seen empty at the same look as the results queue would not count (it may hold
        // what the results queue just moved there): a lag after it, it does.
        d.observe(at(330), look(false, true, false, true));
        assert!(!d.emptied_after(news));
        d.observe(at(361), look(false, false, false, true));
        assert!(d.emptied_after(news), "work at 200, results at 300, both dead-letter queues after: emptied");
        // News after the pass started is not covered by it.
        assert!(!d.emptied_after(at(150)));
        assert!(d.emptied_after(at(140)), "a lag before the pass started");
    }

    #[test]
    fn a_quiet_job_is_abandoned_unsealed_and_stalled_sealed_only_with_a_stall_limit() {
        let rule = QuietRule { abandon_after: Duration::from_secs(3600), stall_after: Some(Duration::from_secs(600)) };
        assert!(!rule.is_due(false, Duration::from_secs(3599)) && rule.is_due(false, Duration::from_secs(3600)));
        assert!(!rule.is_due(true, Duration::from_secs(599)) && rule.is_due(true, Duration::from_secs(600)));
        assert!(matches!(rule.ending(false, Duration::from_secs(4000)), Ending::Abandon(r) if r.contains("not sealed within 3600 s")));
        assert!(matches!(rule.ending(true, Duration::from_secs(700)), Ending::Stalled(r) if r.contains("no result for 700 s")));
        let settle = Duration::from_secs(120);
        assert_eq!((rule.load_after(false, settle), rule.load_after(true, settle)), (Duration::from_secs(3600), settle));
        let short = QuietRule { stall_after: Some(Duration::from_secs(60)), ..rule };
        assert_eq!(short.load_after(true, settle), Duration::from_secs(60), "a stall limit shorter than the settle time");
        let no_stall = QuietRule { stall_after: None, ..rule };
        assert!(!no_stall.is_due(true, Duration::MAX), "a sealed job is never stalled without a stall limit");
        assert_eq!(no_stall.load_after(true, settle), settle);
    }

    #[test]
    fn a_dormant_job_is_due_once_quiet_past_its_back_off_and_a_rescan_keeps_the_back_off() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut d = DormantJobs::default();
        d.seen("sealed", at(0), true, Some(0));
        d.seen("open", at(0), false, None);
        let after = |sealed: bool| Some(if sealed { Duration::from_secs(120) } else { Duration::from_secs(3600) });
        let none = |_: &str, _: &Dormant| false;
        assert!(d.due(at(119), at(0), none, after).is_empty());
        assert_eq!(d.due(at(120), at(0), none, after).iter().map(|(j, _)| j.as_str()).collect::<Vec<_>>(), ["sealed"]);
        assert!(d.due(at(120), at(60), none, after).is_empty(), "no quiet time counts from before the floor");
        assert!(d.due(at(120), at(0), |j, _| j == "sealed", after).is_empty(), "skipped");
        assert!(d.any_unpartitioned());
        // Busy: not before its back-off, which a rescan keeps.
        let sealed = d.take("sealed").expect("dormant");
        d.keep("sealed", Dormant { not_before: Some(at(300)), ..sealed });
        d.seen("sealed", at(10), true, Some(0));
        assert!(d.due(at(299), at(0), none, after).is_empty(), "its back-off kept");
        assert_eq!(d.due(at(300), at(0), none, after).len(), 1);
        d.keep("sealed", Dormant { since: at(0), sealed: true, partition: Some(0), not_before: None });
        assert_eq!(d.iter().find(|(j, _)| *j == "sealed").map(|(_, s)| s.since), Some(at(10)), "kept only when not known");
        d.let_go(0);
        assert_eq!((d.len(), d.any_unpartitioned()), (1, true), "its partition's jobs forgotten");
    }
}
