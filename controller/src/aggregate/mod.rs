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
//! Its state is owned by types that each guard theirs with one lock, never held across an await (a
//! job's own lock excepted, held across that job's S3 calls), each in a file of its own: `memory`
//! (the jobs in memory), `carried` (the calls made for jobs not in memory to take them), `hold` (`Holding`: the messages
//! held through an outage), `reading` (the partitions read, whether the controller is stopping),
//! `known` (the jobs finished lately and dormant; the expiry's clock), `records`, `purging`, and
//! `books` (a job's books in the store, with what is known of the jobs and their records). No other
//! file takes a lock.
//!
//! Rooms that act on it: `job` (a job in memory: the core's state machine, `controller_core::job`,
//! with this controller's lease beside it), `item` (what a message brings to a job, by `Source`:
//! parsed, its sender's role checked, its payload fetched), `limits` (sizes and periods), `budget`,
//! `batch` (the path of one batch, each message's fate the core's `records`), `take` (a lease and a
//! load, the effects of the core's `take`; leases kept and given back), `checkpoint` (flushing, and
//! writing what a job planned), `finalize` (the report, the effects of the core's `finish`), `scan` (dormant
//! jobs and expiry), `quarantine` (jobs whose state cannot be read; `Unreadable`, where a message that
//! can never count is kept). A job's requests are counted where they are made
//! (`docs/requests.md`). This file holds the aggregator, how it is set up (`Options`) and what it
//! reports of itself.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use controller_core::waiting::Waiting;
use fleet_domain::prices::Prices;
use fleet_engine::Kept;
use fleet_io::blob::BlobStore;
use tokio::time::Instant;

use crate::clock::Clock;
use crate::lease::Leases;

mod batch;
mod books;
pub mod budget;
mod carried;
mod checkpoint;
mod claims;
mod finalize;
pub mod hold;
mod item;
mod job;
mod known;
mod limits;
mod memory;
mod purging;
mod quarantine;
mod reading;
pub mod records;
mod scan;
mod take;

use books::Books;
use budget::Budget;
use hold::Holding;
pub use item::{Source, MEMORY_TARGET};
use job::Job;
use known::{Expiry, Known};
pub use limits::{DEAD_LETTER_REASON, FLUSH_INTERVAL, FLUSH_MESSAGES, HAND_BACK, INLINE_ROWS, LEASE, MAX_RESULT_BYTES, SETTLE, UNRECORDED_RECEIVES};
pub use memory::Memory;
use memory::Slot;
pub use purging::Purging;
use quarantine::Unreadable;
pub use reading::Reading;
use records::Records;
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

