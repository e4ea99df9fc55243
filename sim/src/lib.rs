//! Why: exactness with several controllers depends on interleavings (a peer paused past its lease,
//! cut off from S3, a partition handed over mid-batch, a result redelivered behind a failure report)
//! that no hand-written test orders all of; this explores them by the thousand and checks every job's
//! report against an oracle. This file sets up one run (queues, controllers, the chaos schedule) and
//! returns its verdict; the fleet, the faults and the invariants are in their own modules.
//!
//! A deterministic simulation of the fleet around its controllers, in the manner of FoundationDB's
//! simulator and TigerBeetle's VOPR: one seed fixes a whole run. One to four controllers, each
//! `controller::run_with_clock` itself (the service's own listeners, partition balancing, timers,
//! graceful stop: nothing re-created here), share the in-memory queue and blob twins with the real
//! initiator (`initiator::submit::submit_inputs`, one submission per job) and two real processors
//! (`processor::start`: the listener engine and the work handler), on one thread under tokio's paused
//! clock (`fleet`). Each controller
//! reads wall time from a clock of its own, skewed from the others' by up to three leases either way
//! (leases, memberships and a job's news are judged on each reader's own clock, `controller::sighting`). The
//! settings are the shipped defaults in half the runs and drawn around them in the rest (always a
//! combination the start check, `controller::timings`, accepts); the results queue has one to four
//! partitions.
//!
//! Faults are drawn from the seed (`faults`, and the chaos schedule here): a controller crashes (its
//! calls never end) and restarts under its own name or a new one, stops gracefully and comes back
//! later, joins late, is paused past its lease; its S3 calls fail, hang, or succeed with the answer
//! lost and are retried; it alone is cut off from S3 (its breaker opens; it receives nothing until a
//! probe gets an answer); S3 goes out for everyone; its SQS calls take a round trip of their own and
//! fail. Results are duplicated, reordered, redelivered after their visibility timeout,
//! dead-lettered, preceded by failure reports and hostile payloads, forged (seals, counts, job ids).
//! One run in five is calm: no fault and no hostile sender; in it nothing reaches a results
//! dead-letter queue (only work items that truly fail reach the work queue's). After the run the
//! invariants are checked (`check`).
//!
//! A seed replays call for call: the fleet's random waits draw from a generator seeded per seed
//! (`fleet_io::jitter`), every `select!` the run goes through is biased, and CPU work (the
//! initiator's reading and compression, billing, decoding) runs in place on the seed's one thread
//! (`fleet_io::blocking`), so nothing depends on real time (`a_seed_replays_every_call`). Work-detected triggers (RabbitMQ) are an in-memory bus in half
//! the runs (`Setup::triggers`); in the other half listeners long-poll as they do without them.

pub mod check;
pub mod faults;
pub mod fleet;
pub mod observe;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use controller::clock::Clock;
use fleet_io::blob::BlobStore;
use fleet_io::memory::{MemoryQueue, MemoryStore};
use fleet_io::queue::{Queue, Sharded};
use fleet_io::trigger::memory::MemoryTriggers;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use controller::undo::Fix;
use faults::{Faults, FaultyQueue, FaultyStore, Life, Rates};
use fleet::JobPlan;

/// Faults are drawn for this long; then the fleet runs without them until every job has ended.
pub const CHAOS: Duration = Duration::from_secs(600);
/// The work and results queues' visibility timeout, as provisioned.
pub const VISIBILITY: Duration = Duration::from_secs(30);
/// The queues' maxReceiveCount.
pub const MAX_RECEIVES: u32 = 4;
/// The fleet's S3 call deadline (`--call-deadline`): a hung store's call fails after it.
pub const CALL_DEADLINE: Duration = Duration::from_secs(30);
/// The controllers' wall clocks start here (2027-01-15), each skewed by its own offset.
const EPOCH_MS: u64 = 1_800_000_000_000;
/// A controller that reads a queue gets an answer at least this often (a receive waits at most 20 s).
pub const READ_WINDOW: Duration = Duration::from_secs(25);
/// The most controllers at once (joins stop there).
const MAX_CONTROLLERS: usize = 4;

/// The settings of one run, drawn from its seed.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Controllers at the start.
    pub controllers: usize,
    pub partitions: u16,
    /// The controllers' settings (`id` set per controller).
    pub settings: controller::Settings,
    /// At the shipped defaults (`controller::Settings::default()`), or drawn around them.
    pub defaults: bool,
    /// No fault and no hostile sender (chunks that truly fail still dead-letter their work item).
    pub calm: bool,
    pub fifo: bool,
    /// Work-detected triggers on an in-memory bus (half the runs): idle listeners park and wake on
    /// them, as with RabbitMQ; without, they long-poll.
    pub triggers: bool,
    /// The visibility timeout of the results partitions and their dead-letter queues.
    pub results_visibility: Duration,
    /// A rolling upgrade from the release before partitions (half the runs with faults): each
    /// controller's first life writes its checkpoints as that release did, naming no partition, until
    /// it is stopped and started again as this release, within the chaos.
    pub upgrade: bool,
    /// A quiet rolling upgrade (a third of the upgrades, with at least two controllers): no other
    /// fault of the controllers while the releases change, only the fleet's stragglers and dead
    /// letters. Other faults break the leases the upgrade's mistakes hold for ever (a job kept by a
    /// controller that does not read its partition: `partition-from-manifest`), and hide them.
    pub quiet: bool,
    /// The scaling agent is down for the whole run (a crash loop, its node lost; a third of the runs
    /// with faults and triggers): nobody announces what comes back on a queue unannounced, and the
    /// controllers must finish their jobs without it. The processors, whose work items come back so
    /// (a lost delete) and whom the agent exists to wake, look every 30 s while parked.
    pub agent_down: bool,
    /// Rare paths made common, as FoundationDB's BUGGIFY does (a quarter of the runs with faults,
    /// drawn apart): a chunk's work item lost five times as often (15% of chunks), its delete lost
    /// more than twice as often (20%), every lost delete's copy late, and at least two jobs, so that
    /// what one job leaves behind meets another job's wait within a thousand seeds (a late copy
    /// dead-lettered after its job ended, on a partition nobody waits on, holding another job's
    /// stall look: `stall-look-announces` undone fails seed 519, not caught in 1,000 before).
    pub buggify: bool,
    /// A misconfigured controller (a quarter of the runs with faults and two controllers or more):
    /// slot `.0` runs with `--lease-secs` `.1`, twice the others'. Its peers, with their shorter
    /// lease, must not take what it renews every third of its own. (The settle and abandon times are
    /// drawn for the longer lease, as its own timings check would ask.)
    pub odd_lease: Option<(usize, u64)>,
}

