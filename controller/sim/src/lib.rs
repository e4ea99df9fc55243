//! Why: exactness with several controllers depends on interleavings (a peer paused past its lease,
//! cut off from S3, a result redelivered behind a failure report) that no hand-written test orders
//! all of; this explores them by the thousand and checks every job's report against an oracle.
//! This file sets up one run (queues, controllers as `controller::run` drives them, the chaos
//! schedule) and returns its verdict; the fleet, the faults and the invariants are in their own modules.
//!
//! A deterministic simulation of the fleet around its controllers, in the manner of FoundationDB's
//! simulator and TigerBeetle's VOPR: one seed fixes a whole run. One to three controllers (the real
//! `controller::Aggregator`, driven as `controller::run` drives it: listeners on the results queue and
//! both dead-letter queues, the checkpoint and lease timer, the hold retry, the expiry tick) share the
//! in-memory queue and blob twins with a stand-in initiator and processor fleet (`fleet`), on one
//! thread under tokio's paused clock, which every clock of the controller reads (`controller::clock`).
//! Faults are drawn from the seed at any step (`faults`, and the chaos schedule here): a controller
//! crashes and restarts (under its own name or a new one), is paused past its lease, its S3 calls
//! fail, hang, or succeed with the answer lost and are retried, it alone is cut off from S3 for up to
//! one and a half abandon times (its breaker opens; it receives nothing until a probe gets an
//! answer), S3 goes out for everyone; results are
//! duplicated, reordered, redelivered after their visibility timeout, dead-lettered, preceded by
//! failure reports and hostile payloads. After the run the invariants are checked (`check`).
//!
//! Approximations, said plainly: the listener engine's own scheduling (dynamic consumers, long-poll
//! back-off) is replaced by one receive loop per queue; a paused controller's batched deletes still
//! leave while it is paused (its store calls and loops do stop).

pub mod check;
pub mod faults;
pub mod fleet;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use controller::clock::Clock;
use controller::{Aggregator, Source};
use fleet_engine::completion::BatchSettings;
use fleet_engine::Completions;
use fleet_io::blob::BlobStore;
use fleet_io::memory::{MemoryQueue, MemoryStore};
use fleet_io::queue::Queue;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use faults::{Faults, FaultyStore, Rates};
use fleet::JobPlan;

/// Settings of the simulated fleet (fixed; what varies is drawn from the seed).
pub const ABANDON_AFTER: Duration = Duration::from_secs(600);
pub const STALL_AFTER: Duration = Duration::from_secs(300);
/// A job whose chunks are all in, some failed, waits this long without news for a real result to
/// replace a failure (`--settle-secs`). A timing assumption, like any failure detector's: it must
/// exceed the longest a real result can be delayed, and the faults here delay one by more than the
/// default 120 s (seed 2362: two S3 calls hung 30 s each on a controller being cut off, a 13 s pause,
/// three hand-backs between controllers: 100 s after the failure report).
pub const SETTLE: Duration = Duration::from_secs(300);
/// Faults are drawn for this long; then the fleet runs without them until every job has ended.
pub const CHAOS: Duration = Duration::from_secs(600);
/// A run that has not settled by then fails.
pub const HORIZON: Duration = Duration::from_secs(4 * 3600);
const VISIBILITY: Duration = Duration::from_secs(30);
/// The queues' maxReceiveCount.
pub const MAX_RECEIVES: u32 = 4;

/// What a run shares: its trace (every fault and store call, in order) and the reports written.
pub struct World {
    start: Instant,
    trace: Mutex<Vec<String>>,
    outage: Mutex<Option<Instant>>,
    reports: Mutex<Vec<(usize, String, Bytes)>>,
    /// (job, chunk) in the order the processors first handled each work item.
    handled: Mutex<Vec<(String, u32)>>,
    echo: bool,
}

impl World {
    /// Appends a line to the trace (and prints it, when echoing).
    pub fn trace(&self, line: String) {
        let line = format!("{:>9.3}s {line}", self.start.elapsed().as_secs_f64());
        if self.echo {
            eprintln!("{line}");
        }
        fleet_io::lock(&self.trace).push(line);
    }

