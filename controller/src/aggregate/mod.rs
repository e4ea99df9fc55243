//! Why one file: the aggregator's state is grouped by the lock that guards it, and what each lock
//! guards (and that no lock spans two jobs) can only be checked with every field in view; the rooms
//! that act on it are listed at the end of this header.
//!
//! Per-job aggregation, exactly once under at-least-once delivery. Batches are applied in memory; a
//! job's state (which chunks are accounted for, the running per-account totals, failed chunks, request
//! counts) is checkpointed to S3 by `flush`, and only the messages a checkpoint covers are handed back
//! for deletion. A chunk already accounted for is a duplicate however often it arrives. When a sealed
//! job has every chunk accounted for, its report is written at once.
//!
//! Nothing strands: results that reached the results dead-letter queue are applied like any other;
//! a result whose payload can never be read (missing or corrupt blob) counts its chunk as failed; an
//! unreadable message is quarantined in S3 and deleted; a job that never seals is finished as
//! `abandoned` after `abandon_after` without news (or at once on an `Abandon` message). Every job has an
//! `open/{job}` marker until it finishes: a controller scans them at start and every `abandon_after`,
//! remembering unsealed jobs by their checkpoint's time only (a HEAD request), so that one whose owner
//! died and whose messages never come back is still abandoned in time.
//!
//! Rooms: `job` (a job in memory: the core's state machine, `controller_core::job`, with this
//! controller's lease beside it; how a job ends and what a checkpoint commits, `controller_core::decision`;
//! a checkpoint planned, `controller_core::save`), `item` (what a message brings to a job, by `Source`:
//! parsed, its sender's role checked, its payload fetched), `limits` (sizes and periods), `records`,
//! `budget`, `take` (leases and loading), `checkpoint` (flushing, and writing what a job planned),
//! `finalize` (the report), `scan` (dormant jobs and expiry), `hold`, `quarantine`, `batch` (the path of one
//! batch); this file holds the aggregator, how it is set up (`Options`) and what it reports of itself.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_domain::model::JobStatus;
use fleet_domain::prices::Prices;
use fleet_engine::Kept;
use fleet_io::blob::BlobStore;
use fleet_io::error::Result;
use fleet_io::lock;
use tokio::time::Instant;

use crate::clock::Clock;
use crate::lease::{Leases, WeakLease};
use crate::sighting::Sightings;

mod batch;
pub mod budget;
mod checkpoint;
mod finalize;
pub mod hold;
mod item;
mod job;
mod limits;
mod quarantine;
pub mod records;
mod scan;
mod take;

use budget::Budget;
use hold::Hold;
pub use item::{Source, MEMORY_TARGET};
use job::Job;
pub use limits::{DEAD_LETTER_REASON, FLUSH_INTERVAL, FLUSH_MESSAGES, HAND_BACK, INLINE_ROWS, LEASE, MAX_RESULT_BYTES, SETTLE, UNRECORDED_RECEIVES};
use records::RecordsCache;
pub use scan::{Emptied, FleetQueues, Look, StallLimit, DEPTH_LAG};

/// What to do with the messages of a batch once applied (the rest wait in their jobs for a checkpoint).
#[derive(Debug, Default)]
pub struct Applied {
    /// Durably applied (or duplicates of finished jobs, or quarantined): delete.
    pub delete: Vec<Kept>,
    /// Messages of jobs another controller owns: hand them back to the queue for their owner, visible
    /// again after the time given.
    pub release: Vec<(Kept, Duration)>,
}

/// What taking a job's lease found.
enum Taken {
    /// Loaded, this controller's.
    Open(Box<Job>),
    /// Finished before (remembered; its lease given back).
    AlreadyFinished,
    /// Another controller holds it: its messages go back to the queue for this long.
    Busy(Duration),
}

/// One job's place in memory: `None` while it is not loaded (or was dropped after a failure). Each job
/// has its own lock, held across that job's S3 calls only, so jobs progress in parallel.
type Slot = Arc<tokio::sync::Mutex<Option<Job>>>;

/// Where finished jobs' purges are recorded.
enum Purging {
    /// No purger (tests, tools): a finished job's open marker goes at once.
    Nowhere,
    /// The purger, told each finished job and answering whether its purge is recorded.
    To(tokio::sync::mpsc::UnboundedSender<crate::purge::ToPurge>),
    /// Stopped: nothing is recorded any more, so open markers stay for the next controller's scan.
    Stopped,
}

