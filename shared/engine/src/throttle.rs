//! Long because its unit tests sit below the code (the code is the first ~290 lines).
//!
//! Throttling (seed 002): a maximum concurrency of messages being processed and a bounded in-memory
//! priority buffer between receiving and processing (higher priority first, FIFO within a priority).
//! When the buffer is full, a message of higher priority evicts the lowest-priority one; the evicted
//! message is handed back to the caller, which returns it to the queue (never dropped). A message that
//! waits longer than the TTL expires. Limits change at runtime; lowering them hands back the surplus.
//! Messages of one FIFO group are released one at a time, in arrival order (seed 003's per-partition
//! order; a group's priority is its best message's). A FIFO message that must go back to the queue
//! (evicted, surplus, expired, drained) while an earlier message of its group is still here is held
//! until the group has nothing left here: a message made visible behind an invisible one of its group
//! would let another consumer overtake it (LocalStack does; SQS itself blocks the group).

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Throttle limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThrottleLimits {
    /// Messages processed at once.
    pub max_concurrency: usize,
    /// Messages waiting beyond that; 0: nothing is received beyond free capacity.
    pub buffer: usize,
    /// How long a message may wait in the buffer (None: forever).
    #[serde(with = "opt_ms", rename = "ttl_ms")]
    pub ttl: Option<Duration>,
}

/// A runtime change; absent fields stay as they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsChange {
    pub max_concurrency: Option<usize>,
    pub buffer: Option<usize>,
    /// Milliseconds; 0 turns the TTL off.
    pub ttl_ms: Option<u64>,
}

/// Most messages processed at once by one listener.
pub const MAX_CONCURRENCY: usize = 10_000;
/// Longest buffer.
pub const MAX_BUFFER: usize = 100_000;
/// Longest buffer TTL, ms (a day).
pub const MAX_TTL_MS: u64 = 86_400_000;

impl LimitsChange {
    /// Refuses limits no listener can honour (a semaphore past its size, a buffer that exhausts
    /// memory, a deadline past the clock's range), naming the field.
    pub fn check(&self) -> Result<(), String> {
        if let Some(c) = self.max_concurrency {
            if !(1..=MAX_CONCURRENCY).contains(&c) {
                return Err(format!("max_concurrency: {c} is out of range 1..={MAX_CONCURRENCY}"));
            }
        }
        if let Some(b) = self.buffer {
            if b > MAX_BUFFER {
                return Err(format!("buffer: {b} is out of range 0..={MAX_BUFFER}"));
            }
        }
        if let Some(t) = self.ttl_ms {
            if t > MAX_TTL_MS {
                return Err(format!("ttl_ms: {t} is out of range 0..={MAX_TTL_MS}"));
            }
        }
        Ok(())
    }
}

impl ThrottleLimits {
    pub fn apply(&self, c: &LimitsChange) -> ThrottleLimits {
        ThrottleLimits {
            max_concurrency: c.max_concurrency.unwrap_or(self.max_concurrency).max(1),
            buffer: c.buffer.unwrap_or(self.buffer),
            ttl: match c.ttl_ms {
                None => self.ttl,
                Some(0) => None,
                Some(ms) => Some(Duration::from_millis(ms)),
            },
        }
    }
}

mod opt_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.map_or(0, |d| d.as_millis() as u64))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let ms = u64::deserialize(d)?;
        Ok((ms > 0).then(|| Duration::from_millis(ms)))
    }
}

struct Entry<M> {
    msg: M,
    group: Option<String>,
    enqueued: Instant,
}

/// The throttle: buffer, running count, capacity reserved by receives in progress.
pub struct Throttle<M> {
    limits: ThrottleLimits,
    /// Keyed by (higher priority first, arrival order).
    entries: BTreeMap<(Reverse<i32>, u64), Entry<M>>,
    running: usize,
    reserved: usize,
    active_groups: HashSet<String>,
    /// FIFO messages on their way back to the queue, waiting for their group to leave.
    held: HashMap<String, Vec<M>>,
    seq: u64,
}

impl<M> Throttle<M> {
    pub fn new(limits: ThrottleLimits) -> Throttle<M> {
        Throttle {
            limits: ThrottleLimits { max_concurrency: limits.max_concurrency.max(1), ..limits },
            entries: BTreeMap::new(),
            running: 0,
            reserved: 0,
            active_groups: HashSet::new(),
            held: HashMap::new(),
            seq: 0,
        }
    }

