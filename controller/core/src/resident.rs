//! The jobs in memory, as bookkeeping: each job's slot (the driver's lock around the job), its lease
//! (held weakly by the driver, so that a job dropped takes its lease with it; renewed by the timer
//! without the job's lock), until when its store calls fail (its messages are turned back without a
//! call meanwhile, instead of each batch waiting out another call deadline), and the results
//! partition its messages came from (to let its jobs go with a partition).
//!
//! Generic over the slot `S` and the lease `W`: it holds no lock and no lease of the driver's, and
//! reads no clock (every question about failing takes the instant it is asked at).
//!
//! Beside them, [`Carried`]: the calls made for jobs that were not in memory to take them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use fleet_domain::requests::RequestCounts;

/// The jobs in memory. Ordered maps throughout: the order jobs are visited in is the same on every
/// run (the simulation replays a seed exactly).
#[derive(Debug)]
pub struct Resident<S, W> {
    slots: BTreeMap<String, S>,
    leases: BTreeMap<String, W>,
    failing: BTreeMap<String, Instant>,
    partition: BTreeMap<String, u16>,
}

impl<S, W> Default for Resident<S, W> {
    fn default() -> Self {
        Resident { slots: BTreeMap::new(), leases: BTreeMap::new(), failing: BTreeMap::new(), partition: BTreeMap::new() }
    }
}

impl<S: Clone + Default, W> Resident<S, W> {
    /// Job `job`'s slot, made empty when it has none.
    pub fn slot(&mut self, job: &str) -> S {
        self.slots.entry(job.to_string()).or_default().clone()
    }

    /// Job `job`'s slot, if it has one.
    pub fn get(&self, job: &str) -> Option<&S> {
        self.slots.get(job)
    }

    /// Every job with a slot, in order.
    pub fn slots(&self) -> Vec<(String, S)> {
        self.slots.iter().map(|(k, s)| (k.clone(), s.clone())).collect()
    }

    /// Every slot.
    pub fn values(&self) -> impl Iterator<Item = &S> {
        self.slots.values()
    }

    /// Forgets job `job` (its slot and its partition) when `unused` says its slot is no longer used.
    pub fn forget_if(&mut self, job: &str, unused: impl FnOnce(&S) -> bool) {
        if self.slots.get(job).is_some_and(unused) {
            self.slots.remove(job);
            self.partition.remove(job);
        }
    }

    /// Job `job` holds lease `w` now (its last one, if any, replaced).
    pub fn hold_lease(&mut self, job: &str, w: W) {
        self.leases.insert(job.to_string(), w);
    }

    /// The lease job `job` holds now.
    pub fn lease(&self, job: &str) -> Option<&W> {
        self.leases.get(job)
    }

    /// The leases still alive (`live` gives each one's strong handle), in order; the others are
    /// forgotten.
    pub fn live_leases<L>(&mut self, live: impl Fn(&W) -> Option<L>) -> Vec<(String, L)> {
        let mut out = Vec::with_capacity(self.leases.len());
        self.leases.retain(|k, w| live(w).map(|h| out.push((k.clone(), h))).is_some());
        out
    }

    /// Job `job`'s store calls failed at `now`: its messages are turned back without a call until
    /// `until`.
    pub fn failed(&mut self, job: &str, until: Instant) {
        self.failing.insert(job.to_string(), until);
    }

    /// Until when job `job` was marked failing, if it was (whether or not that time has passed).
    pub fn failing_mark(&self, job: &str) -> Option<Instant> {
        self.failing.get(job).copied()
    }

    /// Job `job`'s store calls fail at `now` (its mark has not passed).
    pub fn failing(&self, job: &str, now: Instant) -> bool {
        self.failing.get(job).is_some_and(|until| now < *until)
    }

    /// Job `job`'s store calls answered again: its mark goes.
    pub fn answered(&mut self, job: &str) {
        self.failing.remove(job);
    }

    /// Every job is tried at once again (a retry of the messages held is the try).
    pub fn try_all(&mut self) {
        self.failing.clear();
    }

    /// Job `job`'s messages came from partition `p`: kept unless a partition is known already (until
    /// its records are read, which name it for good, a stray must not move a job held here).
    pub fn came_from(&mut self, job: &str, p: u16) {
        self.partition.entry(job.to_string()).or_insert(p);
    }

