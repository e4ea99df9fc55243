//! Which results partitions this controller reads now, and whether it is stopping: the messages of a
//! partition not read here are never held here (they go back to their queue, for its reader), its
//! dormant jobs are left to its reader, and once the controller stops nothing is held any more.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use fleet_io::lock;

/// The partitions read here, under one lock.
#[derive(Default)]
pub struct Reading {
    /// The results partition each partition queue (results and dead letters) belongs to (set at
    /// construction).
    queues: HashMap<String, u16>,
    /// Results partitions read now (`read` to `let_go`).
    read: Mutex<BTreeSet<u16>>,
    /// The controller is stopping: nothing is held any more (see `hold`).
    stopping: AtomicBool,
}

impl Reading {
    /// Nothing read yet, of the partitions whose queues `queues` names.
    pub(super) fn new(queues: HashMap<String, u16>) -> Reading {
        Reading { queues, ..Reading::default() }
    }

    /// Partition `p` is read here (again).
    pub fn read(&self, p: u16) {
        lock(&self.read).insert(p);
    }

    /// Partition `p` is read elsewhere from now on.
    pub(super) fn let_go(&self, p: u16) {
        lock(&self.read).remove(&p);
    }

    /// The controller is stopping.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// The messages for which `gives_back` is true go back to their queue at once instead of being
    /// held: every message once the controller is stopping, else those of a partition given up (a
    /// batch whose handler outlived the stop's grace).
    pub(super) fn gives_back(&self) -> impl Fn(&str) -> bool + '_ {
        let read = lock(&self.read).clone();
        let stopping = self.stopping.load(Ordering::SeqCst);
        move |queue| stopping || self.queues.get(queue).is_some_and(|p| !read.contains(p))
    }

    /// Whether the aggregator has partition queues at all (none: one results queue, as before
    /// partitions).
    pub(super) fn partitioned(&self) -> bool {
        !self.queues.is_empty()
    }

    /// The results partition queue `queue` belongs to, if it is a partition's.
    pub(super) fn partition_of(&self, queue: &str) -> Option<u16> {
        self.queues.get(queue).copied()
    }

    /// Results partition `p` is one of this controller's partition queues.
    pub(super) fn is_partition(&self, p: u16) -> bool {
        self.queues.values().any(|q| *q == p)
    }

    /// `queue` is a results partition's queue this controller does not read now.
    pub(super) fn not_read(&self, queue: &str) -> bool {
        if crate::undo::is(crate::undo::Fix::AppliedOnlyWhereRead) {
            return false;
        }
        self.queues.get(queue).is_some_and(|p| !lock(&self.read).contains(p))
    }

    /// Whether a dormant job of results partition `partition` is loaded here when it is due: always
    /// without partitions (or when its checkpoint does not say, or names a partition that no longer
    /// exists), else only by the partition's reader. Loaded elsewhere, a sealed job whose last result
    /// sits in the partition's dead-letter queue never stalls (that queue never empties: its owner
    /// hands the message back, the job's lease being held here) and its lease is renewed for ever
    /// (found by the simulation with triggers, seed 257: 5,000 hand-backs in one run).
    pub(super) fn loads_here(&self, partition: Option<u16>) -> bool {
        if crate::undo::is(crate::undo::Fix::OwnersLoadDormant) {
            return true;
        }
        match partition {
            Some(p) if self.is_partition(p) => lock(&self.read).contains(&p),
            _ => true,
        }
    }
}
