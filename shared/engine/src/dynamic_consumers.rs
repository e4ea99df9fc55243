//! Dynamic concurrent consumers (seed 000) and the work-detected sizing rule (seed 004's
//! GetOptimalDequeueTaskCount). One iteration is one receive call. The main consumer, every
//! `sample_rate` of its iterations, checks whether every consumer is busy (received a message within its
//! last `busy_threshold` iterations): if so and below max it starts one more; otherwise, if some consumer
//! is idle (no message in its last `idle_threshold` iterations), it stops exactly one of them, never
//! going below min and never the main consumer.

use std::collections::VecDeque;

/// Scaling parameters, with the seed's meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScalingPolicy {
    pub min_consumers: usize,
    pub max_consumers: usize,
    /// Main-consumer iterations between two scaling checks.
    pub sample_rate: u32,
    /// Iterations without a message after which a consumer counts as idle.
    pub idle_threshold: u32,
    /// A consumer that received a message within this many iterations counts as busy.
    pub busy_threshold: u32,
}

impl ScalingPolicy {
    /// Defaults that scale up fast and down slowly.
    pub const DEFAULT: ScalingPolicy = ScalingPolicy { min_consumers: 1, max_consumers: 8, sample_rate: 2, idle_threshold: 20, busy_threshold: 2 };

    pub fn clamp(&self, n: usize) -> usize {
        n.clamp(self.min_consumers.max(1), self.max_consumers.max(self.min_consumers).max(1))
    }
}

/// The recent receive history of one consumer (newest last).
#[derive(Debug, Clone, Default)]
pub struct Activity {
    recent: VecDeque<bool>,
    keep: usize,
}

impl Activity {
    pub fn new(policy: &ScalingPolicy) -> Activity {
        Activity { recent: VecDeque::new(), keep: policy.idle_threshold.max(policy.busy_threshold).max(1) as usize }
    }

    /// Records one receive call and whether it brought a message.
    pub fn record(&mut self, got_messages: bool) {
        if self.recent.len() == self.keep {
            self.recent.pop_front();
        }
        self.recent.push_back(got_messages);
    }

    /// Received a message within the last `threshold` iterations.
    pub fn busy(&self, threshold: u32) -> bool {
        self.recent.iter().rev().take(threshold as usize).any(|&b| b)
    }

    /// Made at least `threshold` iterations, none of them with a message.
    pub fn idle(&self, threshold: u32) -> bool {
        self.recent.len() >= threshold as usize && self.recent.iter().rev().take(threshold as usize).all(|&b| !b)
    }
}

/// The main consumer's decision at a sample point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleDecision {
    /// Start one more consumer.
    Up,
    /// Stop the consumer with this id.
    Down(usize),
    Hold,
}

/// Decides at a sample point; `consumers` are the active ones as (id, activity, is_main).
pub fn decide<'a>(policy: &ScalingPolicy, consumers: impl IntoIterator<Item = (usize, &'a Activity, bool)>) -> ScaleDecision {
    let consumers: Vec<(usize, &Activity, bool)> = consumers.into_iter().collect();
    let n = consumers.len();
    if consumers.iter().all(|(_, a, _)| a.busy(policy.busy_threshold)) {
        return if n < policy.max_consumers { ScaleDecision::Up } else { ScaleDecision::Hold };
    }
    if n > policy.min_consumers.max(1) {
        if let Some((id, _, _)) = consumers.iter().find(|(_, a, main)| !main && a.idle(policy.idle_threshold)) {
            return ScaleDecision::Down(*id);
        }
    }
    ScaleDecision::Hold
}

/// How many consumers a queue depth calls for (seed 004's GetOptimalDequeueTaskCount as a table):
/// the count of the first rule whose `below` exceeds the depth, else `otherwise`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRules {
    pub rules: Vec<(u64, usize)>,
    pub otherwise: usize,
}

impl Default for WorkRules {
    /// Ten messages per receive: a consumer per ~20 visible messages, up to the maximum.
    fn default() -> Self {
        WorkRules { rules: vec![(10, 1), (40, 2), (100, 4)], otherwise: usize::MAX }
    }
}