/// The controller's in-memory view of the jobs it is aggregating. Shared by every listener: each job
/// is locked on its own, and no lock spans two jobs.
///
/// Its state is owned by types that each guard theirs with one lock, never held across an await (a
/// job's own lock excepted, held across that job's S3 calls): the jobs in memory (`memory`), the
/// messages held through an outage (`holding`), the partitions read (`reading`), the expiry's clock
/// (`expiry`), and in `books` the jobs' books in the store with what is known of the jobs not in
/// memory, their records and where finished jobs are announced. The rest is set at construction
/// ([`Options`]) and never changes.
pub struct Aggregator {
    store: Arc<dyn BlobStore>,
    /// Where a message that can never count is kept with the reason (see `quarantine`).
    unreadable: Unreadable,
    /// Each results partition's queue, where a stray (a message read from a partition other than its
    /// job's) is forwarded (see `forward_strays`).
    strays_to: BTreeMap<u16, Arc<dyn fleet_io::queue::Queue>>,
    /// Every role's key: with it, a message counts only when signed by a role that may send it
    /// (`item::authorize`); without it, roles are not checked.
    keyring: Option<fleet_io::auth::Keyring>,
    /// The jobs in memory (see `memory`).
    memory: Arc<Memory>,
    /// Leases, checkpoints, reports, quarantines; what is known of jobs not in memory (see `books`).
    books: Books,
    /// When the open markers were scanned, the idle floor, the queues' emptying (see `known`).
    expiry: Arc<Expiry>,
    /// Messages held through a store outage (see `hold`).
    holding: Holding,
    /// Results partitions this controller reads now, and whether it is stopping: the messages of the
    /// others are never held here, and their dormant jobs are left to their owners.
    reading: Arc<Reading>,
    /// Decoded results in memory at once stay within it (see `budget`).
    budget: Arc<Budget>,
    /// When sealed jobs that no longer progress are finished (none: never).
    stall: Option<scan::StallLimit>,
    /// Result payloads are decompressed on the blocking pool (off in the simulation, which runs on
    /// one thread).
    offload_decoding: bool,
    /// A job with every chunk in, some of them failed, is finished this long after its last news.
    settle: Duration,
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
    /// An aggregator set up as `options` say.
    pub fn with(store: Arc<dyn BlobStore>, options: Options) -> Aggregator {
        let Options { owner, lease, clock, settle, prices, decode_budget, stall, queues, partition_queues, strays_to, keyring } = options;
        let reading = Arc::new(Reading::new(partition_queues));
        let memory = Arc::new(Memory::default());
        let expiry = Arc::new(Expiry::new(clock));
        let books = Books {
            store: store.clone(),
            leases: Leases::new(store.clone(), owner, lease, clock),
            clock,
            prices,
            stats: CheckpointStats::default(),
            known: Known::default(),
            records: Records::new(store.clone()),
            purging: Purging::default(),
            expiry: expiry.clone(),
            memory: memory.clone(),
            claims_backoff: Default::default(),
            read_ahead: Default::default(),
        };
        Aggregator {
            unreadable: Unreadable { store: store.clone(), queues },
            store,
            strays_to,
            keyring,
            memory,
            books,
            expiry,
            holding: Holding::new(reading.clone()),
            reading,
            budget: Arc::new(Budget::new(decode_budget)),
            stall,
            offload_decoding: !matches!(clock, Clock::Driven { .. }),
            settle,
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
        self.reading.let_go(p);
        // What a scan saw of its dormant jobs goes stale from now on (they may have news on the new
        // reader): a scan after the partition is read here again finds them afresh.
        self.books.known.dormant(|d| d.let_go(p));
        let done = self.flush().await;
        if crate::undo::is(crate::undo::Fix::LetGoOfPartitionJobs) {
            return done;
        }
        let jobs = self.memory.with(|r| r.jobs_of(p));
        self.release_leases(|job| jobs.contains(job)).await;
        self.memory.with(|r| r.let_go(&jobs));
        done
    }

    /// The partitions it reads (`read` when one is gained), and whether it is stopping (`stop`: a
    /// batch that fails from then on goes back to its queue at once instead of being held).
    pub fn reading(&self) -> &Reading {
        &self.reading
    }

    /// The jobs in memory (`open_jobs`, `pending` messages, `unsaved_visibility` before a stop).
    pub fn memory(&self) -> &Memory {
        &self.memory
    }

    /// What checkpoints have written so far.
    pub fn stats(&self) -> &CheckpointStats {
        &self.books.stats
    }

    /// The partitions whose listeners should look now rather than at their safety poll: those of the
    /// jobs that have had no news for `quiet`, in memory (a job being worked on skipped) or dormant in
    /// a partition read here (the rule: `controller_core::waiting`).
    pub fn waiting(&self, quiet: Duration) -> Waiting {
        let (now, floor) = (Instant::now().into_std(), self.expiry.idle_floor().into_std());
        let dormant: Vec<(std::time::Instant, Option<u16>)> = self.books.known.dormant(|dormant| dormant.iter().map(|(_, d)| (d.since, d.partition)).collect());
        let partition = self.memory.with(|r| r.partitions().clone());
        let mut open = Vec::new();
        for (_, slot) in self.memory.slots() {
            let Ok(loaded) = slot.try_lock() else { continue };
            if let Some(job) = loaded.as_ref().filter(|job| job.is_open()) {
                open.push((job.news().into_std(), partition.get(job.id()).copied().or(job.tally().partition())));
            }
        }
        Waiting::of(now, floor, quiet, open, dormant, |p| self.reading.loads_here(p))
    }

    /// Where the purge of each finished job's blobs is recorded.
    pub fn purging(&self) -> &Purging {
        &self.books.purging
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
