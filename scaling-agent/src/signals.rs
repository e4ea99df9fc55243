//! Workload signals (seed 004's "workload indicators"): what the agent derives from queue depths and
//! from the instance reports processors publish while they hold work: per-instance throughput and
//! liveness, work in hand, the arrival rate, and the age of the oldest waiting message.
//!
//! The arrival rate is the growth of the work queue's total (waiting + in flight) plus what the fleet
//! completed meanwhile, per look; the policy gets the sustained rate, the lowest of the last
//! `SUSTAINED` (a burst is already in the backlog: counting it again as a rate that goes on would
//! double it; a steady stream shows in every look). The oldest message's age follows from the cumulative arrivals: the
//! queue holds the newest `visible` of them, so the oldest waiting one arrived when the cumulative count
//! passed `arrived - visible` (SQS gives no such attribute; CloudWatch's would cost a request).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use fleet_io::queue::QueueDepth;
use fleet_io::trigger::InstanceReport;
use serde::Serialize;
use tokio::time::Instant;

/// An instance that has not reported for this long (while holding work) is taken as gone.
pub const REPORT_STALE: Duration = Duration::from_secs(10);
/// The dependencies an instance may report itself paused for.
const DEPENDENCIES: [&str; 3] = ["RabbitMQ", "S3", "SQS"];
/// Weight of a new sample in the smoothed figures.
const EWMA: f64 = 0.3;
/// The arrival rate is the lowest per-look rate over this long (at least 3 looks).
const SUSTAINED: Duration = Duration::from_secs(30);
/// How far back arrival samples are kept for the age estimate.
const AGE_HORIZON: Duration = Duration::from_secs(3600);

/// One instance as last reported.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceView {
    pub instance: String,
    pub processed: u64,
    pub rate: f64,
    pub in_hand: u64,
    pub consumers: u32,
    pub saturated: bool,
    /// Seconds since its last report.
    pub seen_s_ago: f64,
    /// Dependencies it is paused for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paused_for: Vec<String>,
}

#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    report: InstanceReport,
    /// Completions not yet counted into the arrival estimate.
    uncounted: u64,
}

/// The agent's view of the work queue and the instances working on it.
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    instances: HashMap<String, Seen>,
    throughput: Option<f64>,
    /// Per-look arrival rates of the last `SUSTAINED`.
    rates: VecDeque<(Instant, f64)>,
    last: Option<(Instant, u64)>,
    arrived: u64,
    samples: VecDeque<(Instant, u64)>,
    /// Completions of departed instances not yet counted into the arrival estimate.
    departed_done: u64,
}

impl Tracker {
    pub fn new() -> Tracker {
        Tracker::default()
    }

    /// Takes an instance report in.
    pub fn report(&mut self, now: Instant, r: InstanceReport) {
        if r.leaving {
            if let Some(s) = self.instances.remove(&r.instance) {
                self.departed_done = self.departed_done.saturating_add(s.uncounted.saturating_add(r.processed.saturating_sub(s.report.processed)));
            }
            return;
        }
        if r.saturated && r.rate.is_finite() && r.rate > 0.0 {
            self.throughput = Some(match self.throughput {
                Some(t) => t + EWMA * (r.rate - t),
                None => r.rate,
            });
        }
        let uncounted = match self.instances.get(&r.instance) {
            Some(s) => s.uncounted.saturating_add(r.processed.saturating_sub(s.report.processed)),
            None => 0,
        };
        self.instances.insert(r.instance.clone(), Seen { at: now, report: r, uncounted });
    }

    /// The dependencies that most instances reporting now are paused for (sorted, each once). A
    /// dependency outage pauses every instance; one report alone (a forged or confused one) holds up
    /// no scale-up, and only the fleet's dependencies count.
    pub fn paused_for(&self, now: Instant) -> Vec<String> {
        let fresh: Vec<&Seen> = self.instances.values().filter(|s| now.saturating_duration_since(s.at) < REPORT_STALE).collect();
        let mut votes: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
        for s in &fresh {
            let mut deps: Vec<&str> = s.report.paused_for.iter().map(String::as_str).filter(|d| DEPENDENCIES.contains(d)).collect();
            deps.sort_unstable();
            deps.dedup();
            for d in deps {
                *votes.entry(d).or_default() += 1;
            }
        }
        votes.into_iter().filter(|(_, n)| n * 2 > fresh.len()).map(|(d, _)| d.to_string()).collect()
    }

    /// Drops instances that stopped reporting.
    fn expire(&mut self, now: Instant) {
        self.instances.retain(|_, s| now.saturating_duration_since(s.at) < REPORT_STALE);
    }