impl Setup {
    /// The setup of `seed`.
    pub fn draw(seed: u64, opts: Options) -> Setup {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x05e7_05e7);
        let defaults = rng.random_bool(0.5);
        let calm = rng.random_bool(0.2);
        // A third of the runs point the whole fleet at a FIFO work queue.
        let fifo = ChaCha8Rng::seed_from_u64(seed ^ 0xf1f0_f1f0).random_bool(1.0 / 3.0);
        let mut settings = controller::Settings::default();
        settings.listener.http_addr = None;
        // Every message is checked by role (the keys are the run's, drawn from the seed).
        settings.role_keys = Some(fleet::Keys::of(seed).ring());
        // The results queues' visibility timeout (an operator may raise it): the provisioned 30 s at
        // the shipped defaults, else up to six times that (drawn apart).
        let results_visibility = if defaults { VISIBILITY } else { VISIBILITY * [1, 3, 6][ChaCha8Rng::seed_from_u64(seed ^ 0x0715_0715).random_range(0..3)] };
        let mut misconfigured = ChaCha8Rng::seed_from_u64(seed ^ 0x1ea5_e1ea);
        let odd = !calm && misconfigured.random_bool(0.25);
        if !defaults {
            settings.lease_secs = rng.random_range(10..=60);
            let longest = controller::Settings { lease_secs: settings.lease_secs * if odd { 2 } else { 1 }, ..settings.clone() };
            let t = longest.timings(CALL_DEADLINE, Some(VISIBILITY), Some(results_visibility));
            settings.settle_secs = t.least_settle().as_secs() + rng.random_range(0..=120);
            settings.abandon_after = t.least_abandon().map_or(600, |d| d.as_secs()) + rng.random_range(0..=1800);
            settings.stall_after = rng.random_range(600..=3600);
            settings.blob_retention_secs = [0, 60, 900][rng.random_range(0..3)];
            settings.drain_secs = rng.random_range(10..=30);
        }
        let triggers = opts.triggers && ChaCha8Rng::seed_from_u64(seed ^ 0x7419_7419).random_bool(0.5);
        let upgrade = !calm && ChaCha8Rng::seed_from_u64(seed ^ 0x0b50_0b50).random_bool(0.5);
        let quiet = upgrade && ChaCha8Rng::seed_from_u64(seed ^ 0x9017_9017).random_bool(1.0 / 3.0);
        let agent_down = triggers && !calm && ChaCha8Rng::seed_from_u64(seed ^ 0xa6e7_a6e7).random_bool(1.0 / 3.0);
        let buggify = !calm && ChaCha8Rng::seed_from_u64(seed ^ 0xb066_1f00).random_bool(0.25);
        let controllers = rng.random_range(1..=3);
        let controllers = if quiet { controllers.max(2) } else { controllers };
        let odd_lease = (odd && controllers >= 2).then(|| (misconfigured.random_range(0..controllers), settings.lease_secs * 2));
        Setup {
            odd_lease,
            controllers,
            partitions: rng.random_range(1..=4),
            settings,
            defaults,
            calm,
            fifo,
            triggers,
            results_visibility,
            upgrade,
            quiet,
            agent_down,
            buggify,
        }
    }

    /// The share of billed chunks that straggle: none in calm runs, one in ten in runs with faults,
    /// one in four in runs with a rolling upgrade (a job whose checkpoint the release before
    /// partitions wrote is then often quiet past its settle time with a result still to come).
    pub fn stragglers(&self) -> f64 {
        if self.calm {
            0.0
        } else if self.upgrade {
            0.25
        } else {
            0.1
        }
    }

    /// The longest lease of the fleet's controllers (a misconfigured one's may be longer).
    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.odd_lease.map_or(self.settings.lease_secs, |(_, l)| l.max(self.settings.lease_secs)))
    }

    /// When a run that has not settled fails.
    pub fn horizon(&self) -> Duration {
        CHAOS + Duration::from_secs(self.settings.abandon_after + self.settings.stall_after + self.settings.blob_retention_secs) + Duration::from_secs(3600)
    }
}

/// A controller paused as it wrote a report: which, and its faults (to end the pause).
pub(crate) type PausedAtReport = (usize, Arc<Mutex<Faults>>);

/// A stretch of a controller's store calls in trouble: from, to, and whether hard (see `World`).
type Trouble = (Instant, Instant, bool);

/// What a run shares: its trace (every fault and store call, in order) and what the checks read.
pub struct World {
    start: Instant,
    trace: Mutex<Vec<String>>,
    outage: Mutex<Option<Instant>>,
    /// (controller, key, body, when) of every report written.
    reports: Mutex<Vec<(usize, String, Bytes, Duration)>>,
    /// (job, chunk) in the order the processors first handled each work item.
    handled: Mutex<Vec<(String, u32)>>,
    /// Messages received from each dead-letter queue by the controllers, and which (by id).
    dead_letters: Mutex<BTreeMap<String, usize>>,
    dead_letter_ids: Mutex<std::collections::BTreeSet<(String, String)>>,
    /// When the fleet last sent news of each job: a chunk's first result or failure report, a
    /// dead-lettered result no copy of which reached the results queue, its first seal or abandon (a
    /// duplicate is no news to the controller either, `duplicates-not-news`).
    last_sent: Mutex<BTreeMap<String, Duration>>,
    /// When the last fault's effects end (a pause, an outage, a cut-off, a controller's absence).
    faults_end: Mutex<Duration>,
    /// When each stalled processor sent what it held (see [`World::work_held`]).
    work_held_until: Mutex<Vec<Duration>>,
    /// Who reads which results partition: see [`World::read`].
    readers: Mutex<observe::Readers>,
    /// (controller, receipt) of the messages held through an outage, with when the hold's last
    /// extension runs out (see [`World::holding`]).
    held: Mutex<BTreeMap<(usize, String), Instant>>,
    /// The partitions each controller was told to stop reading (heard from its events), each
    /// controller's current name, and the reads made a receive's wait after such a stop.
    stops: observe::Stops,
    names: Mutex<BTreeMap<usize, String>>,
    late_reads: Mutex<Vec<String>>,
    /// Leases and memberships taken from a holder that may still act on them (see `observe::Takeovers`).
    pub(crate) takeovers: Mutex<observe::Takeovers>,
    /// Receipts deleted.
    deleted: Mutex<std::collections::BTreeSet<String>>,
    /// Per owner, when its store calls were in trouble: (from, to, hard). Hard: hung, frozen by an
    /// outage, a cut-off or a pause; soft: a call on the ownership document failed or lost its answer.
    store_trouble: Mutex<BTreeMap<String, Vec<Trouble>>>,
    /// Every controller process started: its name and its life.
    lives: Mutex<Vec<(String, faults::Life)>>,
    /// Per job, the owners (process names) that wrote its lease or checkpoint.
    writers: Mutex<BTreeMap<String, std::collections::BTreeSet<String>>>,
    /// Jobs with a result dead-lettered before any controller had heard of them.
    pub(crate) unheard_dead_letters: Mutex<std::collections::BTreeSet<String>>,
    /// Controllers paused as they wrote a job's report until a peer reads that job's checkpoint
    /// parts (`Faults::pause_at_report`), by job.
    pub(crate) report_pauses: Mutex<BTreeMap<String, PausedAtReport>>,
    echo: bool,
    /// Every queue call is traced (as when echoing), printed or not.
    pub(crate) every_call: bool,
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

    /// Simulated time since the run started.
    pub fn now(&self) -> Duration {
        self.start.elapsed()
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
        fleet_io::lock(&self.reports).push((ctl, key.to_string(), body, self.now()));
    }

