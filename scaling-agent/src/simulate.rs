//! One file because the workload model, the three strategies and the cost table are one simulation
//! read top to bottom (its tests are the last ~35 lines).
//!
//! A day of seed 004's workload, simulated second by second on a virtual clock (deterministic: a seeded
//! generator, no wall time), to compare scaling strategies at internet scale: this agent (the real
//! [`Brain::step`] `scaling-agent run` runs, fed simulated depths and instance reports, looking when a trigger
//! announces a package and slowing its looks while idle), a KEDA-like default (SQS queue length target
//! 5 per replica, 30 s polling, HPA steps, 300 s scale-down window and cooldown) and a fixed fleet
//! sized for the peak. For each: SLA misses, instance-hours, SQS and S3 requests and their cost.
//!
//! The model: packages of `min_package..max_package` transactions (seed 004: several thousand to
//! hundreds of thousands; several million a day) arrive at random seconds of busy windows that make a
//! quarter of an 8-hour business day; each is cut into work items of `chunk` transactions. The queue
//! is FIFO with SQS's batch limit (10 per receive, send and delete). An instance starts `startup`
//! seconds after it is asked for and then processes `instance_throughput` work items per second; it is
//! billed per second (at least a minute) from the request to its stop. A work item misses the SLA when
//! it completes more than `sla` seconds after its package arrived.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::time::Duration;

use fleet_io::queue::QueueDepth;
use fleet_io::trigger::InstanceReport;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::time::Instant;

use fleet_domain::prices::Prices;

use crate::step::{Brain, Seen};
use crate::Settings;

/// `scaling-agent simulate` settings.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Volumes to replay, as multiples of the daily volume.
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000")]
    pub scales: Vec<u32>,
    /// Transactions a day at 1x.
    #[arg(long, default_value_t = 4_000_000)]
    pub daily_transactions: u64,
    /// Smallest and largest package, transactions.
    #[arg(long, default_value_t = 5_000)]
    pub min_package: u64,
    #[arg(long, default_value_t = 300_000)]
    pub max_package: u64,
    /// Transactions per work item (the initiator's default chunk size).
    #[arg(long, default_value_t = 5_000)]
    pub chunk: u64,
    /// Busy hours within the 8-hour business day (08:00-16:00), in 8 windows, one per hour.
    #[arg(long, default_value_t = 2.0)]
    pub busy_hours: f64,
    /// The SLA: the longest from a package's arrival to the completion of its work items, seconds.
    #[arg(long, default_value_t = 60)]
    pub sla_secs: u64,
    /// Work items per second one instance processes.
    #[arg(long, default_value_t = 20.0)]
    pub instance_throughput: f64,
    /// Seconds from asking for an instance to its first receive.
    #[arg(long, default_value_t = 20)]
    pub startup_secs: u64,
    /// Most instances of the dynamic strategies [default: twice the fixed fleet].
    #[arg(long)]
    pub max_instances: Option<u32>,
    /// Seed of the workload generator.
    #[arg(long, default_value_t = 4)]
    pub seed: u64,
    /// Instance price per hour, USD (default: an on-demand t3.medium, us-east-1).
    #[arg(long, default_value_t = 0.0416)]
    pub price_instance_hour: f64,
    /// The requests' price table, USD: the controller's (`key=value` pairs overriding AWS's us-east-1
    /// list prices: `sqs` per million requests, `s3_put` and `s3_get` per thousand).
    #[arg(long, env = "FLEET_PRICES", default_value = "sqs=0.40,s3_put=0.005,s3_get=0.0004")]
    pub prices: Prices,
    /// Also draw the day as an SVG into FILE: waiting work items, instances and the cost so far over
    /// the day, per volume, for each strategy.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<std::path::PathBuf>,
}

impl Default for SimArgs {
    fn default() -> Self {
        SimArgs {
            scales: vec![1, 100, 1000],
            daily_transactions: 4_000_000,
            min_package: 5_000,
            max_package: 300_000,
            chunk: 5_000,
            busy_hours: 2.0,
            sla_secs: 60,
            instance_throughput: 20.0,
            startup_secs: 20,
            max_instances: None,
            seed: 4,
            price_instance_hour: 0.0416,
            prices: Prices::default(),
            svg: None,
        }
    }
}

const DAY: u64 = 86_400;
/// The processors' report interval (as `processor::REPORT_INTERVAL`).
const REPORT_EVERY: u64 = 2;