    /// When the store outage under way ends.
    pub fn outage_until(&self) -> Option<Instant> {
        fleet_io::lock(&self.outage).filter(|t| *t > Instant::now())
    }

    /// Records that a processor handles the chunk's work item; whether it is the first time.
    pub fn handling(&self, job: &str, chunk: u32) -> bool {
        let mut h = fleet_io::lock(&self.handled);
        let first = !h.iter().any(|(j, c)| j == job && *c == chunk);
        if first {
            h.push((job.to_string(), chunk));
        }
        first
    }

    pub fn report_written(&self, ctl: usize, key: &str, body: Bytes) {
        self.trace(format!("ctl{ctl} REPORT {key}"));
        fleet_io::lock(&self.reports).push((ctl, key.to_string(), body));
    }

    /// The faults of the run (crashes, pauses, outages, changed rates), without the calls.
    pub fn schedule(&self) -> Vec<String> {
        fleet_io::lock(&self.trace)
            .iter()
            .filter(|l| l.contains("CHAOS") || l.contains("FAILS") || l.contains("HANGS") || l.contains("LOST"))
            .cloned()
            .collect()
    }
}

/// The outcome of one seed.
#[derive(Debug)]
pub struct Run {
    pub seed: u64,
    pub controllers: usize,
    pub jobs: Vec<String>,
    /// Broken invariants (empty: the run passed).
    pub violations: Vec<String>,
    /// Faults injected, in order.
    pub schedule: Vec<String>,
    /// Hash of the whole trace: a seed run twice gives the same.
    pub trace_hash: u64,
    pub trace_len: usize,
    /// Simulated seconds until the fleet settled.
    pub simulated_secs: f64,
}

impl Run {
    /// What a failing run says: how to rerun it, its fault schedule, its broken invariants.
    pub fn failure(&self) -> String {
        let mut out = format!(
            "seed {} FAILED ({} controllers): rerun alone with `cargo run --release -p fleet-sim -- --seed {}`\n",
            self.seed, self.controllers, self.seed
        );
        for l in self.schedule.iter().filter(|l| l.contains("CHAOS")) {
            out += &format!("  {l}\n");
        }
        for v in &self.violations {
            out += &format!("  VIOLATION {v}\n");
        }
        out
    }
}

/// Options of a run beyond its seed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Print the trace as it happens.
    pub echo: bool,
    /// Send hostile results (on by default in the soak).
    pub no_hostile: bool,
}

struct Queues {
    work: Arc<MemoryQueue>,
    work_dlq: Arc<MemoryQueue>,
    results: Arc<MemoryQueue>,
    results_dlq: Arc<MemoryQueue>,
}

impl Queues {
    fn of(&self, source: Source) -> Arc<dyn Queue> {
        match source {
            Source::Results => self.results.clone(),
            Source::WorkDeadLetter => self.work_dlq.clone(),
            Source::ResultsDeadLetter => self.results_dlq.clone(),
        }
    }

    fn all(&self) -> Vec<Arc<dyn Queue>> {
        vec![self.work.clone(), self.results.clone(), self.work_dlq.clone(), self.results_dlq.clone()]
    }
}

/// One running controller: its tasks and completions (a crash aborts the one and drops the other).
struct Ctl {
    tasks: Vec<JoinHandle<()>>,
    completions: Vec<Completions>,
}

/// Waits while the controller is paused.
async fn unpaused(faults: &Mutex<Faults>) {
    loop {
        let until = fleet_io::lock(faults).paused_until;
        match until {
            Some(t) if t > Instant::now() => tokio::time::sleep_until(t).await,
            _ => return,
        }
    }
}

