//! Expiry judged on one clock (issue 58, item 5). A lease or a membership is written by one host and
//! judged by another; comparing the writer's wall clock with the reader's makes a reader whose clock
//! runs a third of a lease ahead take what its owner still reads. So a reader judges a value it did
//! not write by its own monotonic clock only: a value is expired once this reader has seen it
//! *unchanged* for a whole lease. The first sight of a value comes after its write, and a writer acts
//! on what it wrote for two thirds of a lease at most (`Leases::fresh`, `Ownership::fresh`), so
//! whatever the clocks say, a reader takes nothing its writer may still act on. The price: a reader
//! that first looks at a dead owner's value waits a whole lease from that look, not from the write.
//!
//! Each writer also declares its own lease with what it writes, and a reader judges a value by the
//! longer of its own lease and the one declared ([`lease_to_judge`]): a controller started with a
//! shorter `--lease-secs` than its peers (a misconfigured replica, a rolling change of the setting)
//! would otherwise take what a peer renews every third of *its* lease, still within it.
//!
//! Pure: the caller passes the instant it looked.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use std::time::Instant;

/// The longest lease a writer may declare and have honoured (a garbled or absurd declaration holds a
/// dead owner's value at most this long).
pub const MAX_DECLARED_LEASE: Duration = Duration::from_secs(3600);

/// How long a value must be seen unchanged before it counts as expired: the longer of this reader's
/// lease and the writer's declared one (`declared_ms`, absent from what older releases wrote).
pub fn lease_to_judge(own: Duration, declared_ms: Option<u64>) -> Duration {
    if crate::undo::is(crate::undo::Fix::DeclaredLeases) {
        return own;
    }
    own.max(Duration::from_millis(declared_ms.unwrap_or(0)).min(MAX_DECLARED_LEASE))
}

/// What one reader saw of a set of values (a job's lease by its ETag, a member's renewal stamp):
/// per key, the value last seen, when it was first seen so, and when it was last looked at.
#[derive(Debug)]
pub struct Sightings<K, V> {
    seen: HashMap<K, Sight<V>>,
    /// Keys not looked at for this long are forgotten (a later look starts them afresh, which only
    /// ever delays an expiry).
    forget_after: Duration,
    /// The count of keys past which the forgotten are pruned next (twice what the last pruning
    /// left: pruning stays amortized however many keys a long forget time keeps).
    prune_at: usize,
}

#[derive(Debug)]
struct Sight<V> {
    value: V,
    since: Instant,
    looked: Instant,
}

impl<K: Eq + Hash + Clone, V: PartialEq> Sightings<K, V> {
    /// Sightings that forget keys not looked at for `forget_after` (at least two leases, so that a
    /// value looked at once per lease keeps its age).
    pub fn new(forget_after: Duration) -> Sightings<K, V> {
        Sightings { seen: HashMap::new(), forget_after, prune_at: 64 }
    }

    /// How long `value` of `key` has been seen unchanged, as of `now`: zero at its first sight or
    /// when it differs from the value seen last.
    pub fn age(&mut self, key: &K, value: V, now: Instant) -> Duration {
        if self.seen.len() > self.prune_at {
            let keep = self.forget_after;
            self.seen.retain(|_, s| now.saturating_duration_since(s.looked) < keep);
            self.prune_at = (self.seen.len() * 2).max(64);
        }
        match self.seen.get_mut(key) {
            Some(s) if s.value == value => {
                s.looked = now;
                now.saturating_duration_since(s.since)
            }
            _ => {
                self.seen.insert(key.clone(), Sight { value, since: now, looked: now });
                Duration::ZERO
            }
        }
    }

    /// Forgets `key` (it was written here, or is gone).
    pub fn forget(&mut self, key: &K) {
        self.seen.remove(key);
    }

    /// Keeps only the keys `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.seen.retain(|k, _| keep(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_ages_only_while_it_stays_the_same() {
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        let mut seen: Sightings<&str, u64> = Sightings::new(Duration::from_secs(60));
        assert_eq!(seen.age(&"a", 7, s(0)), Duration::ZERO, "first sight");
        assert_eq!(seen.age(&"a", 7, s(20)), Duration::from_secs(20));
        assert_eq!(seen.age(&"a", 8, s(25)), Duration::ZERO, "renewed");
        assert_eq!(seen.age(&"a", 8, s(40)), Duration::from_secs(15));
        // A value far in the writer's future or past changes nothing: only its sameness counts.
        assert_eq!(seen.age(&"b", u64::MAX, s(40)), Duration::ZERO);
        assert_eq!(seen.age(&"b", u64::MAX, s(75)), Duration::from_secs(35));
        seen.forget(&"b");
        assert_eq!(seen.age(&"b", u64::MAX, s(80)), Duration::ZERO);
    }

    #[test]
    fn keys_not_looked_at_are_forgotten_once_their_count_doubles() {
        let t0 = Instant::now();
        let mut seen: Sightings<u32, u32> = Sightings::new(Duration::from_secs(60));
        // Past 64 keys a pruning finds all of them recent: the next waits for twice as many (130).
        for k in 0..70 {
            seen.age(&k, 0, t0);
        }
        assert_eq!(seen.age(&0, 0, t0 + Duration::from_secs(59)), Duration::from_secs(59), "looked at within the window");
        // Later, new keys: at 131 the keys not looked at for the window are forgotten.
        for k in 1000..1062 {
            seen.age(&k, 0, t0 + Duration::from_secs(100));
        }
        assert_eq!(seen.seen.len(), 63, "key 0 (looked at 59 s) and the 62 new ones");
        assert_eq!(seen.age(&0, 0, t0 + Duration::from_secs(100)), Duration::from_secs(100), "kept: it ages on");
        assert_eq!(seen.age(&5, 0, t0 + Duration::from_secs(100)), Duration::ZERO, "forgotten: starts afresh");
    }
}