/// A day's arrivals: (second, work items), and the packages.
#[derive(Debug, Clone)]
pub struct Workload {
    pub items_at: Vec<u64>,
    pub packages: u64,
    pub transactions: u64,
}

impl Workload {
    pub fn generate(a: &SimArgs, scale: u32) -> Workload {
        let mut rng = ChaCha8Rng::seed_from_u64(a.seed ^ u64::from(scale).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let volume = a.daily_transactions.saturating_mul(u64::from(scale));
        let window = ((a.busy_hours * 3600.0 / 8.0) as u64).clamp(1, 3600);
        let mut items_at = vec![0u64; DAY as usize];
        let (mut transactions, mut packages) = (0u64, 0u64);
        while transactions < volume {
            let size = rng.random_range(a.min_package.max(1)..=a.max_package.max(a.min_package.max(1))).min(volume - transactions);
            let hour = 8 + rng.random_range(0..8u64);
            let at = hour * 3600 + rng.random_range(0..window);
            items_at[at as usize] += size.div_ceil(a.chunk.max(1));
            transactions += size;
            packages += 1;
        }
        Workload { items_at, packages, transactions }
    }

    fn items(&self) -> u64 {
        self.items_at.iter().sum()
    }

    /// Instances a fixed fleet needs so that every SLA-long window's arrivals are processed within it.
    fn peak_instances(&self, a: &SimArgs) -> u32 {
        let w = a.sla_secs.max(1) as usize;
        let (mut sum, mut best) = (0u64, 0u64);
        for i in 0..self.items_at.len() {
            sum += self.items_at[i];
            if i >= w {
                sum -= self.items_at[i - w];
            }
            best = best.max(sum);
        }
        ((best as f64 / (a.instance_throughput * w as f64)).ceil() as u32).max(1)
    }
}

/// The strategies compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// This agent: the real policy, triggers, parked listeners.
    Agent,
    /// KEDA's aws-sqs-queue scaler with its defaults and the HPA's default behaviour.
    KedaDefault,
    /// A fixed fleet sized for the peak, listeners long-polling.
    FixedPeak,
}

impl Strategy {
    /// How the table and the picture name it.
    pub fn label(self) -> &'static str {
        match self {
            Strategy::Agent => "this agent",
            Strategy::KedaDefault => "KEDA-like default",
            Strategy::FixedPeak => "fixed fleet (peak)",
        }
    }
}

/// One strategy's day: what it cost and how late the work was.
#[derive(Debug, Clone, Default)]
pub struct DayOutcome {
    pub items: u64,
    pub sla_misses: u64,
    pub p99_delay: u64,
    pub max_delay: u64,
    pub instance_seconds: u64,
    pub peak_instances: u32,
    pub sqs_requests: u64,
    pub s3_puts: u64,
    pub s3_gets: u64,
    /// Requests made while there was no work (polling, looks).
    pub idle_requests: u64,
    /// Empty receives before parking (this fleet's listeners), not yet counted.
    park_receives: u64,
    /// The day every [`SAMPLE_EVERY`] seconds (what `--svg` draws).
    pub timeline: Vec<Sample>,
}

/// Seconds between two [`Sample`]s of a day.
pub const SAMPLE_EVERY: u64 = 60;

/// One moment of a strategy's day.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sample {
    /// Seconds since midnight.
    pub t: u64,
    /// Work items waiting or in flight.
    pub waiting: u64,
    /// Instances asked for (starting or running).
    pub instances: u32,
    /// Instances and requests so far, USD (the work's own S3 and SQS requests counted at the end).
    pub cost: f64,
}

impl DayOutcome {
    pub fn cost(&self, a: &SimArgs) -> (f64, f64) {
        cost_of(a, self.instance_seconds, self.sqs_requests, self.s3_puts, self.s3_gets)
    }
}

/// Instances' and requests' cost, USD.
fn cost_of(a: &SimArgs, instance_seconds: u64, sqs: u64, s3_puts: u64, s3_gets: u64) -> (f64, f64) {
    let instances = instance_seconds as f64 / 3600.0 * a.price_instance_hour;
    let (sqs_price, put_price, get_price) = a.prices.per_request();
    let requests = sqs as f64 * sqs_price + s3_puts as f64 * put_price + s3_gets as f64 * get_price;
    (instances, requests)
}