impl WorkRules {
    /// Parses `below:count,below:count,...,*:count` (e.g. `10:1,40:2,100:4,*:8`).
    pub fn parse(s: &str) -> Result<WorkRules, String> {
        let mut rules = Vec::new();
        let mut otherwise = usize::MAX;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (below, count) = part.split_once(':').ok_or_else(|| format!("rule {part:?}: expected below:count"))?;
            let count: usize = count.trim().parse().map_err(|_| format!("rule {part:?}: count is not a number"))?;
            if below.trim() == "*" {
                otherwise = count;
            } else {
                let below: u64 = below.trim().parse().map_err(|_| format!("rule {part:?}: depth is not a number"))?;
                if rules.last().is_some_and(|&(b, _)| b >= below) {
                    return Err(format!("rule {part:?}: depths must increase"));
                }
                rules.push((below, count));
            }
        }
        Ok(WorkRules { rules, otherwise })
    }

    /// The optimal consumer count for `depth` (before the policy's bounds).
    pub fn optimal(&self, depth: u64) -> usize {
        self.rules.iter().find(|(below, _)| depth < *below).map_or(self.otherwise, |&(_, n)| n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: ScalingPolicy = ScalingPolicy { min_consumers: 1, max_consumers: 3, sample_rate: 4, idle_threshold: 3, busy_threshold: 2 };

    fn act(history: &[bool]) -> Activity {
        let mut a = Activity::new(&P);
        for &h in history {
            a.record(h);
        }
        a
    }

    #[test]
    fn busy_and_idle_follow_the_thresholds() {
        assert!(act(&[true, false]).busy(2));
        assert!(!act(&[true, false, false]).busy(2));
        assert!(!act(&[]).busy(2));
        assert!(act(&[true, false, false, false]).idle(3));
        assert!(!act(&[false, false]).idle(3), "too few iterations to call it idle");
        assert!(!act(&[false, true, false]).idle(3));
    }

    #[test]
    fn scale_up_only_when_all_are_busy_and_below_max() {
        let busy = act(&[true, true]);
        let quiet = act(&[true, false, false]);
        assert_eq!(decide(&P, [(0, &busy, true), (1, &busy, false)]), ScaleDecision::Up);
        // One consumer not busy (but not idle either): hold.
        assert_eq!(decide(&P, [(0, &busy, true), (1, &quiet, false)]), ScaleDecision::Hold);
        // At max: hold.
        assert_eq!(decide(&P, [(0, &busy, true), (1, &busy, false), (2, &busy, false)]), ScaleDecision::Hold);
    }

    #[test]
    fn exactly_one_idle_consumer_is_stopped_never_main_never_below_min() {
        let busy = act(&[true, true]);
        let idle = act(&[false, false, false]);
        assert_eq!(decide(&P, [(0, &busy, true), (1, &idle, false), (2, &idle, false)]), ScaleDecision::Down(1));
        // The main consumer is idle too, but it is never the one stopped.
        assert_eq!(decide(&P, [(0, &idle, true), (5, &idle, false)]), ScaleDecision::Down(5));
        assert_eq!(decide(&P, [(0, &idle, true)]), ScaleDecision::Hold);
        let p2 = ScalingPolicy { min_consumers: 2, ..P };
        assert_eq!(decide(&p2, [(0, &busy, true), (1, &idle, false)]), ScaleDecision::Hold);
    }

    #[test]
    fn work_rules_pick_the_first_matching_row() {
        let r = WorkRules::parse("100:10, 1000:50, *:100").unwrap();
        assert_eq!((r.optimal(0), r.optimal(99), r.optimal(100), r.optimal(999), r.optimal(1000)), (10, 10, 50, 50, 100));
        assert!(WorkRules::parse("100:1,50:2").is_err());
        assert!(WorkRules::parse("x:1").is_err());
        assert_eq!(WorkRules::default().optimal(5), 1);
        assert_eq!(P.clamp(WorkRules::default().optimal(1_000_000)), 3);
    }
}