    pub fn dead_letters_received<'a>(&self, queue: &str, ids: impl Iterator<Item = &'a str>) {
        let mut n = 0;
        let mut seen = fleet_io::lock(&self.dead_letter_ids);
        for id in ids {
            seen.insert((queue.to_string(), id.to_string()));
            n += 1;
        }
        drop(seen);
        self.trace(format!("DEAD LETTERS {n} received from {queue}"));
        *fleet_io::lock(&self.dead_letters).entry(queue.to_string()).or_default() += n;
    }

    /// Controller `ctl` (its process `life`, its `faults`) got an answer from a receive on a results
    /// partition's queue now: see [`observe::Readers`].
    pub fn read(&self, queue: &str, ctl: usize, life: &faults::Life, faults: &Arc<Mutex<Faults>>) {
        // A paused process's receive is answered when its pause ends (what SQS gave it meanwhile):
        // its reads count from a receive's wait after the pause.
        let paused = |f: &Arc<Mutex<Faults>>| fleet_io::lock(f).last_pause_end.is_some_and(|t| t + READ_WINDOW > Instant::now());
        let answer = observe::Answer { queue, ctl, life, faults, now: Instant::now(), run_time: self.now() };
        fleet_io::lock(&self.readers).read(answer, paused);
        // A partition a round told this controller to stop reading stops at once: no answer from it
        // a receive's wait later (unless the process was paused since, or started reading it again).
        let partition = queue.trim_end_matches("-dlq").rsplit_once('-').and_then(|(_, p)| p.parse::<u16>().ok()).unwrap_or(0);
        let Some(owner) = fleet_io::lock(&self.names).get(&ctl).cloned() else { return };
        let told = fleet_io::lock(&self.stops.0).get(&(owner.clone(), partition)).copied();
        if let Some(at) = told {
            let since = Instant::now().saturating_duration_since(at);
            let paused_since = fleet_io::lock(faults).last_pause_end.is_some_and(|t| t > at);
            if since > READ_WINDOW && !paused_since {
                let mut late = fleet_io::lock(&self.late_reads);
                if late.len() < 3 {
                    late.push(format!(
                        "ctl{ctl} ({owner}) read {queue} {:.1} s after a balancing round told it to stop (at {:.1} s)",
                        since.as_secs_f64(),
                        (self.now() - since).as_secs_f64()
                    ));
                }
            }
        }
    }

    /// Controller `ctl` holds the message of `receipt` through an outage (`true`: made invisible for
    /// the hold's time), or no longer does (handed back, deleted).
    pub fn holding(&self, ctl: usize, receipt: &str, held: bool) {
        let mut h = fleet_io::lock(&self.held);
        let key = (ctl, receipt.to_string());
        // An extension sent after its message was deleted changes nothing (SQS refuses it).
        if held && fleet_io::lock(&self.deleted).contains(receipt) {
            return;
        }
        if held {
            h.insert(key, Instant::now() + controller::aggregate::hold::HOLD_VISIBILITY);
        } else {
            h.remove(&key);
        }
    }

    /// Controller `ctl` deleted the message of `receipt`: it holds it no more, whatever follows.
    pub fn deleted(&self, ctl: usize, receipt: &str) {
        fleet_io::lock(&self.deleted).insert(receipt.to_string());
        self.holding(ctl, receipt, false);
    }

    /// A new process of controller `ctl` holds nothing (its last one's holds ended with it: their
    /// messages come back after the hold's time, as they do when a process dies).
    fn forget_held(&self, ctl: usize) {
        fleet_io::lock(&self.held).retain(|(c, _), _| *c != ctl);
    }

    /// The messages controller `ctl` still holds (at the end of its graceful stop: none may be left
    /// invisible for the hold's time while the partition's next owner waits).
    fn still_held(&self, ctl: usize) -> Vec<String> {
        let now = Instant::now();
        fleet_io::lock(&self.held).iter().filter(|((c, _), until)| *c == ctl && **until > now).map(|((_, r), _)| r.clone()).collect()
    }

    /// `owner` wrote `job`'s lease or checkpoint.
    pub fn wrote(&self, job: &str, owner: &str) {
        fleet_io::lock(&self.writers).entry(job.to_string()).or_default().insert(owner.to_string());
    }

    /// The fleet sent a message of `job` now.
    pub fn sent(&self, job: &str) {
        fleet_io::lock(&self.last_sent).insert(job.to_string(), self.now());
    }

    /// A processor that stalled with a work item in hand (any job's) sends its result now: the work
    /// queue held that item in flight until now.
    pub fn work_held(&self) {
        let now = self.now();
        fleet_io::lock(&self.work_held_until).push(now);
    }

    /// A result of `job` moved to a dead-letter queue: whether no controller had written the job's
    /// lease or checkpoint by then (none waits for it, so none looks for it; see `check::lateness`).
    pub fn dead_lettered(&self, job: &str) {
        if !fleet_io::lock(&self.writers).contains_key(job) {
            fleet_io::lock(&self.unheard_dead_letters).insert(job.to_string());
        }
    }

    /// A fault's effects last until `until` (simulated time from the start).
    /// Records that `owner`'s store calls were in trouble from `from` to `to` (see `store_trouble`).
    pub(crate) fn trouble(&self, owner: &str, from: Instant, to: Instant, hard: bool) {
        fleet_io::lock(&self.store_trouble).entry(owner.to_string()).or_default().push((from, to, hard));
    }

    fn fault_until(&self, until: Duration) {
        let mut end = fleet_io::lock(&self.faults_end);
        *end = (*end).max(until);
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
    pub setup: Setup,
    pub jobs: Vec<String>,
    /// Broken invariants (empty: the run passed).
    pub violations: Vec<String>,
    /// Faults injected, in order.
    pub schedule: Vec<String>,
    /// Hash of the whole trace.
    pub trace_hash: u64,
    pub trace_len: usize,
    /// Simulated seconds until the fleet settled.
    pub simulated_secs: f64,
    /// The longest a report came after its job's last message (and the last fault), seconds, beyond
    /// what the job's kind waits by design (settle, stall, abandon).
    pub lateness_secs: f64,
    /// The most bytes one inflated result payload held.
    pub most_inflated: u64,
    /// The longest two live controllers read one results partition at once, seconds.
    pub longest_co_read: f64,
    /// Graceful stops that left messages held (invisible for the hold's time): each a violation.
    pub left_held: usize,
}