/// Starts a controller as `controller::run` does, on the simulated store and queues.
fn start_controller(seed: u64, idx: usize, owner: &str, lease: Duration, faulty: Arc<FaultyStore>, queues: &Queues, faults: Arc<Mutex<Faults>>) -> Ctl {
    let store: Arc<dyn BlobStore> = faulty.clone();
    let breaker = store.breaker().expect("the simulated store has a breaker");
    let mut agg = Aggregator::with_clock(store, owner.to_string(), lease, Clock::driven(1_800_000_000_000));
    for s in Source::ALL {
        agg.set_queue(s, queues.of(s).name());
    }
    agg.set_settle(SETTLE);
    agg.set_stall_limit(
        STALL_AFTER,
        controller::aggregate::FleetQueues {
            work: queues.work.clone(),
            work_dlq: queues.work_dlq.clone(),
            results: queues.results.clone(),
            results_dlq: queues.results_dlq.clone(),
        },
    );
    let agg = Arc::new(agg);
    let mut tasks = Vec::new();
    let mut completions = Vec::new();
    for source in Source::ALL {
        let q = queues.of(source);
        let done = Completions::start(q.clone(), BatchSettings::default());
        completions.push(done.clone());
        let (agg, faults, breaker) = (agg.clone(), faults.clone(), breaker.clone());
        // Which receiver gets a message is SQS's choice, not the order of the calls: each receive
        // starts after a network delay of its own.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((idx as u64) << 8) ^ source as u64);
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(rng.random_range(1..150))).await;
                unpaused(&faults).await;
                // As the listener engine does: nothing is received while the store's breaker is open.
                breaker.wait_closed().await;
                let got = match q.receive(10, Duration::from_secs(1)).await {
                    Ok(got) => got,
                    Err(_) => continue,
                };
                if got.is_empty() {
                    continue;
                }
                let applied = agg.apply(source, got.into_iter().map(|d| done.keep(d)).collect()).await;
                for k in applied.delete {
                    k.delete();
                }
                for (k, after) in applied.release {
                    k.release(after);
                }
            }
        }));
    }
    let ticker = |period: Duration, agg: Arc<Aggregator>, faults: Arc<Mutex<Faults>>, what: u8| {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                unpaused(&faults).await;
                match what {
                    0 => {
                        for k in agg.flush_idle().await {
                            k.delete();
                        }
                        agg.renew_leases().await;
                    }
                    1 => {
                        let a = agg.retry_held().await;
                        a.delete.into_iter().for_each(|k| k.delete());
                        a.release.into_iter().for_each(|(k, after)| k.release(after));
                    }
                    2 => agg.extend_held(),
                    _ => {
                        for k in agg.expire(ABANDON_AFTER).await {
                            k.delete();
                        }
                    }
                }
            }
        })
    };
    tasks.push(ticker(controller::FLUSH_INTERVAL, agg.clone(), faults.clone(), 0));
    tasks.push(ticker(Duration::from_millis(250), agg.clone(), faults.clone(), 1));
    tasks.push(ticker(Duration::from_secs(1), agg.clone(), faults.clone(), 2));
    tasks.push(ticker((ABANDON_AFTER / 10).clamp(Duration::from_millis(200), Duration::from_secs(60)), agg, faults.clone(), 3));
    // The breaker's probe, with the seed's jitter: asks the store while the breaker is open.
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((idx as u64) << 8) ^ 0x9e0b);
    tasks.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..10_000))).await;
            unpaused(&faults).await;
            if breaker.is_open() {
                faulty.probe().await;
            }
        }
    }));
    Ctl { tasks, completions }
}

/// Runs one seed to the end and checks it.
pub fn run_seed(seed: u64, opts: Options) -> Run {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("a runtime");
    rt.block_on(simulate(seed, opts))
}