/// How long a finish waits for its purge to be recorded (a marker's write, behind purges at once
/// under way) before it keeps the job's open marker for a later scan.
const PURGE_RECORDED_WITHIN: Duration = Duration::from_secs(90);

/// What checkpoints have written (logged when the controller stops; read by the benchmark).
#[derive(Debug, Default)]
pub struct CheckpointStats {
    /// Checkpoint objects written (documents and parts).
    pub writes: AtomicU64,
    /// Their compressed bytes.
    pub bytes: AtomicU64,
    /// Parts written holding every row of a job (bases).
    pub full_parts: AtomicU64,
    /// Parts written holding only the rows changed since the last checkpoint.
    pub delta_parts: AtomicU64,
}

impl CheckpointStats {
    fn wrote(&self, bytes: usize) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// The jobs in memory, under one lock (never held across an await): their slots, their leases (weak:
/// a job dropped takes its lease with it; renewed by the timer without the job's lock), and those
/// whose S3 calls just failed (store unreachable or hung), until when: their messages are left for
/// redelivery at once instead of each batch waiting out another call deadline.
#[derive(Default)]
struct InMemory {
    /// Ordered maps throughout: the order jobs are visited in is the same on every run (the
    /// simulation replays a seed exactly).
    slots: BTreeMap<String, Slot>,
    leases: BTreeMap<String, WeakLease>,
    failing: BTreeMap<String, Instant>,
    /// The results partition each job's messages came from (to let its jobs go with a partition).
    partition: BTreeMap<String, u16>,
}

/// Where jobs in memory wait for results (see [`Aggregator::waiting`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Waiting {
    /// The partitions their messages travel on.
    pub partitions: BTreeSet<u16>,
    /// A job whose partition is not known (its checkpoint came from the release before partitions).
    pub any: bool,
}

/// What this controller knows of jobs not in memory, under one lock.
#[derive(Default)]
struct Known {
    /// Finished before (to drop late duplicates without an S3 read).
    finished: controller_core::finished::FinishedJobs,
    /// Unsealed or sealed jobs known only by their open marker, with their last checkpoint's time:
    /// loaded when they are due to be finished, or when a message of theirs arrives.
    dormant: controller_core::expiry::DormantJobs,
}

/// The expiry's own clock, under one lock: when the open markers were last scanned; the idle floor
/// (no job's idle time counts from before it: the aggregator's start, so that a controller that was
/// down longer than `abandon_after` reads its queues before it abandons anything, or the end of the
/// last store outage, so that results held through it are applied first); how far the fleet's queues
/// have emptied (for the stall rule).
struct Expiry {
    scanned: Option<Instant>,
    idle_floor: Instant,
    emptied: scan::Emptied,
    /// Each open job's checkpoint time (Unix s, its writer's clock) as this controller saw it: a
    /// job's news is dated by when this controller first saw that time, never by comparing the
    /// writer's clock with its own (`sighting`). Kept to the jobs with open markers at each scan.
    seen: Sightings<String, i64>,
}

impl Expiry {
    /// When this controller first saw job `job` with checkpoint time `updated_unix` (now, on a first
    /// sight); with the `one-clock` fix undone, that time read on its own wall clock.
    fn news_at(&mut self, job: &str, updated_unix: i64, clock: &Clock) -> Instant {
        if crate::undo::is(crate::undo::Fix::OneClock) {
            return Clock::instant_ago(clock.since_unix(updated_unix));
        }
        let now = Instant::now();
        now.checked_sub(self.seen.age(&job.to_string(), updated_unix, now.into_std())).unwrap_or(now)
    }
}