struct Instance {
    asked: u64,
    ready: u64,
    credit: f64,
    processed: u64,
    reported: u64,
    took_last: u64,
    saturated: bool,
    id: u64,
    /// Was idle (nothing to take) at the previous second.
    idle: bool,
    /// Seconds idle in a row.
    idle_run: u64,
}

struct Sim<'a> {
    a: &'a SimArgs,
    queue: VecDeque<(u64, u64)>,
    instances: Vec<Instance>,
    next_id: u64,
    delays: Vec<u64>,
    out: DayOutcome,
    in_flight: u64,
}

impl<'a> Sim<'a> {
    fn new(a: &'a SimArgs) -> Sim<'a> {
        Sim { a, queue: VecDeque::new(), instances: Vec::new(), next_id: 0, delays: vec![0; DAY as usize * 2], out: DayOutcome::default(), in_flight: 0 }
    }

    fn visible(&self) -> u64 {
        self.queue.iter().map(|(_, n)| n).sum()
    }

    fn depth(&self) -> QueueDepth {
        QueueDepth { visible: self.visible(), in_flight: self.in_flight, delayed: 0 }
    }

    fn scale_to(&mut self, t: u64, n: u32, startup: u64) {
        while (self.instances.len() as u32) < n {
            self.instances.push(Instance {
                asked: t,
                ready: t + startup,
                credit: 0.0,
                processed: 0,
                reported: 0,
                took_last: 0,
                saturated: false,
                id: self.next_id,
                idle: true,
                idle_run: 0,
            });
            self.next_id += 1;
        }
        while (self.instances.len() as u32) > n {
            // The newest stop first (those still starting before any that works).
            let i = self.instances.pop().expect("more than n > 0");
            self.out.instance_seconds += (t - i.asked).max(60);
        }
        self.out.peak_instances = self.out.peak_instances.max(self.instances.len() as u32);
    }

    /// One second of processing; returns whether the queue was empty for the instances (idle polls).
    fn process(&mut self, t: u64) {
        let tp = self.a.instance_throughput;
        self.in_flight = 0;
        for i in self.instances.iter_mut() {
            i.took_last = 0;
            if t < i.ready {
                continue;
            }
            i.credit = (i.credit + tp).min(tp.max(1.0) * 2.0);
            let mut want = i.credit.floor() as u64;
            let cap = want;
            while want > 0 {
                let Some(front) = self.queue.front_mut() else { break };
                let take = front.1.min(want);
                front.1 -= take;
                want -= take;
                let delay = t + 1 - front.0;
                let last = self.delays.len() - 1;
                self.delays[(delay as usize).min(last)] += take;
                i.took_last += take;
                if front.1 == 0 {
                    self.queue.pop_front();
                }
            }
            i.credit -= i.took_last as f64;
            i.processed += i.took_last;
            i.saturated = cap > 0 && i.took_last == cap;
            self.in_flight += i.took_last;
            let idle = i.took_last == 0;
            // A listener of this fleet makes one empty 20 s long poll when its work runs out (work
            // arriving within it is what the poll returns), then parks.
            i.idle_run = if idle { i.idle_run + 1 } else { 0 };
            if i.idle_run == 20 {
                self.out.park_receives += 1;
            }
            i.idle = idle;
        }
    }

    fn finish(mut self, t: u64) -> DayOutcome {
        let n = 0;
        self.scale_to(t, n, 0);
        let total: u64 = self.delays.iter().sum();
        self.out.items = total;
        let sla = self.a.sla_secs;
        self.out.sla_misses = self.delays.iter().enumerate().filter(|(d, _)| *d as u64 > sla).map(|(_, n)| n).sum();
        let mut acc = 0;
        for (d, n) in self.delays.iter().enumerate() {
            acc += n;
            if self.out.p99_delay == 0 && acc * 100 >= total * 99 && total > 0 {
                self.out.p99_delay = d as u64;
            }
            if *n > 0 {
                self.out.max_delay = d as u64;
            }
        }
        // Work requests, the same for every strategy: per work item its blob (PUT by the initiator, GET
        // by the processor), a tenth of a send, receive, results send and delete, and of the
        // controller's receive and delete; per package a checkpoint and a report (PUT).
        let items = total;
        self.out.s3_gets += items;
        self.out.s3_puts += items;
        self.out.sqs_requests += (items * 6).div_ceil(10);
        self.out
    }
}

/// A strategy as the simulation drives it: once a simulated second, before the instances work, it may
/// ask for another instance count; after they worked, it may read what they did.
trait Scaler {
    /// Second `t`, with `arriving` work items just enqueued: the instance count it asks for, if it
    /// changes it (its own requests counted into `sim.out`).
    fn decide(&mut self, t: u64, arriving: u64, sim: &mut Sim) -> Option<u32>;
    /// After second `t`'s processing.
    fn after(&mut self, _t: u64, _sim: &mut Sim) {}
    /// Whether its idle listeners park (this fleet) rather than long-poll (one receive per 20 s each).
    fn parks(&self) -> bool {
        false
    }
}

/// The virtual clock's second `t` as the agent's time.
fn at(t0: Instant, t: u64) -> Instant {
    t0 + Duration::from_secs(t)
}

/// This agent: [`Brain::step`], the code `scaling-agent run` runs, with the agent's default settings
/// but for the simulated SLA, throughput, maximum and no minimum.
struct AgentScaler {
    brain: Brain,
    t0: Instant,
    next_look: u64,
}

impl AgentScaler {
    fn new(a: &SimArgs, max: u32) -> AgentScaler {
        let settings = Settings { min_instances: 0, max_instances: max, sla_secs: a.sla_secs, instance_throughput: a.instance_throughput, ..Settings::DEFAULT };
        let t0 = Instant::now();
        AgentScaler { brain: Brain::new(settings.policy(), settings.cadence(), t0), t0, next_look: 0 }
    }
}

impl Scaler for AgentScaler {
    fn decide(&mut self, t: u64, arriving: u64, sim: &mut Sim) -> Option<u32> {
        // Each arrival comes with a work-detected trigger from the initiator: it brings a look at once
        // while the agent is idle (busy, it looks at its busy interval anyway).
        let at_once = arriving > 0 && self.brain.work_detected();
        if t < self.next_look && !at_once {
            return None;
        }
        // A look: GetQueueAttributes of the work queue, its dead-letter queue, the results queue and
        // its dead-letter queue; an idle look, of the work queue alone.
        let requests = if self.brain.idle() { 1 } else { 4 };
        sim.out.sqs_requests += requests;
        let depth = sim.depth();
        if depth.visible + depth.in_flight == 0 {
            sim.out.idle_requests += requests;
        }
        let actual = sim.instances.len() as u32;
        let now = at(self.t0, t);
        let step = self.brain.step(now, Some(Seen { work: depth, all_empty: depth.visible + depth.in_flight == 0, actual: Some(actual), paused: false }));
        self.next_look = t + step.interval.as_secs();
        let d = step.decision.filter(|d| d.desired != actual)?;
        // The instances stopped say so in their last report.
        for i in sim.instances.iter().skip(d.desired as usize) {
            self.brain.report(now, InstanceReport { leaving: true, ..report(i, 0.0) });
        }
        Some(d.desired)
    }