async fn simulate(seed: u64, opts: Options) -> Run {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let world = Arc::new(World {
        start: Instant::now(),
        trace: Mutex::default(),
        outage: Mutex::default(),
        reports: Mutex::default(),
        handled: Mutex::default(),
        echo: opts.echo,
    });
    let store = MemoryStore::new();
    // A third of the runs point the whole fleet at a FIFO work queue (drawn apart, so that the other
    // runs are what they were before FIFO runs existed).
    let fifo = ChaCha8Rng::seed_from_u64(seed ^ 0xf1f0_f1f0).random_bool(1.0 / 3.0);
    let (work, work_dlq) = if fifo { ("billing-work.fifo", "billing-work-dlq.fifo") } else { ("billing-work", "billing-work-dlq") };
    let work_dlq = MemoryQueue::new(work_dlq, VISIBILITY);
    let results_dlq = MemoryQueue::new("billing-results-dlq", VISIBILITY);
    let queues = Queues {
        work: MemoryQueue::with_dlq(work, VISIBILITY, MAX_RECEIVES, work_dlq.clone()),
        results: MemoryQueue::with_dlq("billing-results", VISIBILITY, MAX_RECEIVES, results_dlq.clone()),
        work_dlq,
        results_dlq,
    };
    let n_ctl = rng.random_range(1..=3usize);
    let lease = Duration::from_millis(rng.random_range(3_000..=10_000));
    let jobs: Vec<Arc<JobPlan>> = fleet::plan(&mut rng, seed, !opts.no_hostile, fifo).into_iter().map(Arc::new).collect();
    world.trace(format!(
        "CHAOS setup: {n_ctl} controllers, lease {:.1} s, work queue {work}, jobs: {}",
        lease.as_secs_f64(),
        jobs.iter()
            .map(|j| {
                let groups = j.groups.map(|g| format!(" {g:?}")).unwrap_or_default();
                let chunks = j.chunks.iter().map(|c| format!("{:?}", c.fate)).collect::<Vec<_>>().join(" ");
                format!("{} {}{groups} {:?} [{chunks}]", j.id, j.shape, j.ending)
            })
            .collect::<Vec<_>>()
            .join("; ")
    ));
    // The fleet around the controllers: its calls do not fail (the controllers' do).
    let plain: Arc<dyn BlobStore> = store.clone();
    let by_id: Arc<BTreeMap<String, Arc<JobPlan>>> = Arc::new(jobs.iter().map(|j| (j.id.clone(), j.clone())).collect());
    let mut fleet_tasks = Vec::new();
    for j in &jobs {
        fleet_tasks.push(tokio::spawn(fleet::initiate(j.clone(), world.clone(), queues.work.clone(), queues.results.clone(), plain.clone())));
    }
    for p in 0..2u64 {
        let rng = ChaCha8Rng::seed_from_u64(seed ^ (0xfeed_0000 + p));
        fleet_tasks.push(tokio::spawn(fleet::process(
            by_id.clone(),
            world.clone(),
            rng,
            queues.work.clone(),
            queues.work_dlq.clone(),
            queues.results.clone(),
            plain.clone(),
        )));
    }
    // The controllers, each with its own faults.
    let mut faults = Vec::new();
    let mut owners = Vec::new();
    let mut ctls: Vec<Option<Ctl>> = Vec::new();
    for i in 0..n_ctl {
        let rates = Rates {
            fail: [0.0, 0.01, 0.05][rng.random_range(0..3)],
            hang: [0.0, 0.005, 0.02][rng.random_range(0..3)],
            lost: [0.0, 0.01, 0.03][rng.random_range(0..3)],
        };
        world.trace(format!("CHAOS ctl{i} store faults {rates:?}"));
        let f = Arc::new(Mutex::new(Faults::new(seed.wrapping_mul(31).wrapping_add(i as u64), rates)));
        let owner = format!("ctl{i}");
        let s = FaultyStore::new(store.clone(), i, f.clone(), world.clone());
        ctls.push(Some(start_controller(seed ^ 0x5eed, i, &owner, lease, s, &queues, f.clone())));
        faults.push(f);
        owners.push(owner);
    }
    // The chaos schedule, then calm until every job has ended.
    let mut next = Duration::from_millis(rng.random_range(1_000..20_000));
    let mut restart_at: Vec<Option<Instant>> = vec![None; n_ctl];
    let mut generation = vec![0u32; n_ctl];
    let mut calm = false;
    loop {
        let now = Instant::now();
        let elapsed = now - world.start;
        for i in 0..n_ctl {
            if restart_at[i].is_some_and(|t| t <= now) {
                restart_at[i] = None;
                if rng.random_bool(0.5) {
                    generation[i] += 1;
                    owners[i] = format!("ctl{i}-{}", generation[i]);
                }
                world.trace(format!("CHAOS ctl{i} restarts as {}", owners[i]));
                let s = FaultyStore::new(store.clone(), i, faults[i].clone(), world.clone());
                ctls[i] = Some(start_controller(seed ^ ((elapsed.as_millis() as u64) << 20), i, &owners[i], lease, s, &queues, faults[i].clone()));
            }
        }
        if !calm && elapsed >= CHAOS {
            calm = true;
            world.trace("CHAOS ends: no more faults".into());
            for f in &faults {
                let mut f = fleet_io::lock(f);
                f.rates = Rates::default();
                f.paused_until = None;
            }
        }
        if !calm && elapsed >= next {
            next = elapsed + Duration::from_millis(rng.random_range(2_000..60_000));
            let i = rng.random_range(0..n_ctl);
            match rng.random_range(0..10) {
                0..3 if ctls[i].is_some() => {
                    let down = Duration::from_millis(rng.random_range(100..60_000));
                    world.trace(format!("CHAOS ctl{i} crashes; back in {:.1} s", down.as_secs_f64()));
                    if let Some(c) = ctls[i].take() {
                        for t in &c.tasks {
                            t.abort();
                        }
                        for t in c.tasks {
                            let _ = t.await;
                        }
                        for done in &c.completions {
                            done.finish(false).await;
                        }
                    }
                    restart_at[i] = Some(Instant::now() + down);
                }
                3..6 => {
                    let d = Duration::from_millis(rng.random_range(500..(lease.as_millis() as u64 * 3)));
                    world.trace(format!("CHAOS ctl{i} paused for {:.1} s (lease {:.1} s)", d.as_secs_f64(), lease.as_secs_f64()));
                    fleet_io::lock(&faults[i]).paused_until = Some(Instant::now() + d);
                }
                6 => {
                    let d = Duration::from_millis(rng.random_range(1_000..120_000));
                    world.trace(format!("CHAOS S3 out for {:.1} s", d.as_secs_f64()));
                    *fleet_io::lock(&world.outage) = Some(Instant::now() + d);
                }
                7 => {
                    // Longer than the abandon time at most: the others must not abandon a job whose
                    // seal or results wait with the one cut off.
                    let d = Duration::from_millis(rng.random_range(1_000..(ABANDON_AFTER.as_millis() as u64 * 3 / 2)));
                    world.trace(format!("CHAOS ctl{i} cut off from S3 for {:.1} s", d.as_secs_f64()));
                    fleet_io::lock(&faults[i]).cut_off_until = Some(Instant::now() + d);
                }
                _ => {}
            }
        }
        if calm && restart_at.iter().all(Option::is_none) && check::settled(&jobs, &store, &queues.all()).await {
            break;
        }
        if elapsed >= HORIZON {
            world.trace("the fleet did not settle before the horizon".into());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let simulated_secs = world.start.elapsed().as_secs_f64();
    let mut violations = check::invariants(&jobs, &store, &queues.all(), &world).await;
    violations.extend(check::group_order(&jobs, &world));
    for c in ctls.into_iter().flatten() {
        for t in c.tasks {
            t.abort();
        }
    }
    for t in fleet_tasks {
        t.abort();
    }
    let trace = fleet_io::lock(&world.trace).clone();
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for l in &trace {
        hasher.update(l.as_bytes());
        hasher.update(b"\n");
    }
    Run {
        seed,
        controllers: n_ctl,
        jobs: jobs.iter().map(|j| j.id.clone()).collect(),
        violations,
        schedule: world.schedule(),
        trace_hash: hasher.digest(),
        trace_len: trace.len(),
        simulated_secs,
    }
}
