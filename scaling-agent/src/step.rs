//! Why: the agent's one step, from what a look saw to what to ask the backend for and when to look
//! next, kept apart from the I/O around it, so the agent that runs ([`crate::run_with_state`]) and the
//! day it is simulated through ([`crate::simulate`]) call the same code and the simulated cost is the
//! cost of the agent that runs.
//!
//! [`Brain`] owns the policy (with its stabilization window), the tracker of instance reports and the
//! look cadence: `interval` while there is work, doubling up to `idle_interval` while every queue is
//! empty and no instance reports work; a work-detected trigger marks work as detected and, while idle,
//! brings the next look at once.

use std::time::Duration;

use fleet_io::queue::QueueDepth;
use fleet_io::trigger::InstanceReport;
use tokio::time::Instant;

use crate::policy::{Decision, Policy, PolicyConfig, Signals};
use crate::signals::{InstanceView, Observed, Tracker};

/// How often the agent looks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cadence {
    /// Between two looks while there is work.
    pub busy: Duration,
    /// The longest between two looks while idle (the interval doubles up to it).
    pub idle_cap: Duration,
}

impl Cadence {
    /// From the settings' seconds (at least one each; the idle cap at least the busy interval).
    pub fn from_secs(busy: u64, idle_cap: u64) -> Cadence {
        Cadence { busy: Duration::from_secs(busy.max(1)), idle_cap: Duration::from_secs(idle_cap.max(busy).max(1)) }
    }
}

/// What one look read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    /// The work queue's depth.
    pub work: QueueDepth,
    /// Every watched queue (work, results and their dead-letter queues) is empty.
    pub all_empty: bool,
    /// The instances the backend runs; `None` when it could not count them (no decision then).
    pub actual: Option<u32>,
    /// The fleet is paused for a dependency that does not answer.
    pub paused: bool,
}

/// What one step decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    /// What the tracker derived, when the look read the queues.
    pub observed: Option<Observed>,
    /// The decision, when the look read the queues and the backend counted its instances.
    pub decision: Option<Decision>,
    /// Until the next look.
    pub interval: Duration,
}

/// The agent's memory between two looks.
#[derive(Debug)]
pub struct Brain {
    policy: Policy,
    tracker: Tracker,
    cadence: Cadence,
    interval: Duration,
    work_detected: bool,
}

impl Brain {
    pub fn new(policy: PolicyConfig, cadence: Cadence, now: Instant) -> Brain {
        Brain { policy: Policy::new(policy, now), tracker: Tracker::new(), cadence, interval: cadence.busy, work_detected: false }
    }

    /// The policy's settings (as [`Policy::new`] bounded them).
    pub fn policy(&self) -> &PolicyConfig {
        &self.policy.cfg
    }

    /// An instance's report.
    pub fn report(&mut self, now: Instant, r: InstanceReport) {
        self.tracker.report(now, r);
    }

    /// A work-detected trigger for the work queue: the next decision counts it; returns whether to look
    /// at once (the agent was idle; busy, its next look is near anyway).
    pub fn work_detected(&mut self) -> bool {
        self.work_detected = true;
        self.trigger()
    }

    /// Idle: the last look found every queue empty and nothing to do; the next reads the work queue
    /// alone.
    pub fn idle(&self) -> bool {
        self.interval > self.cadence.busy
    }

    /// A trigger for any queue: returns whether to look at once (as [`Brain::work_detected`]).
    pub fn trigger(&mut self) -> bool {
        if self.interval > self.cadence.busy {
            self.interval = self.cadence.busy;
            true
        } else {
            false
        }
    }

    /// The dependencies instances report themselves paused for.
    pub fn paused_for(&self, now: Instant) -> Vec<String> {
        self.tracker.paused_for(now)
    }

    /// The instances that report, as `/state` shows them.
    pub fn instances(&self, now: Instant) -> Vec<InstanceView> {
        self.tracker.instances(now)
    }

    /// One look: from what it read (`None`: the queues could not be read) to a decision and the time
    /// until the next look.
    pub fn step(&mut self, now: Instant, seen: Option<Seen>) -> Step {
        let Some(seen) = seen else {
            // Nothing read: look again soon (work may be waiting).
            self.interval = self.cadence.busy;
            return Step { observed: None, decision: None, interval: self.interval };
        };
        let observed = self.tracker.observe(now, seen.work);
        let signals = Signals {
            backlog: seen.work.visible + seen.work.delayed,
            in_flight: seen.work.in_flight,
            arrival_rate: observed.arrival_rate,
            throughput: observed.throughput,
            busy_instances: observed.busy_instances,
            oldest_age: observed.oldest_age,
            work_detected: std::mem::take(&mut self.work_detected),
            paused: seen.paused,
        };
        let decision = seen.actual.map(|actual| self.policy.decide(now, actual, &signals));
        let idle = seen.all_empty && observed.reporting_instances == 0 && decision.is_none_or(|d| d.desired == d.actual);
        self.interval = if idle { (self.interval * 2).min(self.cadence.idle_cap) } else { self.cadence.busy };
        Step { observed: Some(observed), decision, interval: self.interval }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(visible: u64, actual: u32) -> Option<Seen> {
        Some(Seen { work: QueueDepth { visible, in_flight: 0, delayed: 0 }, all_empty: visible == 0, actual: Some(actual), paused: false })
    }

    #[tokio::test(start_paused = true)]
    async fn idle_looks_slow_down_and_a_trigger_brings_the_next_at_once() {
        let cfg = PolicyConfig { min: 0, ..PolicyConfig::default() };
        let mut b = Brain::new(cfg, Cadence::from_secs(5, 120), Instant::now());
        let intervals: Vec<u64> = (0..7).map(|_| b.step(Instant::now(), seen(0, 0)).interval.as_secs()).collect();
        assert_eq!(intervals, [10, 20, 40, 80, 120, 120, 120]);
        assert!(b.work_detected(), "idle: look at once");
        assert!(!b.trigger(), "already at the busy interval");
        let s = b.step(Instant::now(), seen(0, 0));
        let d = s.decision.unwrap();
        assert!(d.signals.work_detected && d.desired == 1, "a trigger starts one instance from zero: {d:?}");
        assert_eq!(s.interval.as_secs(), 5, "not idle while scaling");
        let s = b.step(Instant::now(), None);
        assert_eq!((s.decision, s.interval.as_secs()), (None, 5), "an unread look is retried at the busy interval");
        let s = b.step(Instant::now(), Some(Seen { actual: None, ..seen(30, 0).unwrap() }));
        assert!(s.decision.is_none() && s.observed.is_some(), "no count from the backend, no decision");
    }
}