    /// Takes a depth of the work queue in; returns the signals for a decision.
    pub fn observe(&mut self, now: Instant, depth: QueueDepth) -> Observed {
        self.expire(now);
        // Saturating throughout: a report is a message anyone on the bus may forge.
        let done: u64 = self
            .instances
            .values_mut()
            .map(|s| std::mem::take(&mut s.uncounted))
            .fold(0u64, u64::saturating_add)
            .saturating_add(std::mem::take(&mut self.departed_done));
        let total = depth.visible.saturating_add(depth.in_flight).saturating_add(depth.delayed);
        if let Some((t, prev)) = self.last {
            let dt = now.saturating_duration_since(t).as_secs_f64();
            let grew = total.saturating_add(done).saturating_sub(prev);
            self.arrived = self.arrived.saturating_add(grew);
            if dt > 0.0 {
                self.rates.push_back((now, grew as f64 / dt));
            }
        } else {
            self.arrived = total;
        }
        self.last = Some((now, total));
        self.samples.push_back((now, self.arrived));
        while self.samples.front().is_some_and(|(t, _)| now.saturating_duration_since(*t) > AGE_HORIZON) {
            self.samples.pop_front();
        }
        let waiting = depth.visible + depth.delayed;
        let oldest_age = (waiting > 0).then(|| {
            let received = self.arrived.saturating_sub(waiting);
            let since = self.samples.iter().find(|(_, a)| *a > received).map_or(now, |(t, _)| *t);
            now.saturating_duration_since(since)
        });
        while self.rates.front().is_some_and(|(t, _)| now.saturating_duration_since(*t) > SUSTAINED) {
            self.rates.pop_front();
        }
        let arrival = if self.rates.len() >= 3 { self.rates.iter().map(|(_, r)| *r).fold(f64::INFINITY, f64::min) } else { 0.0 };
        let live: Vec<&Seen> = self.instances.values().collect();
        Observed {
            arrival_rate: arrival,
            throughput: self.throughput,
            busy_instances: live.iter().filter(|s| s.report.in_hand > 0).count() as u32,
            reporting_instances: live.len() as u32,
            oldest_age,
        }
    }

    /// The instances that reported lately.
    pub fn instances(&self, now: Instant) -> Vec<InstanceView> {
        let mut v: Vec<InstanceView> = self
            .instances
            .values()
            .map(|s| InstanceView {
                instance: s.report.instance.clone(),
                processed: s.report.processed,
                rate: s.report.rate,
                in_hand: s.report.in_hand,
                consumers: s.report.consumers,
                saturated: s.report.saturated,
                seen_s_ago: now.saturating_duration_since(s.at).as_secs_f64(),
                paused_for: s.report.paused_for.clone(),
            })
            .collect();
        v.sort_by(|a, b| a.instance.cmp(&b.instance));
        v
    }
}