/// The controller's in-memory view of the jobs it is aggregating. Shared by every listener: each job
/// is locked on its own, and no lock spans two jobs.
///
/// Its state is grouped by what each lock guards, and no lock is held across an await except a job's
/// own: the jobs in memory (`memory`), what is known of the others (`known`), the expiry's clock
/// (`expiry`), the messages held through an outage (`hold`), where finished jobs are announced
/// (`on_finished`), the partitions read (`read`), the jobs' records (`records`); `stopping` is set once,
/// and the counters (`pending`, `stats`) are atomics. The rest is set at construction ([`Options`]) and
/// never changes.
pub struct Aggregator {
    store: Arc<dyn BlobStore>,
    queues: HashMap<Source, String>,
    /// The results partition each partition queue (results and dead letters) belongs to.
    partition_queues: HashMap<String, u16>,
    /// Each results partition's queue, where a stray (a message read from a partition other than its
    /// job's) is forwarded (see `forward_strays`).
    strays_to: BTreeMap<u16, Arc<dyn fleet_io::queue::Queue>>,
    /// Every role's key: with it, a message counts only when signed by a role that may send it
    /// (`item::authorize`); without it, roles are not checked.
    keyring: Option<fleet_io::auth::Keyring>,
    leases: Leases,
    memory: Mutex<InMemory>,
    known: Mutex<Known>,
    expiry: Mutex<Expiry>,
    /// Messages held through a store outage (see `hold`).
    hold: Mutex<Hold>,
    /// Results partitions this controller reads now (`reading` to `let_go`): the messages of the
    /// others are never held here, and their dormant jobs are left to their owners.
    read: Mutex<BTreeSet<u16>>,
    /// The controller is stopping: nothing is held any more (see `hold`).
    stopping: std::sync::atomic::AtomicBool,
    /// What the jobs' own records say (see `records`).
    records: Mutex<RecordsCache>,
    /// Decoded results in memory at once stay within it (see `budget`).
    budget: Arc<Budget>,
    /// Where the purge of each finished job's blobs is recorded (see `close_finished`).
    on_finished: Mutex<Purging>,
    /// Messages applied in memory and waiting for a checkpoint (shared with each job's `Pending`).
    pending: Arc<AtomicUsize>,
    stats: CheckpointStats,
    /// When sealed jobs that no longer progress are finished (none: never).
    stall: Option<scan::StallLimit>,
    /// Wall time: leases, checkpoint times, a dormant job's age.
    clock: Clock,
    /// Result payloads are decompressed on the blocking pool (off in the simulation, which runs on
    /// one thread).
    offload_decoding: bool,
    /// A job with every chunk in, some of them failed, is finished this long after its last news.
    settle: Duration,
    /// The price table reports' request costs are computed with.
    prices: Prices,
}

/// How an aggregator is set up: everything it is given at construction (nothing here changes later).
/// `Options::default()` is a test's aggregator: a random owner, the shipped lease and settle times,
/// the system clock, list prices, the default decode budget, the default queue names, one partition,
/// no stall rule and no role check.
pub struct Options {
    /// The name it holds job leases under ...
    pub owner: String,
    /// ... for this long at a time.
    pub lease: Duration,
    /// Wall time (the simulation's is driven by tokio's clock).
    pub clock: Clock,
    /// How long a job whose chunks are all in, some failed, waits without news for a real result to
    /// replace a failure before it is finished.
    pub settle: Duration,
    /// The price table reports' request costs are computed with.
    pub prices: Prices,
    /// The byte budget of decoded results in memory at once.
    pub decode_budget: u64,
    /// Finishes sealed jobs that no longer progress as `partial` after a time without news, once every
    /// message that was in the fleet's queues at their last news has left them (see `scan::Emptied`);
    /// none: never.
    pub stall: Option<scan::StallLimit>,
    /// Each source's queue name (recorded with what is quarantined from it).
    pub queues: HashMap<Source, String>,
    /// The results partition of each partition queue (its results queue and its dead-letter queue):
    /// the jobs whose messages come from it are let go with the partition (`let_go`).
    pub partition_queues: HashMap<String, u16>,
    /// Each results partition's queue, where a stray of its jobs (read from another partition) is
    /// forwarded. A stray of a partition with no queue here (the count lowered while its job was in
    /// flight) is applied where it was read, as before partitions.
    pub strays_to: BTreeMap<u16, Arc<dyn fleet_io::queue::Queue>>,
    /// With it, a message counts only when signed by a role that may send it (see `fleet_io::auth`);
    /// anything else is quarantined with the reason. Without it, roles are not checked.
    pub keyring: Option<fleet_io::auth::Keyring>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            owner: format!("controller-{}", uuid::Uuid::now_v7().simple()),
            lease: LEASE,
            clock: Clock::System,
            settle: SETTLE,
            prices: Prices::default(),
            decode_budget: budget::DEFAULT_BUDGET_MIB << 20,
            stall: None,
            queues: Source::ALL.iter().map(|s| (*s, s.default_queue().to_string())).collect(),
            partition_queues: HashMap::new(),
            strays_to: BTreeMap::new(),
            keyring: None,
        }
    }
}