    /// Job `job`'s records name partition `p`.
    pub fn recorded_in(&mut self, job: &str, p: u16) {
        self.partition.insert(job.to_string(), p);
    }

    /// Job `job` brought only strays: its partition goes unless it is in memory.
    pub fn only_strays(&mut self, job: &str) {
        if !self.slots.contains_key(job) {
            self.partition.remove(job);
        }
    }

    /// Job `job`'s partition, if known.
    pub fn partition(&self, job: &str) -> Option<u16> {
        self.partition.get(job).copied()
    }

    /// Every job's partition.
    pub fn partitions(&self) -> &BTreeMap<String, u16> {
        &self.partition
    }

    /// The jobs of partition `p`.
    pub fn jobs_of(&self, p: u16) -> BTreeSet<String> {
        self.partition.iter().filter(|(_, q)| **q == p).map(|(j, _)| j.clone()).collect()
    }

    /// Forgets the partitions of `jobs` (let go with their partition).
    pub fn let_go(&mut self, jobs: &BTreeSet<String>) {
        self.partition.retain(|j, _| !jobs.contains(j));
    }
}

/// Jobs whose calls are carried at most (the oldest job ids forgotten first past it).
pub const MAX_CARRIED: usize = 10_000;

/// The calls made for jobs that were not in memory to take them: counted since a job's last
/// checkpoint when it was dropped (a failure, its lease lost, its partition let go) or made outside
/// its lock (a lease renewed by the timer). Each job takes its own in when it is next loaded or saved
/// here, so a call is counted once, where it was made, whatever became of the job in between.
#[derive(Debug, Default)]
pub struct Carried {
    jobs: BTreeMap<String, Carry>,
}

/// What a job dropped from memory carries: its calls since its last confirmed checkpoint, and for
/// each checkpoint write since whose outcome is unknown (its answer lost), the digest of its body,
/// the calls that document already held, and the calls it attributed to what it covered. When the
/// checkpoint loaded next is one of those documents, the calls it held are in it already and are not
/// counted again, and what it attributed is taken back (its writer, told it failed, kept the
/// messages, which a later checkpoint covers and attributes again). Only that document is known: a
/// job loaded from a later one (another controller loaded the landed write and checkpointed after)
/// counts the held calls twice.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Carry {
    pub calls: RequestCounts,
    pub in_writes: Vec<([u8; 32], RequestCounts, RequestCounts)>,
}

/// What a job loaded takes from what was carried for it: calls to count, and calls its checkpoint
/// holds that were not made (to take back).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Taken {
    pub count: RequestCounts,
    pub withdraw: RequestCounts,
}

impl Carried {
    /// Keeps `calls` made for job `job` until it takes them.
    pub fn keep(&mut self, job: &str, calls: &RequestCounts) {
        if calls.total() > 0 {
            self.entry(job).calls.merge(calls);
        }
    }

    /// Keeps what job `job` carried when it was dropped.
    pub fn keep_dropped(&mut self, job: &str, carry: Carry) {
        if carry.calls.total() == 0 {
            return;
        }
        let e = self.entry(job);
        e.calls.merge(&carry.calls);
        e.in_writes = carry.in_writes;
    }

    fn entry(&mut self, job: &str) -> &mut Carry {
        if self.jobs.len() >= MAX_CARRIED && !self.jobs.contains_key(job) {
            self.jobs.pop_first();
        }
        self.jobs.entry(job.to_string()).or_default()
    }