impl Run {
    /// What a failing run says: how to rerun it, its setup and fault schedule, its broken invariants.
    pub fn failure(&self) -> String {
        let s = &self.setup;
        let mut out = format!(
            "seed {} FAILED ({} controllers, {} partitions, {}{}): rerun alone with `cargo run --release -p fleet-sim -- --seed {} --trace`\n",
            self.seed,
            s.controllers,
            s.partitions,
            if s.defaults { "shipped defaults".to_string() } else { format!("lease {} s, settle {} s", s.settings.lease_secs, s.settings.settle_secs) },
            if s.calm { ", calm" } else { "" },
            self.seed
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
    /// Trace every queue call, as printing the trace does (a replay compares them all).
    pub every_call: bool,
    /// Send no hostile results.
    pub no_hostile: bool,
    /// Put work-detected triggers on an in-memory bus in half the runs (`fleet-sim` does unless
    /// `--no-triggers`).
    pub triggers: bool,
}

/// The fleet's queues (in memory, shared by everyone).
pub struct Queues {
    pub work: Arc<MemoryQueue>,
    pub work_dlq: Arc<MemoryQueue>,
    /// Each partition's results queue and its dead-letter queue.
    pub results: Vec<(Arc<MemoryQueue>, Arc<MemoryQueue>)>,
    /// The work-detected triggers' bus, in runs with triggers.
    pub bus: Option<Arc<MemoryTriggers>>,
}

impl Queues {
    fn new(fifo: bool, partitions: u16, triggers: bool, results_visibility: Duration) -> Queues {
        let (work, work_dlq) = if fifo { ("billing-work.fifo", "billing-work-dlq.fifo") } else { ("billing-work", "billing-work-dlq") };
        let work_dlq = MemoryQueue::new(work_dlq, VISIBILITY);
        let results = (0..partitions)
            .map(|p| {
                let name = if p == 0 { "billing-results".to_string() } else { format!("billing-results-{p}") };
                let dlq = MemoryQueue::new(&format!("{name}-dlq"), results_visibility);
                (MemoryQueue::with_dlq(&name, results_visibility, MAX_RECEIVES, dlq.clone()), dlq)
            })
            .collect();
        Queues { work: MemoryQueue::with_dlq(work, VISIBILITY, MAX_RECEIVES, work_dlq.clone()), work_dlq, results, bus: triggers.then(MemoryTriggers::new) }
    }

    /// Each partition's results queue, by number.
    pub fn partitions(&self) -> Vec<Arc<dyn Queue>> {
        self.results.iter().map(|(q, _)| q.clone() as Arc<dyn Queue>).collect()
    }

    /// How much longer the message received with `receipt` stays invisible, when the receipt is its
    /// message's latest (see [`MemoryQueue::hidden_for`]).
    pub fn hidden_for(&self, receipt: &str) -> Option<Duration> {
        let mut all = vec![&self.work, &self.work_dlq];
        all.extend(self.results.iter().flat_map(|(q, d)| [q, d]));
        all.into_iter().find(|q| receipt.strip_prefix(q.name()).is_some_and(|r| r.starts_with(':')))?.hidden_for(receipt)
    }

    pub fn all(&self) -> Vec<Arc<dyn Queue>> {
        let mut all: Vec<Arc<dyn Queue>> = vec![self.work.clone(), self.work_dlq.clone()];
        for (q, d) in &self.results {
            all.push(q.clone());
            all.push(d.clone());
        }
        all
    }
}

/// One running controller process.
struct Ctl {
    owner: String,
    stop: CancellationToken,
    task: JoinHandle<fleet_io::Result<()>>,
    probe: JoinHandle<()>,
    life: Life,
}

impl Ctl {
    /// The process is gone: nothing it had under way goes out any more.
    fn crash(self) {
        self.life.end();
        self.probe.abort();
        // Its stop, for its tasks to wind down (every call it makes hangs for ever: nothing leaves).
        self.stop.cancel();
    }
}

/// Starts controller `idx` as the service does (`controller::run_with_clock`), through its own faulty
/// ways to the store and the queues, on its own skewed clock.
fn start_controller(seed: u64, idx: usize, slot: &Slot, setup: &Setup, world: &Arc<World>, store: &Arc<MemoryStore>, queues: &Queues) -> Ctl {
    let bus = queues.bus.as_ref();
    let (owner, skew_ms, faults) = (slot.owner.as_str(), slot.skew_ms, &slot.faults);
    world.forget_held(idx);
    fleet_io::lock(&world.names).insert(idx, owner.to_string());
    let life = Life::default();
    let way = |q: Arc<MemoryQueue>| FaultyQueue::wrap(q, idx, faults.clone(), life.clone(), world.clone());
    let results = Sharded::of(queues.results.iter().map(|(q, _)| way(q.clone())).collect()).expect("at least one partition");
    let results_dlq = Sharded::of(queues.results.iter().map(|(_, d)| way(d.clone())).collect()).expect("at least one partition");
    let faulty = FaultyStore::new(store.clone(), idx, owner, faults.clone(), life.clone(), world.clone(), slot.upgrade_at.is_some());
    fleet_io::lock(&world.lives).push((owner.to_string(), life.clone()));
    let deps = controller::Deps {
        results,
        work_dlq: way(queues.work_dlq.clone()),
        results_dlq,
        store: faulty.clone(),
        work: Some(way(queues.work.clone())),
        triggers: bus.map(|b| b.subscription()),
        publish: bus.map(|b| b.clone() as Arc<dyn fleet_io::trigger::TriggerBus>),
    };
    let mut settings = setup.settings.clone();
    settings.id = Some(owner.to_string());
    if let Some((_, secs)) = setup.odd_lease.filter(|(i, _)| *i == idx) {
        settings.lease_secs = secs;
    }
    // Wall time is the run's (a restarted controller's clock does not start again at the epoch).
    let clock = Clock::driven((EPOCH_MS + world.now().as_millis() as u64).saturating_add_signed(skew_ms));
    let stop = CancellationToken::new();
    let task = tokio::spawn(controller::run_with_clock(settings, deps, clock, stop.clone()));
    // The breaker's probe, with the seed's jitter: asks the store while the breaker is open.
    let breaker = faulty.breaker().expect("the simulated store has a breaker");
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((idx as u64) << 8) ^ 0x9e0b);
    let probe = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(rng.random_range(500..10_000))).await;
            if breaker.is_open() {
                // A cheap question, its answer reported to the breaker as every call's is.
                let _ = faulty.head("probe").await;
            }
        }
    });
    Ctl { owner: owner.to_string(), stop, task, probe, life }
}

/// Runs one seed to the end and checks it.
pub fn run_seed(seed: u64, opts: Options) -> Run {
    run_seed_undone(seed, opts, None)
}