/// What [`Tracker::observe`] derives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Observed {
    pub arrival_rate: f64,
    pub throughput: Option<f64>,
    pub busy_instances: u32,
    pub reporting_instances: u32,
    pub oldest_age: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth(visible: u64, in_flight: u64) -> QueueDepth {
        QueueDepth { visible, in_flight, delayed: 0 }
    }

    fn rep(id: &str, processed: u64, rate: f64, in_hand: u64, saturated: bool) -> InstanceReport {
        InstanceReport { instance: id.into(), queue: "w".into(), processed, rate, in_hand, consumers: 2, saturated, leaving: false, paused_for: Vec::new() }
    }

    #[tokio::test(start_paused = true)]
    async fn throughput_from_saturated_reports_and_liveness() {
        let mut t = Tracker::new();
        let now = Instant::now();
        t.report(now, rep("a", 10, 5.0, 3, false));
        assert_eq!(t.observe(now, depth(0, 3)).throughput, None, "an unsaturated rate says nothing about capacity");
        t.report(now, rep("a", 20, 20.0, 16, true));
        t.report(now, rep("b", 20, 30.0, 16, true));
        let o = t.observe(now, depth(100, 32));
        assert!((o.throughput.unwrap() - 23.0).abs() < 1e-9, "{o:?}");
        assert_eq!((o.busy_instances, o.reporting_instances), (2, 2));
        tokio::time::advance(REPORT_STALE).await;
        let o = t.observe(Instant::now(), depth(0, 0));
        assert_eq!((o.busy_instances, o.reporting_instances), (0, 0), "silent instances expire");
        t.report(Instant::now(), rep("c", 1, 1.0, 1, false));
        t.report(Instant::now(), InstanceReport { leaving: true, ..rep("c", 1, 1.0, 0, false) });
        assert_eq!(t.observe(Instant::now(), depth(0, 0)).reporting_instances, 0, "a leaving instance is gone at once");
    }

    #[tokio::test(start_paused = true)]
    async fn arrival_rate_counts_what_was_completed_meanwhile() {
        let mut t = Tracker::new();
        t.observe(Instant::now(), depth(0, 0));
        t.report(Instant::now(), rep("a", 0, 0.0, 0, false));
        // Each second 10 arrive and the instance completes 10: the depth stays flat.
        let mut o = Observed::default();
        for i in 1..=20u64 {
            tokio::time::advance(Duration::from_secs(1)).await;
            t.report(Instant::now(), rep("a", i * 10, 10.0, 5, false));
            o = t.observe(Instant::now(), depth(50, 5));
        }
        assert_eq!(o.arrival_rate, 10.0, "{o:?}");
        // Nothing arrives any more: no sustained rate.
        tokio::time::advance(Duration::from_secs(1)).await;
        o = t.observe(Instant::now(), depth(50, 5));
        assert_eq!(o.arrival_rate, 0.0);
        // A burst is backlog, not a rate that goes on.
        for _ in 0..40 {
            tokio::time::advance(Duration::from_secs(1)).await;
            t.observe(Instant::now(), depth(50, 5));
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(t.observe(Instant::now(), depth(5050, 5)).arrival_rate, 0.0);
    }

    /// Reports are messages anyone on the bus can send: one near `u64::MAX` neither panics nor wraps
    /// the sums, and one instance alone saying it is paused (or naming no dependency of the fleet)
    /// holds nothing up while the others work.
    #[tokio::test(start_paused = true)]
    async fn forged_reports_neither_overflow_nor_pause_the_fleet() {
        let mut t = Tracker::new();
        t.observe(Instant::now(), depth(0, 0));
        t.report(Instant::now(), rep("a", 0, 0.0, 1, false));
        t.report(Instant::now(), rep("forged", 0, 0.0, 1, false));
        t.report(Instant::now(), rep("forged", u64::MAX - 1, 0.0, 1, false));
        t.report(Instant::now(), rep("a", 10, 1.0, 1, false));
        tokio::time::advance(Duration::from_secs(1)).await;
        let o = t.observe(Instant::now(), depth(u64::MAX, u64::MAX));
        assert!(o.arrival_rate.is_finite());
        t.report(Instant::now(), InstanceReport { leaving: true, ..rep("forged", u64::MAX, 0.0, 0, false) });
        tokio::time::advance(Duration::from_secs(1)).await;
        t.observe(Instant::now(), depth(u64::MAX, 1));
        let paused = |id: &str, deps: &[&str]| InstanceReport { paused_for: deps.iter().map(|d| d.to_string()).collect(), ..rep(id, 10, 1.0, 1, false) };
        t.report(Instant::now(), rep("b", 10, 1.0, 1, false));
        t.report(Instant::now(), paused("forged", &["S3", "S3", "the moon"]));
        assert!(t.paused_for(Instant::now()).is_empty(), "one of three instances paused");
        t.report(Instant::now(), paused("a", &["S3"]));
        assert_eq!(t.paused_for(Instant::now()), ["S3"], "most instances paused for S3");
        t.report(Instant::now(), paused("b", &["the moon"]));
        assert_eq!(t.paused_for(Instant::now()), ["S3"], "not a dependency of the fleet");
    }

    #[tokio::test(start_paused = true)]
    async fn age_of_the_oldest_waiting_message() {
        let mut t = Tracker::new();
        assert_eq!(t.observe(Instant::now(), depth(0, 0)).oldest_age, None);
        // 100 arrive at t=1; nothing is taken for 30 s.
        tokio::time::advance(Duration::from_secs(1)).await;
        t.observe(Instant::now(), depth(100, 0));
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(t.observe(Instant::now(), depth(100, 0)).oldest_age, Some(Duration::from_secs(30)));
        // 100 more at t=41; the first 100 are taken (in flight): the oldest waiting is 0 s old.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(t.observe(Instant::now(), depth(100, 100)).oldest_age, Some(Duration::ZERO));
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(t.observe(Instant::now(), depth(100, 100)).oldest_age, Some(Duration::from_secs(5)));
        assert_eq!(t.observe(Instant::now(), depth(0, 100)).oldest_age, None);
    }
}