impl Aggregator {
    /// An aggregator set up as [`Options::default`] says.
    pub fn new(store: Arc<dyn BlobStore>) -> Aggregator {
        Self::with(store, Options::default())
    }

    /// An aggregator set up as `options` say.
    pub fn with(store: Arc<dyn BlobStore>, options: Options) -> Aggregator {
        let Options { owner, lease, clock, settle, prices, decode_budget, stall, queues, partition_queues, strays_to, keyring } = options;
        let leases = Leases::new(store.clone(), owner, lease, clock);
        Aggregator {
            store,
            queues,
            partition_queues,
            strays_to,
            keyring,
            leases,
            memory: Mutex::default(),
            known: Mutex::default(),
            expiry: Mutex::new(Expiry { scanned: None, idle_floor: Instant::now(), emptied: scan::Emptied::default(), seen: Sightings::new(Duration::MAX) }),
            hold: Mutex::new(Hold::new(Instant::now().into_std())),
            read: Mutex::default(),
            stopping: Default::default(),
            records: Mutex::default(),
            budget: Arc::new(Budget::new(decode_budget)),
            on_finished: Mutex::new(Purging::Nowhere),
            pending: Arc::default(),
            stats: CheckpointStats::default(),
            stall,
            clock,
            offload_decoding: !matches!(clock, Clock::Driven { .. }),
            settle,
            prices,
        }
    }

    /// The budget of decoded results (its high-water mark: the most in memory at once).
    pub fn decode_budget(&self) -> &Budget {
        &self.budget
    }

    /// The keyring roles are checked with (none: they are not).
    pub fn keyring(&self) -> Option<&fleet_io::auth::Keyring> {
        self.keyring.as_ref()
    }

    /// Lets go of the jobs of results partition `p` (another controller reads it from now on): their
    /// pending messages checkpointed (returned for deletion) and their leases given back, so that the
    /// partition's new owner takes them at once; its dormant jobs forgotten.
    pub async fn let_go(&self, p: u16) -> Vec<Kept> {
        lock(&self.read).remove(&p);
        // What a scan saw of its dormant jobs goes stale from now on (they may have news on the new
        // reader): a scan after the partition is read here again finds them afresh.
        lock(&self.known).dormant.let_go(p);
        let done = self.flush().await;
        if crate::undo::is(crate::undo::Fix::LetGoOfPartitionJobs) {
            return done;
        }
        let jobs: BTreeSet<String> = lock(&self.memory).partition.iter().filter(|(_, q)| **q == p).map(|(j, _)| j.clone()).collect();
        self.release_leases_where(|job| jobs.contains(job)).await;
        lock(&self.memory).partition.retain(|j, _| !jobs.contains(j));
        done
    }

    /// The controller is stopping: a batch that fails from now on goes back to its queue at once
    /// instead of being held.
    pub fn stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// This controller reads results partition `p` (again): its messages may be held.
    pub fn reading(&self, p: u16) {
        lock(&self.read).insert(p);
    }

    /// What checkpoints have written so far.
    pub fn stats(&self) -> &CheckpointStats {
        &self.stats
    }

    fn slot(&self, job_id: &str) -> Slot {
        lock(&self.memory).slots.entry(job_id.to_string()).or_default().clone()
    }

    /// Forgets a job's slot when it is empty and nobody else holds it (clones are only made under the
    /// map's lock, so a count of one there means no task can be about to use it).
    fn prune(&self, job_id: &str) {
        let mut memory = lock(&self.memory);
        let jobs = &mut memory.slots;
        let unused = jobs.get(job_id).is_some_and(|s| Arc::strong_count(s) == 1 && s.try_lock().is_ok_and(|j| j.is_none()));
        if unused {
            jobs.remove(job_id);
            memory.partition.remove(job_id);
        }
    }

    fn slots(&self) -> Vec<(String, Slot)> {
        lock(&self.memory).slots.iter().map(|(k, s)| (k.clone(), s.clone())).collect()
    }

    fn is_finished(&self, job_id: &str) -> bool {
        lock(&self.known).finished.contains(job_id)
    }

    /// Jobs in memory (being aggregated).
    pub fn open_jobs(&self) -> usize {
        lock(&self.memory).slots.values().filter(|s| s.try_lock().map_or(true, |j| j.is_some())).count()
    }