/// Runs one seed with one fix of the controller undone (`controller::undo`), on this thread.
pub fn run_seed_undone(seed: u64, opts: Options, undo: Option<Fix>) -> Run {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::Layer as _;
    controller::undo::set(undo);
    // Every random wait of the fleet's code (back-off and breaker jitter) drawn from the seed too.
    fleet_io::jitter::seed_this_thread(seed ^ 0x7177_e500);
    // The controllers' conclusions, heard on this thread (and, with RUST_LOG, their logs printed).
    let heard = observe::Heard::default();
    let memory = observe::Memory::default();
    let log = std::env::var_os("RUST_LOG")
        .is_some()
        .then(|| tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(tracing_subscriber::EnvFilter::from_default_env()));
    let stops = observe::Stops::default();
    let measured = tracing_subscriber::filter::Targets::new().with_target(controller::aggregate::MEMORY_TARGET, tracing::Level::DEBUG);
    let partition_events = tracing_subscriber::filter::Targets::new().with_target(controller::events::PARTITIONS_TARGET, tracing::Level::INFO);
    let subscriber = tracing_subscriber::registry()
        .with(heard.clone().with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .with(memory.clone().with_filter(measured))
        .with(stops.clone().with_filter(partition_events))
        .with(log);
    let _guard = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("a runtime");
    let run = rt.block_on(simulate(seed, opts, heard, memory, stops));
    drop(rt);
    controller::undo::set(None);
    run
}

/// What a soak of many seeds found.
#[derive(Debug, Default)]
pub struct Soak {
    pub ran: u64,
    pub failed: Vec<u64>,
    pub simulated_secs: f64,
    /// Seeds at the shipped defaults, and calm ones.
    pub defaults: u64,
    pub calm: u64,
    pub worst_lateness: f64,
    /// The most bytes one inflated result payload held, over every run.
    pub most_inflated: u64,
    /// The longest two live controllers read one results partition at once, over every run.
    pub longest_co_read: f64,
    /// Runs with a graceful stop that left messages held.
    pub left_held: u64,
}

/// Runs seeds `from..from + n` on `threads` threads (each seed on one, under its own runtime),
/// calling `each` with every run as it ends (with the runs and failures so far); with `fail_fast`
/// no seed after the first failing one is started.
pub fn soak(from: u64, n: u64, threads: usize, opts: Options, undo: Option<Fix>, fail_fast: bool, mut each: impl FnMut(&Run, u64, usize)) -> Soak {
    use std::sync::atomic::{AtomicU64, Ordering};
    let next = AtomicU64::new(from);
    let stop_after = AtomicU64::new(u64::MAX);
    let (tx, rx) = std::sync::mpsc::channel::<Run>();
    let mut soak = Soak::default();
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            let tx = tx.clone();
            let (next, stop_after) = (&next, &stop_after);
            scope.spawn(move || loop {
                let seed = next.fetch_add(1, Ordering::SeqCst);
                if seed >= from + n || seed > stop_after.load(Ordering::SeqCst) {
                    return;
                }
                let run = run_seed_undone(seed, opts, undo);
                if fail_fast && !run.violations.is_empty() {
                    stop_after.fetch_min(seed, Ordering::SeqCst);
                }
                if tx.send(run).is_err() {
                    return;
                }
            });
        }
        drop(tx);
        for run in rx {
            soak.ran += 1;
            soak.simulated_secs += run.simulated_secs;
            soak.defaults += u64::from(run.setup.defaults);
            soak.calm += u64::from(run.setup.calm);
            soak.worst_lateness = soak.worst_lateness.max(run.lateness_secs);
            soak.most_inflated = soak.most_inflated.max(run.most_inflated);
            soak.longest_co_read = soak.longest_co_read.max(run.longest_co_read);
            soak.left_held += u64::from(run.left_held > 0);
            if !run.violations.is_empty() {
                soak.failed.push(run.seed);
            }
            each(&run, soak.ran, soak.failed.len());
        }
    });
    soak.failed.sort_unstable();
    soak
}

/// The first failing seed of `from..from + n` with `undo` undone: how many seeds it took (counted
/// from `from`) and its run; `None` when every seed passed.
pub fn first_failure(from: u64, n: u64, threads: usize, opts: Options, undo: Option<Fix>) -> Option<(u64, Run)> {
    let mut first: Option<Run> = None;
    soak(from, n, threads, opts, undo, true, |run, _, _| {
        if !run.violations.is_empty() && first.as_ref().is_none_or(|f| run.seed < f.seed) {
            first = Some(Run { violations: run.violations.clone(), schedule: Vec::new(), jobs: Vec::new(), setup: run.setup.clone(), ..*run });
        }
    });
    first.map(|r| (r.seed - from + 1, r))
}

/// A controller slot: its process (when running), its faults, its clock's skew, its name.
struct Slot {
    ctl: Option<Ctl>,
    faults: Arc<Mutex<Faults>>,
    skew_ms: i64,
    owner: String,
    generation: u32,
    /// Started again at this time (after a crash, a stop or an exit).
    restart_at: Option<Instant>,
    /// How long it stays down after a crash in the middle of a batch.
    mid_batch_down: Duration,
    /// Its process runs the release before partitions (`Setup::upgrade`) until it is upgraded then
    /// (stopped gracefully and started again as this release); its next life is this release anyway.
    upgrade_at: Option<Duration>,
}

impl Slot {
    /// Its process is gone (if running) and starts again `down` from now.
    fn crash(&mut self, down: Duration, world: &World, lease: Duration) {
        if let Some(c) = self.ctl.take() {
            c.crash();
        }
        self.upgrade_at = None;
        self.restart_at = Some(Instant::now() + down);
        world.fault_until(Instant::now() - world.start + down + lease * 2);
    }
}

