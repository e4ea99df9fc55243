//! Scaling policy (seed 004's Dynamic Scaling Agent), pure code: from workload signals to a desired
//! number of processor instances, so that a burst is processed within the SLA's maximum delay at the
//! lowest cost.
//!
//! - Need: the work waiting and in flight must be done within what is left of the SLA while new work
//!   keeps arriving: `ceil((arrival x T + backlog + in_flight) / (throughput_per_instance x T))`, with
//!   `T` the SLA less the age of the oldest waiting work (at least a quarter of the SLA).
//! - Never below the instances holding work in flight (stopping them would only hand it back to the
//!   queue), bounded by `min` and `max`; at least one while work is waiting or was just announced
//!   (from zero at once, on a work-detected trigger or a non-empty queue).
//! - Up at once, at most `max(step, actual)` more per decision (at most doubling); down only to the
//!   highest recommendation of the stabilization window, so a noisy depth never makes it flap.
//!
//! Time comes in as an argument (`tokio::time::Instant`), so the agent, the unit tests under paused time
//! and the simulation all run this same code.

use std::collections::VecDeque;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// Policy settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PolicyConfig {
    pub min: u32,
    pub max: u32,
    /// The SLA: the longest a message may wait before it is processed.
    pub sla: Duration,
    /// Messages per second one instance processes, until instances report their own figure.
    pub default_throughput: f64,
    /// Most instances added in one decision when fewer than the actual count (up to doubling).
    pub step_up: u32,
    /// A scale-down waits until every recommendation of this window is below the actual count.
    pub stabilization: Duration,
}

impl PolicyConfig {
    /// Work items one instance clears within the SLA at the configured throughput (KEDA's target
    /// per replica).
    pub fn per_instance_within_sla(&self) -> f64 {
        self.default_throughput * self.sla.as_secs_f64()
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig { min: 1, max: 10, sla: Duration::from_secs(60), default_throughput: 10.0, step_up: 4, stabilization: Duration::from_secs(120) }
    }
}

/// The workload as the agent sees it at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Signals {
    /// Messages waiting (visible and delayed).
    pub backlog: u64,
    /// Messages received and not yet completed.
    pub in_flight: u64,
    /// New messages per second (smoothed).
    pub arrival_rate: f64,
    /// Measured messages per second of one saturated instance, when known.
    pub throughput: Option<f64>,
    /// Instances that reported work in hand.
    pub busy_instances: u32,
    /// Age of the oldest waiting message, when it can be derived.
    pub oldest_age: Option<Duration>,
    /// A work-detected trigger arrived since the last decision.
    pub work_detected: bool,
    /// The fleet is paused for a dependency that does not answer (instances say so in their reports,
    /// or the agent's own SQS calls fail): more instances would only wait too.
    pub paused: bool,
}

/// Why the desired count is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The recommendation equals the actual count.
    Steady,
    /// More instances are needed; added at once.
    ScaleUp,
    /// More are needed than one step adds; the rest follow at the next decisions.
    ScaleUpStepLimited,
    /// Work appeared while no instance ran.
    FromZero,
    /// Fewer are needed, but not for the whole stabilization window yet.
    HoldStabilizing,
    /// Fewer have been needed for the whole stabilization window.
    ScaleDown,
    /// More are needed, but the fleet is paused for a dependency's outage: none added until it answers.
    HoldPaused,
}

/// One decision with its inputs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Decision {
    pub signals: Signals,
    /// Instances running when deciding.
    pub actual: u32,
    /// What the workload needs now (before stabilization and step limits).
    pub recommended: u32,
    /// What the backend is asked for.
    pub desired: u32,
    pub reason: Reason,
    /// Messages per second per instance used.
    pub throughput: f64,
}

/// The policy with its memory (the recommendations of the stabilization window).
#[derive(Debug, Clone)]
pub struct Policy {
    pub cfg: PolicyConfig,
    started: Instant,
    history: VecDeque<(Instant, u32)>,
}

impl Policy {
    pub fn new(cfg: PolicyConfig, now: Instant) -> Policy {
        let cfg = PolicyConfig { max: cfg.max.max(cfg.min), default_throughput: cfg.default_throughput.max(0.001), ..cfg };
        Policy { cfg, started: now, history: VecDeque::new() }
    }