    /// The partitions of the jobs in memory that have had no news for `quiet` (all of them for a job
    /// of no partition): what they wait for may come unannounced (a result SQS moved to a dead-letter
    /// queue with the scaling agent down), so their listeners look now rather than at their safety
    /// poll. A job being worked on is skipped. So are the dormant jobs (known from their open marker
    /// only) of the partitions read here: a result of one dead-lettered unannounced waited for the
    /// hourly safety poll, and its news then restarted the job's abandon time (the simulation, seed
    /// 9103683: a report 2 h past its bound).
    pub fn waiting(&self, quiet: Duration) -> Waiting {
        let now = Instant::now();
        let floor = lock(&self.expiry).idle_floor;
        let mut out = Waiting::default();
        if !crate::undo::is(crate::undo::Fix::WaitingLooks) {
            let dormant: Vec<(Instant, Option<u16>)> = lock(&self.known).dormant.iter().map(|(_, d)| (Instant::from_std(d.since), d.partition)).collect();
            for (since, partition) in dormant {
                if now.saturating_duration_since(since.max(floor)) < quiet || !self.loads_here(partition) {
                    continue;
                }
                match partition {
                    Some(p) => {
                        out.partitions.insert(p);
                    }
                    None => out.any = true,
                }
            }
        }
        let partition = lock(&self.memory).partition.clone();
        for (_, slot) in self.slots() {
            let Ok(loaded) = slot.try_lock() else { continue };
            match loaded.as_ref() {
                Some(job) if job.is_open() && job.quiet_for(now, floor) >= quiet => match partition.get(job.id()).copied().or(job.partition()) {
                    Some(p) => {
                        out.partitions.insert(p);
                    }
                    None => out.any = true,
                },
                _ => {}
            }
        }
        out
    }

    /// Messages applied in memory and waiting for a checkpoint.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// Sends the id of every job this aggregator finishes from now on to `tx` (the purger).
    pub fn notify_finished(&self, tx: tokio::sync::mpsc::UnboundedSender<crate::purge::ToPurge>) {
        *lock(&self.on_finished) = Purging::To(tx);
    }

    /// Stops sending finished jobs (the receiver ends once it has what was sent).
    pub fn stop_notifying(&self) {
        *lock(&self.on_finished) = Purging::Stopped;
    }

    /// Closes a finished job (its report written): its purge is recorded, then its open marker goes.
    /// The open marker is the purge's one trace should this controller die before the purger wrote
    /// its marker, so it stays when the purge is not recorded (a purger that failed, timed out or
    /// stopped): a later scan comes back here.
    pub(super) async fn close_finished(&self, job_id: &str) -> Result<()> {
        let tx = match &*lock(&self.on_finished) {
            Purging::Nowhere => None,
            Purging::To(tx) => Some(tx.clone()),
            Purging::Stopped => return Ok(()),
        };
        if let Some(tx) = tx {
            let (recorded, heard) = tokio::sync::oneshot::channel();
            let sent = tx.send((job_id.to_string(), recorded)).is_ok();
            if !sent || !matches!(tokio::time::timeout(PURGE_RECORDED_WITHIN, heard).await, Ok(Ok(true))) {
                tracing::warn!(job = %job_id, "the finished job's purge is not recorded yet: its open marker stays for the next scan");
                return Ok(());
            }
        }
        self.store.delete(&fleet_domain::layout::open_key(job_id)).await
    }

    fn remember_finished(&self, job_id: &str, status: JobStatus) {
        self.forget_records(job_id);
        lock(&self.known).finished.remember(job_id, status);
    }
}

/// The messages of `kept`, without their sources (taken: `kept` is left empty).
fn unpaired(kept: &mut Vec<(Source, Kept)>) -> Vec<Kept> {
    std::mem::take(kept).into_iter().map(|(_, k)| k).collect()
}

/// DeleteMessageBatch calls needed for these messages (per queue, ten at a time).
fn delete_calls<'a>(kept: impl IntoIterator<Item = &'a Kept>) -> u64 {
    let mut per_queue: BTreeMap<&str, u64> = BTreeMap::new();
    for k in kept {
        *per_queue.entry(k.queue()).or_default() += 1;
    }
    per_queue.values().map(|n| n.div_ceil(10)).sum()
}

#[cfg(test)]
mod tests;