async fn simulate(seed: u64, opts: Options, heard: observe::Heard, memory: observe::Memory, stops: observe::Stops) -> Run {
    let setup = Setup::draw(seed, opts);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let world = Arc::new(World {
        start: Instant::now(),
        trace: Mutex::default(),
        outage: Mutex::default(),
        reports: Mutex::default(),
        handled: Mutex::default(),
        dead_letters: Mutex::default(),
        dead_letter_ids: Mutex::default(),
        last_sent: Mutex::default(),
        faults_end: Mutex::default(),
        work_held_until: Mutex::default(),
        readers: Mutex::default(),
        writers: Mutex::default(),
        unheard_dead_letters: Mutex::default(),
        report_pauses: Mutex::default(),
        held: Mutex::default(),
        deleted: Mutex::default(),
        stops,
        names: Mutex::default(),
        late_reads: Mutex::default(),
        takeovers: Mutex::new(observe::Takeovers::new(Duration::from_secs(setup.settings.lease_secs))),
        store_trouble: Mutex::default(),
        lives: Mutex::default(),
        echo: opts.echo,
        every_call: opts.echo || opts.every_call,
    });
    let store = MemoryStore::new();
    let queues = Arc::new(Queues::new(setup.fifo, setup.partitions, setup.triggers, setup.results_visibility));
    let lease = setup.lease();
    let hostile = !opts.no_hostile && !setup.calm;
    let jobs: Vec<Arc<JobPlan>> = fleet::plan(&mut rng, seed, hostile, true, &setup).into_iter().map(Arc::new).collect();
    world.trace(format!(
        "CHAOS setup: {} controllers, {} partitions, {}, lease {} s, settle {} s, abandon {} s, stall {} s, retention {} s{}, work queue {}, results visibility {} s{}{}{}{}{}, jobs: {}",
        setup.controllers,
        setup.partitions,
        if setup.defaults { "shipped defaults" } else { "drawn settings" },
        setup.settings.lease_secs,
        setup.settings.settle_secs,
        setup.settings.abandon_after,
        setup.settings.stall_after,
        setup.settings.blob_retention_secs,
        if setup.calm { ", calm" } else { "" },
        queues.work.name(),
        setup.results_visibility.as_secs(),
        if setup.triggers { ", triggers" } else { "" },
        match (setup.upgrade, setup.quiet) {
            (true, true) => ", quiet upgrade",
            (true, false) => ", upgrade",
            _ => "",
        },
        if setup.agent_down { ", agent down" } else { "" },
        if setup.buggify { ", buggified" } else { "" },
        setup.odd_lease.map(|(i, secs)| format!(", ctl{i} misconfigured with a {secs} s lease")).unwrap_or_default(),
        jobs.iter()
            .map(|j| {
                let groups = j.groups.map(|g| format!(" {g:?}")).unwrap_or_default();
                let chunks = j.chunks.iter().map(|c| format!("{:?}", c.fate)).collect::<Vec<_>>().join(" ");
                format!("{} p{} {}{groups} {:?} [{chunks}]", j.id, j.partition, j.shape, j.ending)
            })
            .collect::<Vec<_>>()
            .join("; ")
    ));
    // The fleet around the controllers, the real initiator and processors: their calls fail only as
    // their chunks' fates say (the controllers' fail at their own rates).
    let plain: Arc<dyn BlobStore> = store.clone();
    let by_id: Arc<BTreeMap<String, Arc<JobPlan>>> = Arc::new(jobs.iter().map(|j| (j.id.clone(), j.clone())).collect());
    let fated = fleet::Fated::new(by_id, world.clone(), ChaCha8Rng::seed_from_u64(seed ^ 0xfeed_0000), fleet::Keys::of(seed));
    let bus = queues.bus.clone();
    let mut fleet_tasks = Vec::new();
    for j in &jobs {
        fleet_tasks.push(tokio::spawn(fleet::initiate(
            j.clone(),
            world.clone(),
            fated.clone(),
            queues.work.clone(),
            queues.partitions(),
            plain.clone(),
            bus.clone(),
        )));
    }
    // With triggers, the scaling agent's watch too (the real agent, scaling nothing): it announces a
    // queue that turns non-empty with nobody announcing it (a work item back after a lost delete, a
    // dead letter moved by SQS), which parked listeners would otherwise see only at their hourly poll.
    if let (Some(bus), false) = (&queues.bus, setup.agent_down) {
        let sharded = |qs: Vec<Arc<MemoryQueue>>| Sharded::of(qs.into_iter().map(|q| q as Arc<dyn Queue>).collect()).expect("at least one partition");
        let watched = scaling_agent::Watched {
            work: queues.work.clone(),
            work_dlq: queues.work_dlq.clone(),
            results: sharded(queues.results.iter().map(|(q, _)| q.clone()).collect()),
            results_dlq: sharded(queues.results.iter().map(|(_, d)| d.clone()).collect()),
        };
        let deps = scaling_agent::Deps {
            watched,
            publish: Some(bus.clone() as Arc<dyn fleet_io::trigger::TriggerBus>),
            subscription: Some(bus.subscription()),
            backend: Arc::new(scaling_agent::backend::NoneBackend::new(2)),
        };
        fleet_tasks.push(tokio::spawn(async move {
            let _ = scaling_agent::run(scaling_agent::Settings::DEFAULT, deps, CancellationToken::new()).await;
        }));
    }
    for n in 0..2u64 {
        fleet::start_processor(n, fated.clone(), &queues, plain.clone(), setup.agent_down.then_some(30)).await;
    }
    // The controllers, each with its own faults and clock.
    let max_skew = (lease.as_millis() * 3) as i64;
    let mut slots: Vec<Slot> = Vec::new();
    let new_slot = |rng: &mut ChaCha8Rng, i: usize, world: &World| {
        let rates = if setup.calm || setup.quiet {
            Rates { sqs_latency_ms: 150, ..Rates::default() }
        } else {
            Rates {
                fail: [0.0, 0.01, 0.05][rng.random_range(0..3)],
                hang: [0.0, 0.005, 0.02][rng.random_range(0..3)],
                lost: [0.0, 0.01, 0.03][rng.random_range(0..3)],
                sqs_fail: [0.0, 0.01, 0.05][rng.random_range(0..3)],
                sqs_latency_ms: [20, 150, 1_000][rng.random_range(0..3)],
                list_fail: [0.0, 0.0, 0.3, 0.6][ChaCha8Rng::seed_from_u64(seed ^ 0x1157 ^ i as u64).random_range(0..4)],
            }
        };
        let skew_ms = rng.random_range(-max_skew..=max_skew);
        // In half the runs with faults, its reads of checkpoint parts are slow (drawn apart).
        let slow_parts = (!setup.calm && !setup.quiet && ChaCha8Rng::seed_from_u64(seed ^ 0x5103 ^ i as u64).random_bool(0.5)).then(|| Duration::from_secs(20));
        world.trace(format!("CHAOS ctl{i} faults {rates:?}, clock skew {skew_ms} ms"));
        Slot {
            ctl: None,
            faults: Arc::new(Mutex::new({
                let mut f = Faults::new(seed.wrapping_mul(31).wrapping_add(i as u64), rates);
                f.slow_parts = slow_parts;
                // In half the runs with faults, its listings fail for a while after each gain
                // (drawn apart).
                f.list_burst = !setup.calm && !setup.quiet && ChaCha8Rng::seed_from_u64(seed ^ 0x11B5 ^ i as u64).random_bool(0.5);
                f
            })),
            skew_ms,
            owner: format!("ctl{i}"),
            generation: 0,
            restart_at: Some(Instant::now()),
            mid_batch_down: Duration::ZERO,
            // Drawn apart, so that the rest of the schedule stays as it was.
            upgrade_at: (setup.upgrade && i < setup.controllers)
                .then(|| Duration::from_millis(ChaCha8Rng::seed_from_u64(seed ^ 0x0b50 ^ i as u64).random_range(1_000..CHAOS.as_millis() as u64))),
        }
    };
    for i in 0..setup.controllers {
        slots.push(new_slot(&mut rng, i, &world));
    }
    // The chaos schedule, then calm until every job has ended.
    let mut next = Duration::from_millis(rng.random_range(1_000..20_000));
    let mut calm = setup.calm;
    let horizon = setup.horizon();
    loop {
        let now = Instant::now();
        let elapsed = now - world.start;
        for (i, slot) in slots.iter_mut().enumerate() {
            // A process that exited by itself (an error at start) is started again, as its supervisor does.
            if slot.ctl.as_ref().is_some_and(|c| c.task.is_finished()) {
                let c = slot.ctl.take().expect("checked");
                let why = match c.task.await {
                    Ok(Ok(())) => "stopped".to_string(),
                    Ok(Err(e)) => format!("failed: {e}"),
                    Err(e) => format!("panicked: {e}"),
                };
                c.life.end();
                c.probe.abort();
                world.trace(format!("CHAOS ctl{i} exited ({why}); restarted in 5 s"));
                if why.starts_with("panicked") {
                    world.trace(format!("PANIC ctl{i}: {why}"));
                }
                slot.restart_at = Some(now + Duration::from_secs(5));
                slot.upgrade_at = None;
                world.fault_until(elapsed + Duration::from_secs(5) + lease);
            }
            // A process that crashed in the middle of a batch (`Faults::crash_mid_batch`).
            if slot.ctl.as_ref().is_some_and(|c| c.life.ended()) {
                let down = slot.mid_batch_down;
                world.trace(format!("CHAOS ctl{i} back in {:.1} s as {}", down.as_secs_f64(), slot.owner));
                slot.crash(down, &world, lease);
            }
            // A rolling upgrade's step: the previous release stops gracefully and exits (started
            // again as this release, above).
            if slot.upgrade_at.is_some_and(|t| t <= elapsed) && slot.ctl.as_ref().is_some_and(|c| !c.stop.is_cancelled()) {
                world.trace(format!("CHAOS ctl{i} is upgraded: stopped, to start again as this release"));
                slot.ctl.as_ref().expect("checked").stop.cancel();
                world.fault_until(elapsed + Duration::from_secs(setup.settings.drain_secs + 5) + lease * 2);
            }
            if slot.restart_at.is_some_and(|t| t <= now) {
                slot.restart_at = None;
                let release = if slot.upgrade_at.is_some() { " (the release before partitions)" } else { "" };
                world.trace(format!("CHAOS ctl{i} starts as {}{release}", slot.owner));
                let s = seed ^ ((elapsed.as_millis() as u64) << 20) ^ i as u64;
                slot.ctl = Some(start_controller(s, i, slot, &setup, &world, &store, &queues));
            }
        }
        if !calm && elapsed >= CHAOS {
            calm = true;
            world.trace("CHAOS ends: no more faults".into());
            for s in &slots {
                let mut f = fleet_io::lock(&s.faults);
                f.rates = Rates { sqs_latency_ms: 150, ..Rates::default() };
                f.paused_until = None;
                f.crash_mid_batch = false;
                f.pause_at_report = None;
                f.slow_parts = None;
                f.list_burst = false;
            }
        }
        if !calm && !setup.quiet && elapsed >= next {
            next = elapsed + Duration::from_millis(rng.random_range(2_000..60_000));
            let i = rng.random_range(0..slots.len());
            match rng.random_range(0..13) {
                0..3 if slots[i].ctl.is_some() => {
                    let down = Duration::from_millis(rng.random_range(100..60_000));
                    let slot = &mut slots[i];
                    if rng.random_bool(0.5) {
                        slot.generation += 1;
                        slot.owner = format!("ctl{i}-{}", slot.generation);
                    }
                    // Half the crashes come in the middle of a batch (drawn apart, so that the rest
                    // of the schedule stays as it was).
                    if ChaCha8Rng::seed_from_u64(seed ^ 0xC4A5_4C4A ^ elapsed.as_millis() as u64).random_bool(0.5) {
                        world.trace(format!("CHAOS ctl{i} will crash with its next batch"));
                        slot.mid_batch_down = down;
                        fleet_io::lock(&slot.faults).crash_mid_batch = true;
                    } else {
                        world.trace(format!("CHAOS ctl{i} crashes; back in {:.1} s as {}", down.as_secs_f64(), slot.owner));
                        slot.crash(down, &world, lease);
                    }
                }
                3..5 => {
                    let d = Duration::from_millis(rng.random_range(500..(lease.as_millis() as u64 * 3)));
                    let mut f = fleet_io::lock(&slots[i].faults);
                    // Half the pauses come as the controller next writes a report, past a lease
                    // (drawn apart, so that the rest of the schedule stays as it was).
                    if ChaCha8Rng::seed_from_u64(seed ^ 0x9A05_E9A0 ^ elapsed.as_millis() as u64).random_bool(0.5) {
                        let d = d.max(lease + Duration::from_secs(1));
                        world.trace(format!(
                            "CHAOS ctl{i} will pause for {:.1} s as it next writes a report (lease {:.1} s)",
                            d.as_secs_f64(),
                            lease.as_secs_f64()
                        ));
                        // Half of those last until a peer loads the job and reads its checkpoint parts
                        // (at most a settle time and three leases): the peer's read hangs while the
                        // resumed one finishes the job under it (drawn apart, like the rest).
                        let until_read = ChaCha8Rng::seed_from_u64(seed ^ 0x7EAD_7EAD ^ elapsed.as_millis() as u64).random_bool(0.5);
                        let d = if until_read { d.max(Duration::from_secs(setup.settings.settle_secs) + lease * 3) } else { d };
                        if until_read {
                            world.trace(format!("CHAOS ctl{i}'s pause at its next report lasts until a peer reads the job's checkpoint parts"));
                        }
                        f.pause_at_report = Some((d, lease * 2, until_read));
                    } else {
                        world.trace(format!("CHAOS ctl{i} paused for {:.1} s (lease {:.1} s)", d.as_secs_f64(), lease.as_secs_f64()));
                        f.paused_until = Some(Instant::now() + d);
                        f.last_pause_end = f.paused_until;
                        if let Some(owner) = fleet_io::lock(&world.names).get(&i).cloned() {
                            world.trouble(&owner, Instant::now(), Instant::now() + d, true);
                        }
                        world.fault_until(elapsed + d + lease * 2);
                    }
                }
                5 => {
                    let d = Duration::from_millis(rng.random_range(1_000..120_000));
                    world.trace(format!("CHAOS S3 out for {:.1} s", d.as_secs_f64()));
                    *fleet_io::lock(&world.outage) = Some(Instant::now() + d);
                    world.fault_until(elapsed + d + lease * 2);
                }
                6 => {
                    let d = Duration::from_millis(rng.random_range(1_000..900_000));
                    world.trace(format!("CHAOS ctl{i} cut off from S3 for {:.1} s", d.as_secs_f64()));
                    fleet_io::lock(&slots[i].faults).cut_off_until = Some(Instant::now() + d);
                    world.fault_until(elapsed + d + lease * 2);
                }
                7..9 if slots[i].ctl.is_some() => {
                    // A graceful stop (SIGTERM: a rolling update, a scale-in): it hands its partitions
                    // and leases back, then the slot is empty for a while (the others rebalance).
                    let down = Duration::from_millis(rng.random_range(1_000..180_000));
                    world.trace(format!("CHAOS ctl{i} stops gracefully; back in {:.1} s", down.as_secs_f64()));
                    let c = slots[i].ctl.take().expect("checked");
                    c.stop.cancel();
                    let drain = Duration::from_secs(setup.settings.drain_secs) + Duration::from_secs(5);
                    let stopped = tokio::time::timeout(drain, c.task).await;
                    // A crash armed for its next batch may strike during the stop (a long poll under
                    // way still answers): a process that crashed is judged as one, not as a stop.
                    let crashed = c.life.ended();
                    // The stop took as long as the controller's own (unseeded) scheduling made it: the
                    // schedule goes on from the loop's half-second grid, so that what follows replays.
                    let took = Instant::now().saturating_duration_since(now).as_millis();
                    tokio::time::sleep_until(now + Duration::from_millis(500 * took.div_ceil(500) as u64)).await;
                    c.life.end();
                    c.probe.abort();
                    // What a stop left invisible for longer than a visibility timeout (a receipt SQS
                    // no longer takes holds nothing); a process paused through its stop (SIGTERM
                    // waits for SIGCONT) did nothing and is not judged.
                    let paused = fleet_io::lock(&slots[i].faults).last_pause_end.is_some_and(|t| t > now);
                    let held: Vec<String> = world
                        .still_held(i)
                        .into_iter()
                        .filter(|r| queues.hidden_for(r).is_some_and(|d| d > setup.results_visibility.max(VISIBILITY)))
                        .collect();
                    if paused && !held.is_empty() {
                        world.trace(format!("CHAOS ctl{i} was paused during its stop, which left {} messages held", held.len()));
                    } else if crashed && !held.is_empty() {
                        world.trace(format!("CHAOS ctl{i} crashed during its stop, which left {} messages held", held.len()));
                    } else if !held.is_empty() {
                        world.trace(format!("LEFT HELD ctl{i} stopped gracefully holding {} messages, invisible for the hold's time: {held:?}", held.len()));
                    }
                    match stopped {
                        Ok(Ok(Ok(()))) => world.trace(format!("CHAOS ctl{i} ({}) stopped", c.owner)),
                        Ok(Ok(Err(e))) => world.trace(format!("CHAOS ctl{i} ({}) stopped with an error: {e}", c.owner)),
                        Ok(Err(e)) => world.trace(format!("PANIC ctl{i} ({}) in its stop: {e}", c.owner)),
                        Err(_) => world.trace(format!("CHAOS ctl{i} ({}) did not stop within its drain time", c.owner)),
                    }
                    slots[i].restart_at = Some(Instant::now() + down);
                    slots[i].upgrade_at = None;
                    world.fault_until(elapsed + down + lease * 2);
                }
                9 if slots.len() < MAX_CONTROLLERS => {
                    let n = slots.len();
                    world.trace(format!("CHAOS ctl{n} joins"));
                    let slot = new_slot(&mut rng, n, &world);
                    slots.push(slot);
                    world.fault_until(elapsed + lease * 2);
                }
                _ => {}
            }
        }
        let restarting = slots.iter().any(|s| s.restart_at.is_some());
        if calm && !restarting && elapsed >= CHAOS.min(Duration::from_secs(120)) && check::settled(&jobs, &store, &queues.all(), &setup).await {
            break;
        }
        if elapsed >= horizon {
            world.trace("the fleet did not settle before the horizon".into());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let simulated_secs = world.start.elapsed().as_secs_f64();
    if std::env::var_os("FLEET_SIM_KEYS").is_some() {
        eprintln!("KEYS {:?}", store.keys());
    }
    let mut violations = check::invariants(&jobs, &store, &queues.all(), &world, &setup).await;
    violations.extend(check::group_order(&jobs, &world));
    let lateness = check::lateness(&jobs, &world, &setup);
    violations.extend(lateness.1);
    violations.extend(check::early(&jobs, &world, &setup));
    if setup.calm {
        violations.extend(check::calm(&world));
    }
    violations
        .extend(fleet_io::lock(&world.trace).iter().filter(|l| l.contains("PANIC") || l.contains("WRONG QUEUE") || l.contains("LEFT HELD")).take(3).cloned());
    // A controller that concludes it was fenced on a job (its lease lost, its checkpoint written by
    // another) is wrong when nobody else ever wrote that job's lease or checkpoint (a write whose
    // answer was lost, met again when tried, taken for another's); with one controller under one
    // name, every such conclusion is wrong.
    let lone = slots.len() == 1 && slots[0].generation == 0;
    let writers = fleet_io::lock(&world.writers).clone();
    violations.extend(
        fleet_io::lock(&heard.0)
            .iter()
            .filter(|h| lone || observe::job_of(h).is_some_and(|j| writers.get(j).is_none_or(|w| w.len() < 2)))
            .take(3)
            .map(|h| format!("a controller concluded another owns a job that nobody else wrote: {h}")),
    );
    // One reader per partition: two live controllers read one only while a partition changes hands.
    // The new owner starts a lease after the last renewal it saw; the old one stops at its first
    // balancing round after its membership went stale, within half a lease, and a round waits out a
    // hung store call (its deadline) before it looks.
    let co_read = fleet_io::lock(&world.readers).longest();
    if let Some((d, what)) = &co_read {
        if *d > lease + CALL_DEADLINE + READ_WINDOW {
            violations.push(format!(
                "{what} for {:.0} s (more than a lease, a store call's deadline and a receive's wait: a controller read on without ownership)",
                d.as_secs_f64()
            ));
        }
    }
    violations.extend(fleet_io::lock(&world.late_reads).iter().cloned());
    violations.extend(fleet_io::lock(&world.takeovers).violations.iter().take(3).cloned());
    // A membership goes stale only while the store does not answer (a hung call, an outage, a
    // cut-off, a pause) or after rounds failing in a row: a failed round is tried again within a
    // twelfth of a lease, so one failed call never costs a controller its partitions (seed 1852: a
    // controller whose calls failed one in twenty lost partition 0 and asked it back every 20-30 s).
    let stale = fleet_io::lock(&world.stops.2).clone();
    let trouble = fleet_io::lock(&world.store_trouble).clone();
    for (owner, at) in stale {
        let from = at.checked_sub(lease * 2 / 3).unwrap_or(at);
        let seen: Vec<&Trouble> = trouble.get(&owner).map(|t| t.iter().filter(|(a, b, _)| *a <= at && *b >= from).collect()).unwrap_or_default();
        // (A process that crashed or stopped meanwhile: its rounds never ended, and it reads nothing.)
        let ended = fleet_io::lock(&world.lives).iter().any(|(o, l)| *o == owner && l.ended_at().is_some_and(|t| t <= at && t >= from));
        let hard = ended || seen.iter().any(|t| t.2);
        let soft = seen.iter().filter(|t| !t.2).count();
        if !hard && soft < 3 {
            violations.push(format!(
                "{owner}'s membership went stale at {:.1} s with {soft} failed call(s) on the ownership document and nothing hung (a failed round must be tried again before it goes stale)",
                (at - world.start).as_secs_f64()
            ));
            break;
        }
    }
    // Memory within the budget: no inflated payload held more than the share its decode reserved.
    violations.extend(
        fleet_io::lock(&memory.over)
            .iter()
            .take(3)
            .map(|(held, share)| format!("a result payload held {held} bytes inflated, over the {share} bytes its decode reserved of the budget")),
    );
    // And no decode reserved more than the whole budget (one whose bound is larger is refused, never
    // decoded alone past it: a bomb declaring a huge count for a chunk without a record).
    let (widest, budget) = (memory.widest.load(std::sync::atomic::Ordering::Relaxed), setup.settings.decode_budget_mib << 20);
    if widest > budget {
        violations.push(format!(
            "a result's decode could hold {widest} bytes, more than the whole decode budget of {budget} bytes: decoded alone past the budget, not refused"
        ));
    }
    for s in slots {
        if let Some(c) = s.ctl {
            c.crash();
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
        setup,
        jobs: jobs.iter().map(|j| j.id.clone()).collect(),
        violations,
        schedule: world.schedule(),
        trace_hash: hasher.digest(),
        trace_len: trace.len(),
        simulated_secs,
        lateness_secs: lateness.0,
        most_inflated: memory.most.load(std::sync::atomic::Ordering::Relaxed),
        left_held: trace.iter().filter(|l| l.contains("LEFT HELD")).count(),
        longest_co_read: co_read.map_or(0.0, |(d, _)| d.as_secs_f64()),
    }
}