    /// What was kept for job `job` (nothing more is kept for it), less what the checkpoint it is
    /// loaded from holds already (`loaded`: that document's digest, if one was read).
    pub fn take(&mut self, job: &str, loaded: Option<[u8; 32]>) -> Taken {
        let Some(Carry { mut calls, in_writes }) = self.jobs.remove(job) else { return Taken::default() };
        let mut withdraw = RequestCounts::default();
        if let Some((_, held, attributed)) = loaded.and_then(|d| in_writes.into_iter().find(|(w, ..)| *w == d)) {
            calls.sub(&held);
            withdraw = attributed;
        }
        Taken { count: calls, withdraw }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    type R = Resident<Option<u32>, u8>;

    #[test]
    fn a_job_forgotten_takes_its_partition_and_a_stray_does_not_move_it() {
        let mut r = R::default();
        assert_eq!(r.slot("a"), None);
        r.came_from("a", 1);
        r.came_from("a", 2);
        assert_eq!(r.partition("a"), Some(1), "the first partition stands until the records name one");
        r.recorded_in("a", 2);
        assert_eq!(r.partition("a"), Some(2));
        r.forget_if("a", |s| s.is_some());
        assert_eq!(r.partition("a"), Some(2), "a slot in use stays");
        r.forget_if("a", |s| s.is_none());
        assert!(r.get("a").is_none() && r.partition("a").is_none(), "forgotten with its partition");
        r.came_from("b", 3);
        r.only_strays("b");
        assert_eq!(r.partition("b"), None, "a job only strays were read of leaves nothing");
        r.slot("c");
        r.came_from("c", 3);
        r.only_strays("c");
        assert_eq!(r.partition("c"), Some(3), "a job in memory keeps its partition");
    }

    #[test]
    fn failing_lasts_until_its_mark_and_a_retry_clears_every_mark() {
        let t0 = Instant::now();
        let mut r = R::default();
        r.failed("a", t0 + Duration::from_secs(5));
        r.failed("b", t0 + Duration::from_secs(5));
        assert!(r.failing("a", t0 + Duration::from_secs(4)));
        assert!(!r.failing("a", t0 + Duration::from_secs(5)), "not failing once its mark passed");
        assert!(r.failing_mark("a").is_some(), "the mark stays until answered");
        r.answered("a");
        assert!(r.failing_mark("a").is_none());
        r.try_all();
        assert!(!r.failing("b", t0));
    }

    #[test]
    fn a_partition_let_go_takes_its_jobs_and_only_them() {
        let mut r = R::default();
        r.recorded_in("a", 1);
        r.recorded_in("b", 2);
        r.recorded_in("c", 1);
        let jobs = r.jobs_of(1);
        assert_eq!(jobs.iter().map(String::as_str).collect::<Vec<_>>(), ["a", "c"]);
        r.let_go(&jobs);
        assert_eq!(r.partitions().keys().map(String::as_str).collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn dead_leases_are_forgotten() {
        let mut r = R::default();
        r.hold_lease("a", 1);
        r.hold_lease("b", 0);
        let live = r.live_leases(|w| (*w > 0).then_some(*w));
        assert_eq!(live, vec![("a".to_string(), 1)]);
        assert!(r.lease("b").is_none());
    }

    #[test]
    fn calls_carried_are_taken_once() {
        use fleet_domain::requests::{Billed, Op};
        let one: RequestCounts = [(Billed::call(Op::S3GetObject), 1)].into_iter().collect();
        let mut c = Carried::default();
        c.keep("a", &one);
        c.keep("a", &one);
        c.keep("b", &RequestCounts::default());
        assert_eq!(c.take("a", None).count.calls(Op::S3GetObject), 2);
        assert_eq!(c.take("a", None).count.total(), 0, "taken once");
        assert_eq!(c.jobs.len(), 0, "nothing kept for nothing");
        for i in 0..=MAX_CARRIED {
            c.keep(&format!("{i:06}"), &one);
        }
        assert_eq!(c.jobs.len(), MAX_CARRIED, "bounded");
        assert_eq!(c.take("000000", None).count.total(), 0, "the first forgotten");
    }

    /// A job dropped after a write whose answer was lost: loaded from that very document, it counts
    /// only what the document did not hold; loaded from another (the write did not land), all of it.
    #[test]
    fn a_dropped_jobs_calls_are_counted_once_whichever_document_it_is_loaded_from() {
        use fleet_domain::requests::{Billed, Op};
        let n = |k: u64| -> RequestCounts { [(Billed::call(Op::S3PutObject), k)].into_iter().collect() };
        let carry = Carry { calls: n(5), in_writes: vec![([1; 32], n(2), n(7)), ([2; 32], n(4), n(8))] };
        let mut c = Carried::default();
        c.keep_dropped("a", carry.clone());
        let t = c.take("a", Some([2; 32]));
        assert_eq!((t.count.total(), t.withdraw.total()), (1, 8), "the second write landed: it held 4 of the 5, and what it attributed is taken back");
        c.keep_dropped("a", carry.clone());
        assert_eq!(c.take("a", Some([1; 32])).count.total(), 3);
        c.keep_dropped("a", carry);
        c.keep("a", &n(1));
        let t = c.take("a", Some([9; 32]));
        assert_eq!((t.count.total(), t.withdraw.total()), (6, 0), "none of them landed: all, with what was kept since");
    }
}