    pub fn limits(&self) -> ThrottleLimits {
        self.limits
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn running(&self) -> usize {
        self.running
    }

    /// Whether a message of group `g` is in progress or buffered.
    fn holds_group(&self, g: &str) -> bool {
        self.active_groups.contains(g) || self.entries.values().any(|e| e.group.as_deref() == Some(g))
    }

    /// A message leaving for the queue: handed back now, or held while its group is still here.
    pub fn give_back(&mut self, msg: M, group: Option<String>) -> Option<M> {
        match group {
            Some(g) if self.holds_group(&g) => {
                self.held.entry(g).or_default().push(msg);
                None
            }
            _ => Some(msg),
        }
    }

    /// Every held message (the end of a drain).
    pub fn take_held(&mut self) -> Vec<M> {
        std::mem::take(&mut self.held).into_values().flatten().collect()
    }

    /// Buffered messages beyond those that could start right now.
    fn waiting_capacity(&self) -> usize {
        self.limits.buffer + self.limits.max_concurrency.saturating_sub(self.running)
    }

    /// Room for more messages, counting receives in progress.
    pub fn free(&self) -> usize {
        self.waiting_capacity().saturating_sub(self.entries.len() + self.reserved)
    }

    /// Reserves room for a receive of up to `want` messages; returns how many (0: wait for room).
    pub fn reserve(&mut self, want: usize) -> usize {
        let n = self.free().min(want);
        self.reserved += n;
        n
    }

    pub fn unreserve(&mut self, n: usize) {
        self.reserved = self.reserved.saturating_sub(n);
    }

    /// Room reserved by receives in progress.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Buffers a message. Returns the messages that no longer fit (lowest priority first out; possibly
    /// this one), to be returned to the queue.
    pub fn push(&mut self, msg: M, priority: i32, group: Option<String>, now: Instant) -> Vec<M> {
        self.seq += 1;
        self.entries.insert((Reverse(priority), self.seq), Entry { msg, group, enqueued: now });
        self.surplus()
    }

    fn surplus(&mut self) -> Vec<M> {
        let mut out = Vec::new();
        while self.entries.len() > self.waiting_capacity() {
            // The last key is the lowest priority, newest within it.
            match self.entries.pop_last() {
                Some((_, e)) => out.extend(self.give_back(e.msg, e.group)),
                None => break,
            }
        }
        out
    }

    /// Takes the next message to process, if concurrency allows: the highest priority, oldest, whose
    /// group has no message in progress. The caller must call [`Throttle::finish`] when it is done.
    pub fn pop_ready(&mut self) -> Option<(M, Option<String>)> {
        if self.running >= self.limits.max_concurrency {
            return None;
        }
        let (key, first) = self.entries.iter().find(|(_, e)| e.group.as_ref().is_none_or(|g| !self.active_groups.contains(g)))?;
        // Within a group, arrival order wins over priority.
        let key = match &first.group {
            Some(g) => *self.entries.iter().filter(|(_, e)| e.group.as_ref() == Some(g)).min_by_key(|((_, seq), _)| *seq)?.0,
            None => *key,
        };
        let e = self.entries.remove(&key)?;
        if let Some(g) = &e.group {
            self.active_groups.insert(g.clone());
        }
        self.running += 1;
        Some((e.msg, e.group))
    }

    /// A message taken with [`Throttle::pop_ready`] is done. Returns the group's held messages once
    /// nothing of the group is left here, to be returned to the queue.
    pub fn finish(&mut self, group: Option<&str>) -> Vec<M> {
        self.running = self.running.saturating_sub(1);
        match group {
            Some(g) => {
                self.active_groups.remove(g);
                if self.holds_group(g) {
                    Vec::new()
                } else {
                    self.held.remove(g).unwrap_or_default()
                }
            }
            None => Vec::new(),
        }
    }

    /// Removes the messages that waited longer than the TTL.
    pub fn expire(&mut self, now: Instant) -> Vec<M> {
        let Some(ttl) = self.limits.ttl else {
            return Vec::new();
        };
        let keys: Vec<_> = self.entries.iter().filter(|(_, e)| now.duration_since(e.enqueued) >= ttl).map(|(k, _)| *k).collect();
        keys.into_iter().filter_map(|k| self.entries.remove(&k)).map(|e| e.msg).collect()
    }

    /// When the next buffered message expires.
    pub fn next_expiry(&self) -> Option<Instant> {
        let ttl = self.limits.ttl?;
        self.entries.values().map(|e| e.enqueued + ttl).min()
    }

    /// Changes the limits; returns the messages that no longer fit.
    pub fn set_limits(&mut self, limits: ThrottleLimits) -> Vec<M> {
        self.limits = ThrottleLimits { max_concurrency: limits.max_concurrency.max(1), ..limits };
        self.surplus()
    }

    /// Removes the buffered and held messages of `group`, in arrival order (a failed message's
    /// successors go back with it).
    pub fn take_group(&mut self, group: &str) -> Vec<M> {
        let mut keys: Vec<_> = self.entries.iter().filter(|(_, e)| e.group.as_deref() == Some(group)).map(|(k, _)| *k).collect();
        keys.sort_by_key(|(_, seq)| *seq);
        let mut out: Vec<M> = keys.into_iter().filter_map(|k| self.entries.remove(&k)).map(|e| e.msg).collect();
        out.extend(self.held.remove(group).unwrap_or_default());
        out
    }

    /// Removes every buffered message; those of a group with a message in progress are held until it
    /// finishes ([`Throttle::finish`]).
    pub fn take_all(&mut self) -> Vec<M> {
        let mut out = Vec::new();
        for (_, e) in std::mem::take(&mut self.entries) {
            out.extend(self.give_back(e.msg, e.group));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(c: usize, b: usize) -> ThrottleLimits {
        ThrottleLimits { max_concurrency: c, buffer: b, ttl: None }
    }

    fn drain(t: &mut Throttle<&'static str>) -> Vec<&'static str> {
        let mut out = Vec::new();
        while let Some((m, g)) = t.pop_ready() {
            out.push(m);
            t.finish(g.as_deref());
        }
        out
    }

    #[test]
    fn higher_priority_first_fifo_within() {
        let now = Instant::now();
        let mut t = Throttle::new(limits(1, 10));
        for (m, p) in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", 9)] {
            assert!(t.push(m, p, None, now).is_empty());
        }
        assert_eq!(drain(&mut t), vec!["e", "b", "d", "a", "c"]);
    }

    #[test]
    fn concurrency_limit_holds_messages_back() {
        let now = Instant::now();
        let mut t = Throttle::new(limits(2, 5));
        for m in ["a", "b", "c"] {
            t.push(m, 0, None, now);
        }
        assert_eq!(t.pop_ready().map(|x| x.0), Some("a"));
        assert_eq!(t.pop_ready().map(|x| x.0), Some("b"));
        assert!(t.pop_ready().is_none(), "two running: the third waits");
        t.finish(None);
        assert_eq!(t.pop_ready().map(|x| x.0), Some("c"));
    }

    #[test]
    fn full_buffer_evicts_the_lowest_priority_newest_first() {
        let now = Instant::now();
        // Nothing can start (one running), two may wait.
        let mut t = Throttle::new(limits(1, 2));
        t.push("run", 0, None, now);
        assert!(t.pop_ready().is_some());
        assert!(t.push("low-old", 1, None, now).is_empty());
        assert!(t.push("low-new", 1, None, now).is_empty());
        // Higher priority arrives: the newest of the lowest priority is evicted.
        assert_eq!(t.push("high", 7, None, now), vec!["low-new"]);
        // A message of lower priority than everything buffered is itself returned.
        assert_eq!(t.push("lowest", 0, None, now), vec!["lowest"]);
        // Equal to the lowest: FIFO keeps the older one.
        assert_eq!(t.push("low-newer", 1, None, now), vec!["low-newer"]);
        t.finish(None);
        assert_eq!(drain(&mut t), vec!["high", "low-old"]);
    }

    #[test]
    fn zero_buffer_receives_only_free_capacity() {
        let now = Instant::now();
        let mut t: Throttle<&str> = Throttle::new(limits(3, 0));
        assert_eq!(t.reserve(10), 3);
        assert_eq!(t.reserve(10), 0, "everything reserved");
        t.unreserve(3);
        t.push("a", 0, None, now);
        t.pop_ready();
        assert_eq!(t.free(), 2);
        assert_eq!(t.reserve(1), 1);
        assert_eq!(t.free(), 1);
    }

    #[test]
    fn ttl_expires_waiting_messages() {
        let t0 = Instant::now();
        let mut t = Throttle::new(ThrottleLimits { max_concurrency: 1, buffer: 10, ttl: Some(Duration::from_secs(5)) });
        t.push("running", 0, None, t0);
        t.pop_ready();
        t.push("old", 0, None, t0);
        t.push("new", 0, None, t0 + Duration::from_secs(3));
        assert_eq!(t.next_expiry(), Some(t0 + Duration::from_secs(5)));
        assert!(t.expire(t0 + Duration::from_millis(4999)).is_empty());
        assert_eq!(t.expire(t0 + Duration::from_secs(5)), vec!["old"]);
        assert_eq!(t.next_expiry(), Some(t0 + Duration::from_secs(8)));
        // Lowering the TTL at runtime applies to messages already waiting.
        t.set_limits(ThrottleLimits { ttl: Some(Duration::from_secs(1)), ..t.limits() });
        assert_eq!(t.expire(t0 + Duration::from_secs(4)), vec!["new"]);
    }

    #[test]
    fn lowering_limits_hands_back_the_surplus_lowest_first() {
        let now = Instant::now();
        let mut t = Throttle::new(limits(1, 4));
        t.push("run", 9, None, now);
        t.pop_ready();
        for (m, p) in [("a", 3), ("b", 1), ("c", 2), ("d", 0)] {
            t.push(m, p, None, now);
        }
        assert_eq!(t.set_limits(limits(1, 2)), vec!["d", "b"]);
        assert_eq!(t.len(), 2);
        // Raising concurrency lets more start at once.
        assert!(t.set_limits(limits(3, 2)).is_empty());
        assert_eq!(drain(&mut t).len(), 2);
        let c = LimitsChange { buffer: Some(7), ttl_ms: Some(0), max_concurrency: None };
        assert_eq!(limits(3, 2).apply(&c), limits(3, 7));
    }

    #[test]
    fn one_message_per_group_at_a_time_in_order() {
        let now = Instant::now();
        let mut t = Throttle::new(limits(4, 10));
        let g = |s: &str| Some(s.to_string());
        t.push("a1", 0, g("a"), now);
        t.push("a2", 0, g("a"), now);
        t.push("b1", 0, g("b"), now);
        t.push("a3", 0, g("a"), now);
        let (m1, g1) = t.pop_ready().unwrap();
        let (m2, g2) = t.pop_ready().unwrap();
        assert_eq!((m1, m2), ("a1", "b1"));
        assert!(t.pop_ready().is_none(), "a2 waits for a1 although concurrency allows more");
        t.finish(g2.as_deref());
        assert!(t.pop_ready().is_none());
        t.finish(g1.as_deref());
        assert_eq!(t.pop_ready().map(|x| x.0), Some("a2"));
        // A failed message's successors go back to the queue with it.
        assert_eq!(t.take_group("a"), vec!["a3"]);
    }

    #[test]
    fn a_group_keeps_arrival_order_whatever_the_priorities() {
        let now = Instant::now();
        let mut t = Throttle::new(limits(4, 10));
        let g = |s: &str| Some(s.to_string());
        t.push("a1", 0, g("a"), now);
        t.push("b1", 1, g("b"), now);
        t.push("a2", 5, g("a"), now);
        // a2's priority makes group a first, but a1 arrived before it.
        let (m, ga) = t.pop_ready().unwrap();
        assert_eq!(m, "a1");
        assert_eq!(t.pop_ready().map(|x| x.0), Some("b1"));
        assert!(t.pop_ready().is_none());
        t.finish(ga.as_deref());
        assert_eq!(t.pop_ready().map(|x| x.0), Some("a2"));
    }

    #[test]
    fn fifo_messages_going_back_wait_for_their_group_to_leave() {
        let now = Instant::now();
        let mut t = Throttle::new(limits(1, 2));
        let g = |s: &str| Some(s.to_string());
        t.push("a1", 0, g("a"), now);
        let (_, ga) = t.pop_ready().unwrap();
        t.push("b1", 0, g("b"), now);
        t.push("a2", 0, g("a"), now);
        // Full; a higher-priority message evicts a2, which is held (a1 is in progress), not returned.
        assert!(t.push("c1", 3, g("c"), now).is_empty());
        // Lowering the buffer evicts b1: its group has nothing else here, so it goes back at once.
        assert_eq!(t.set_limits(limits(1, 1)), vec!["b1"]);
        // a1 done: group a has left, a2 goes back now.
        assert_eq!(t.finish(ga.as_deref()), vec!["a2"]);
        // Drain: a message of a group in progress is held until it finishes; others go back.
        t.push("d1", 0, g("d"), now);
        let (m, gc) = t.pop_ready().unwrap();
        assert_eq!(m, "c1");
        t.push("c2", 0, g("c"), now);
        assert_eq!(t.take_all(), vec!["d1"]);
        assert_eq!(t.finish(gc.as_deref()), vec!["c2"]);
        // What is still held at the end of a drain can be taken.
        let (_, gd) = {
            t.push("e1", 0, g("e"), now);
            t.pop_ready().unwrap()
        };
        t.push("e2", 0, g("e"), now);
        assert!(t.take_all().is_empty());
        assert_eq!(t.take_held(), vec!["e2"]);
        assert!(t.finish(gd.as_deref()).is_empty());
    }
}