    /// What the workload needs now, bounded by min and max (no memory, no step limit).
    pub fn recommend(&self, s: &Signals) -> (u32, f64) {
        let c = &self.cfg;
        let throughput = s.throughput.filter(|t| t.is_finite() && *t > 0.0).unwrap_or(c.default_throughput);
        let sla = c.sla.as_secs_f64().max(0.001);
        let window = match s.oldest_age {
            Some(age) => (sla - age.as_secs_f64()).max(sla / 4.0),
            None => sla,
        };
        let arrival = if s.arrival_rate.is_finite() { s.arrival_rate.max(0.0) } else { 0.0 };
        let work = arrival * window + (s.backlog + s.in_flight) as f64;
        let need = (work / (throughput * window)).ceil();
        let mut n = if need >= f64::from(c.max) { c.max } else { need.max(0.0) as u32 };
        n = n.max(s.busy_instances.min(c.max)).max(u32::from(s.in_flight > 0));
        if s.backlog > 0 || s.work_detected {
            n = n.max(1);
        }
        (n.clamp(c.min, c.max), throughput)
    }

    /// Decides the desired count at `now` with `actual` instances running, and remembers the
    /// recommendation for later scale-downs.
    pub fn decide(&mut self, now: Instant, actual: u32, s: &Signals) -> Decision {
        let (recommended, throughput) = self.recommend(s);
        let window = self.cfg.stabilization;
        self.history.push_back((now, recommended));
        while self.history.front().is_some_and(|(t, _)| now.saturating_duration_since(*t) >= window) {
            self.history.pop_front();
        }
        let (desired, reason) = if recommended > actual && s.paused {
            (actual, Reason::HoldPaused)
        } else if recommended > actual {
            if actual == 0 {
                (recommended.min(self.cfg.step_up.max(1)), Reason::FromZero)
            } else {
                let step = self.cfg.step_up.max(actual);
                let to = recommended.min(actual.saturating_add(step));
                (to, if to < recommended { Reason::ScaleUpStepLimited } else { Reason::ScaleUp })
            }
        } else if recommended < actual {
            // The highest recommendation of the window; until the agent has seen a whole window, the
            // actual count counts as one of them.
            let mut highest = self.history.iter().map(|(_, n)| *n).max().unwrap_or(recommended);
            if now.saturating_duration_since(self.started) < window {
                highest = highest.max(actual);
            }
            if highest < actual {
                (highest, Reason::ScaleDown)
            } else {
                (actual, Reason::HoldStabilizing)
            }
        } else {
            (actual, Reason::Steady)
        };
        let desired = desired.clamp(self.cfg.min, self.cfg.max);
        Decision { signals: *s, actual, recommended, desired, reason, throughput }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PolicyConfig {
        PolicyConfig { min: 0, max: 20, sla: Duration::from_secs(60), default_throughput: 10.0, step_up: 4, stabilization: Duration::from_secs(120) }
    }

    fn backlog(n: u64) -> Signals {
        Signals { backlog: n, ..Signals::default() }
    }

    #[tokio::test(start_paused = true)]
    async fn need_is_backlog_over_throughput_times_sla_and_counts_in_flight_and_arrivals() {
        let p = Policy::new(cfg(), Instant::now());
        // 10 msg/s x 60 s = 600 messages per instance within the SLA.
        assert_eq!(p.recommend(&backlog(600)).0, 1);
        assert_eq!(p.recommend(&backlog(601)).0, 2);
        assert_eq!(p.recommend(&Signals { backlog: 600, in_flight: 600, ..Signals::default() }).0, 2);
        // 25 msg/s arriving need 3 instances on their own.
        assert_eq!(p.recommend(&Signals { arrival_rate: 25.0, ..Signals::default() }).0, 3);
        // A measured throughput replaces the default.
        assert_eq!(p.recommend(&Signals { backlog: 6000, throughput: Some(50.0), ..Signals::default() }), (2, 50.0));
        // Old work leaves less of the SLA: 600 messages aged 45 s must go in 15 s.
        assert_eq!(p.recommend(&Signals { backlog: 600, oldest_age: Some(Duration::from_secs(45)), ..Signals::default() }).0, 4);
        // Never below the instances holding work; bounded by max.
        assert_eq!(p.recommend(&Signals { in_flight: 3, busy_instances: 5, ..Signals::default() }).0, 5);
        assert_eq!(p.recommend(&backlog(1_000_000)).0, 20);
        assert_eq!(p.recommend(&Signals { backlog: u64::MAX, throughput: Some(f64::MIN_POSITIVE), ..Signals::default() }).0, 20);
        // Nothing to do: min (0 here).
        assert_eq!(p.recommend(&Signals::default()).0, 0);
        assert_eq!(Policy::new(PolicyConfig { min: 2, ..cfg() }, Instant::now()).recommend(&Signals::default()).0, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn from_zero_at_once_on_a_trigger_or_a_non_empty_queue() {
        let mut p = Policy::new(cfg(), Instant::now());
        let d = p.decide(Instant::now(), 0, &Signals { work_detected: true, ..Signals::default() });
        assert_eq!((d.desired, d.reason), (1, Reason::FromZero));
        let d = p.decide(Instant::now(), 0, &backlog(1));
        assert_eq!((d.desired, d.reason), (1, Reason::FromZero));
        // A big burst from zero: one step at once.
        let d = p.decide(Instant::now(), 0, &backlog(100_000));
        assert_eq!((d.recommended, d.desired, d.reason), (20, 4, Reason::FromZero));
    }

    #[tokio::test(start_paused = true)]
    async fn up_at_once_in_bounded_steps() {
        let mut p = Policy::new(cfg(), Instant::now());
        let s = backlog(600 * 15);
        let d = p.decide(Instant::now(), 1, &s);
        assert_eq!((d.recommended, d.desired, d.reason), (15, 5, Reason::ScaleUpStepLimited));
        let d = p.decide(Instant::now(), 5, &s);
        assert_eq!((d.desired, d.reason), (10, Reason::ScaleUpStepLimited), "step = max(4, actual): doubling");
        let d = p.decide(Instant::now(), 10, &s);
        assert_eq!((d.desired, d.reason), (15, Reason::ScaleUp));
        let d = p.decide(Instant::now(), 15, &s);
        assert_eq!((d.desired, d.reason), (15, Reason::Steady));
    }

    #[tokio::test(start_paused = true)]
    async fn down_only_after_the_stabilization_window_and_never_below_work_in_flight() {
        let t0 = Instant::now();
        let mut p = Policy::new(cfg(), t0);
        tokio::time::advance(Duration::from_secs(200)).await;
        assert_eq!(p.decide(Instant::now(), 5, &backlog(3000)).desired, 5);
        // The burst is done, but two instances still hold work.
        // Paused for an outage: nothing added however large the backlog; added once it answers.
        let mut paused = Policy::new(cfg(), Instant::now());
        let d = paused.decide(Instant::now(), 2, &Signals { backlog: 6000, paused: true, ..Signals::default() });
        assert_eq!((d.desired, d.reason), (2, Reason::HoldPaused));
        let d = paused.decide(Instant::now(), 2, &Signals { backlog: 6000, ..Signals::default() });
        assert!(d.desired > 2, "{d:?}");
        let busy = Signals { in_flight: 12, busy_instances: 2, ..Signals::default() };
        for _ in 0..11 {
            tokio::time::advance(Duration::from_secs(10)).await;
            let d = p.decide(Instant::now(), 5, &busy);
            assert_eq!((d.recommended, d.desired, d.reason), (2, 5, Reason::HoldStabilizing));
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        let d = p.decide(Instant::now(), 5, &busy);
        assert_eq!((d.desired, d.reason), (2, Reason::ScaleDown), "120 s after the last need for 5");
        // Idle afterwards: to zero only after another whole window.
        let mut first_zero = None;
        for i in 1..=20 {
            tokio::time::advance(Duration::from_secs(10)).await;
            let d = p.decide(Instant::now(), 2, &Signals::default());
            if d.desired == 0 && first_zero.is_none() {
                first_zero = Some(i * 10);
            }
        }
        assert_eq!(first_zero, Some(120), "the first decision with no need for 2 in the last 120 s");
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_agent_waits_a_whole_window_before_scaling_down() {
        let mut p = Policy::new(cfg(), Instant::now());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(p.decide(Instant::now(), 6, &Signals::default()).reason, Reason::HoldStabilizing);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(p.decide(Instant::now(), 6, &Signals::default()).desired, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_noisy_depth_does_not_flap() {
        let mut p = Policy::new(cfg(), Instant::now());
        tokio::time::advance(Duration::from_secs(300)).await;
        let mut actual = 1;
        let mut changes = Vec::new();
        // Depth jumping between 100 and 2500 every 5 s for 10 minutes (needs 1 and 5 instances).
        for i in 0..120 {
            tokio::time::advance(Duration::from_secs(5)).await;
            let depth = if i % 2 == 0 { 2500 } else { 100 };
            let d = p.decide(Instant::now(), actual, &backlog(depth));
            if d.desired != actual {
                changes.push((i, actual, d.desired));
                actual = d.desired;
            }
        }
        assert_eq!(changes, vec![(0, 1, 5)], "up once, then held: {changes:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_by_min_and_max() {
        let mut p = Policy::new(PolicyConfig { min: 2, max: 3, ..cfg() }, Instant::now());
        tokio::time::advance(Duration::from_secs(500)).await;
        assert_eq!(p.decide(Instant::now(), 2, &backlog(1_000_000)).desired, 3);
        tokio::time::advance(Duration::from_secs(500)).await;
        assert_eq!(p.decide(Instant::now(), 3, &Signals::default()).desired, 2);
        // A min above max is taken as max = min.
        assert_eq!(Policy::new(PolicyConfig { min: 4, max: 1, ..cfg() }, Instant::now()).recommend(&backlog(1_000_000)).0, 4);
    }
}