    fn after(&mut self, t: u64, sim: &mut Sim) {
        for i in sim.instances.iter_mut() {
            if t >= i.ready && (t - i.ready).is_multiple_of(REPORT_EVERY) && i.processed != i.reported {
                let rate = (i.processed - i.reported) as f64 / REPORT_EVERY as f64;
                i.reported = i.processed;
                self.brain.report(at(self.t0, t), report(i, rate));
            }
        }
    }

    fn parks(&self) -> bool {
        true
    }
}

/// KEDA's aws-sqs-queue scaler with its defaults: the metric polled every 30 s, the HPA syncing every
/// 15 s with its default behaviour (target 5 per replica, up by at most max(4, 100 %), down to the
/// highest of the last 300 s), to zero after a 300 s cooldown.
#[derive(Default)]
struct KedaScaler {
    metric: u64,
    last_active: Option<u64>,
    history: VecDeque<(u64, u32)>,
    max: u32,
}

impl Scaler for KedaScaler {
    fn decide(&mut self, t: u64, _arriving: u64, sim: &mut Sim) -> Option<u32> {
        if t.is_multiple_of(30) {
            self.metric = sim.visible() + sim.in_flight;
            sim.out.sqs_requests += 1;
            if self.metric == 0 {
                sim.out.idle_requests += 1;
            } else {
                self.last_active = Some(t);
            }
        }
        if !t.is_multiple_of(15) {
            return None;
        }
        let current = sim.instances.len() as u32;
        if current > 0 {
            // The HPA asks the external metric at each sync.
            sim.out.sqs_requests += 1;
        }
        let raw = (self.metric.div_ceil(5) as u32).min(self.max);
        let desired = if current == 0 {
            u32::from(self.metric > 0)
        } else if self.metric == 0 && self.last_active.is_none_or(|l| t - l >= 300) {
            0
        } else {
            self.history.push_back((t, raw.max(1)));
            while self.history.front().is_some_and(|(h, _)| t - h >= 300) {
                self.history.pop_front();
            }
            let stable = self.history.iter().map(|(_, n)| *n).max().unwrap_or(1);
            if raw > current {
                raw.min(current + current.max(4))
            } else {
                stable.min(current)
            }
        };
        (desired != current).then_some(desired)
    }
}

/// A fixed fleet sized for the peak, started before the day.
struct FixedScaler(u32);

impl Scaler for FixedScaler {
    fn decide(&mut self, t: u64, _arriving: u64, _sim: &mut Sim) -> Option<u32> {
        (t == 0).then_some(self.0)
    }
}

impl Strategy {
    fn scaler(self, a: &SimArgs, w: &Workload, max: u32) -> Box<dyn Scaler> {
        match self {
            Strategy::Agent => Box::new(AgentScaler::new(a, max)),
            Strategy::KedaDefault => Box::new(KedaScaler { max, ..KedaScaler::default() }),
            Strategy::FixedPeak => Box::new(FixedScaler(w.peak_instances(a))),
        }
    }
}

/// Replays the workload under one strategy.
pub fn run_strategy(a: &SimArgs, w: &Workload, strategy: Strategy, max: u32) -> DayOutcome {
    let mut sim = Sim::new(a);
    let mut scaler = strategy.scaler(a, w, max);
    for t in 0..DAY {
        let arriving = w.items_at[t as usize];
        if arriving > 0 {
            sim.queue.push_back((t, arriving));
        }
        if let Some(n) = scaler.decide(t, arriving, &mut sim) {
            // The fixed fleet runs from before the day: no start-up.
            let startup = if strategy == Strategy::FixedPeak { 0 } else { a.startup_secs };
            sim.scale_to(t, n, startup);
        }
        sim.process(t);
        if t.is_multiple_of(SAMPLE_EVERY) {
            let live: u64 = sim.instances.iter().map(|i| t.saturating_sub(i.asked)).sum();
            let (ci, cr) = cost_of(a, sim.out.instance_seconds + live, sim.out.sqs_requests, sim.out.s3_puts, sim.out.s3_gets);
            let sample = Sample { t, waiting: sim.visible() + sim.in_flight, instances: sim.instances.len() as u32, cost: ci + cr };
            sim.out.timeline.push(sample);
        }
        if scaler.parks() {
            // A parked listener's one empty long poll before it parks.
            let parks = std::mem::take(&mut sim.out.park_receives);
            sim.out.sqs_requests += parks;
            sim.out.idle_requests += parks;
        } else {
            let idle = sim.instances.iter().filter(|i| t >= i.ready && i.idle).count() as u64;
            if t.is_multiple_of(20) {
                sim.out.sqs_requests += idle;
                sim.out.idle_requests += idle;
            }
        }
        scaler.after(t, &mut sim);
    }
    sim.finish(DAY)
}

fn report(i: &Instance, rate: f64) -> InstanceReport {
    InstanceReport {
        instance: format!("i{}", i.id),
        queue: "work".into(),
        processed: i.processed,
        rate,
        in_hand: i.took_last,
        consumers: 1,
        saturated: i.saturated,
        leaving: false,
        paused_for: Vec::new(),
    }
}

/// The strategies, in the order they are shown.
pub const STRATEGIES: [Strategy; 3] = [Strategy::Agent, Strategy::KedaDefault, Strategy::FixedPeak];

/// One volume's day under every strategy.
pub struct Day {
    pub scale: u32,
    pub workload: Workload,
    pub fixed: u32,
    pub max: u32,
    pub outcomes: Vec<(Strategy, DayOutcome)>,
}

/// Replays every volume under every strategy.
pub fn run_all(a: &SimArgs) -> Vec<Day> {
    a.scales
        .iter()
        .map(|&scale| {
            let workload = Workload::generate(a, scale);
            let fixed = workload.peak_instances(a);
            let max = a.max_instances.unwrap_or(fixed * 2).max(1);
            let outcomes = STRATEGIES.iter().map(|&s| (s, run_strategy(a, &workload, s, max))).collect();
            Day { scale, workload, fixed, max, outcomes }
        })
        .collect()
}

/// Runs every scale and strategy; returns the table.
pub fn report_table(a: &SimArgs) -> String {
    table(a, &run_all(a))
}

/// The table of days already run.
pub fn table(a: &SimArgs, days: &[Day]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "A simulated day (seed {}): packages of {}-{} transactions, {} per work item, arriving in {} busy hours of 08:00-16:00; \
         SLA {} s; {} work items/s per instance, {} s to start; prices: ${}/instance-hour, requests (USD) {}.",
        a.seed, a.min_package, a.max_package, a.chunk, a.busy_hours, a.sla_secs, a.instance_throughput, a.startup_secs, a.price_instance_hour, a.prices
    );
    for day in days {
        let (scale, w, fixed, max) = (day.scale, &day.workload, day.fixed, day.max);
        let _ = writeln!(
            out,
            "\n{scale}x: {} transactions in {} packages, {} work items; fixed fleet {fixed}, dynamic max {max}",
            w.transactions,
            w.packages,
            w.items()
        );
        let _ = writeln!(
            out,
            "{:<20} {:>10} {:>7} {:>8} {:>8} {:>10} {:>6} {:>12} {:>11} {:>10} {:>10} {:>10} {:>10}",
            "strategy", "SLA miss", "miss %", "p99 s", "max s", "inst-hours", "peak", "SQS req", "idle req", "S3 req", "$ inst", "$ req", "$ total"
        );
        for (s, o) in &day.outcomes {
            let (ci, cr) = o.cost(a);
            let _ = writeln!(
                out,
                "{:<20} {:>10} {:>7.3} {:>8} {:>8} {:>10.1} {:>6} {:>12} {:>11} {:>10} {:>10.2} {:>10.2} {:>10.2}",
                s.label(),
                o.sla_misses,
                o.sla_misses as f64 * 100.0 / o.items.max(1) as f64,
                o.p99_delay,
                o.max_delay,
                o.instance_seconds as f64 / 3600.0,
                o.peak_instances,
                o.sqs_requests,
                o.idle_requests,
                o.s3_puts + o.s3_gets,
                ci,
                cr,
                ci + cr
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_has_the_volume_and_stays_in_the_busy_windows() {
        let a = SimArgs::default();
        let w = Workload::generate(&a, 1);
        assert!(w.transactions >= a.daily_transactions && w.transactions < a.daily_transactions + a.max_package);
        for (t, n) in w.items_at.iter().enumerate() {
            if *n > 0 {
                let (hour, minute) = (t / 3600, t % 3600 / 60);
                assert!((8..16).contains(&hour) && minute < 15, "arrival at {t} s");
            }
        }
        assert_eq!(Workload::generate(&a, 1).items_at, w.items_at, "deterministic");
    }

    #[test]
    fn every_strategy_processes_every_item_and_the_agent_meets_the_sla_cheaper_than_the_fixed_fleet() {
        let a = SimArgs { scales: vec![100], ..SimArgs::default() };
        let w = Workload::generate(&a, 100);
        let max = w.peak_instances(&a) * 2;
        let agent = run_strategy(&a, &w, Strategy::Agent, max);
        let keda = run_strategy(&a, &w, Strategy::KedaDefault, max);
        let fixed = run_strategy(&a, &w, Strategy::FixedPeak, max);
        for o in [&agent, &keda, &fixed] {
            assert_eq!(o.items, w.items(), "{o:?}");
        }
        assert_eq!(fixed.sla_misses, 0, "sized for the peak: {fixed:?}");
        assert!(agent.sla_misses * 100 <= agent.items, "the agent misses at most 1 %: {agent:?}");
        assert!(agent.sla_misses <= keda.sla_misses && agent.p99_delay < keda.p99_delay, "agent {agent:?} vs KEDA {keda:?}");
        assert!(agent.instance_seconds < keda.instance_seconds, "agent {agent:?} vs KEDA {keda:?}");
        assert!(agent.instance_seconds * 2 < fixed.instance_seconds, "agent {agent:?} vs fixed {fixed:?}");
        assert!(agent.idle_requests < keda.idle_requests && agent.idle_requests < fixed.idle_requests);
    }
}
