//! Messages held through a store outage, as a state machine: which messages are held (and for which
//! job), when each is due for another visibility extension, when to apply them all again (at once
//! when the store's breaker closes, after a doubling back-off otherwise), and the messages a retry
//! applied whose extension has not lapsed yet. The controller (`controller::aggregate::hold`) does
//! what it says: extends, applies, hands back, shows. Why messages are held rather than dropped is
//! told there.
//!
//! Generic over `H`, a held message's handle, and `V`, a handle that makes a message visible again
//! once it left the hold; the caller passes each event's instant.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::item::Source;

/// A held message is kept invisible this long from each extension ...
pub const HOLD_VISIBILITY: Duration = Duration::from_secs(120);
/// ... and extended again once this long has passed (a retry under way may take a few call
/// deadlines before its messages are held again).
pub const EXTEND_EVERY: Duration = Duration::from_secs(40);
/// Back-off between retries while the store fails (no breaker, or a breaker not yet open).
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(30);

/// A message held, with the queue it came from and its job (`None`: an unreadable message waiting
/// for the quarantine).
pub struct Held<H> {
    pub source: Source,
    pub handle: H,
    pub job: Option<String>,
    extended: Instant,
}

/// The messages held, and when to try them again.
pub struct Hold<H, V> {
    waiting: Vec<Held<H>>,
    retry_at: Instant,
    /// Retries in a row after which messages were held again.
    failures: u32,
    /// Messages a retry took out of the hold and applied, and when their last extension lapses.
    retried: Vec<(V, Instant)>,
}

/// How a retry ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retried {
    /// Nothing was held again: the back-off starts over.
    Cleared,
    /// `held` messages were held again; the next retry comes after `next_in`.
    HeldAgain { held: usize, next_in: Duration },
}

impl<H, V> Hold<H, V> {
    pub fn new(now: Instant) -> Hold<H, V> {
        Hold { waiting: Vec::new(), retry_at: now, failures: 0, retried: Vec::new() }
    }

    /// Holds `msgs` at `now` (their visibility just extended by the caller: see [`HOLD_VISIBILITY`]);
    /// the first held after an empty hold sets the retry after the back-off. Returns how many are held.
    pub fn hold(&mut self, msgs: Vec<(Source, H, Option<String>)>, now: Instant) -> usize {
        if self.waiting.is_empty() {
            self.retry_at = now + retry_delay(self.failures);
        }
        self.waiting.extend(msgs.into_iter().map(|(source, handle, job)| Held { source, handle, job, extended: now }));
        self.waiting.len()
    }

    /// Messages held now, in all (`None`) or from one source.
    pub fn held(&self, source: Option<Source>) -> usize {
        self.waiting.iter().filter(|w| source.is_none_or(|s| s == w.source)).count()
    }

    /// The jobs that have messages held.
    pub fn jobs(&self) -> BTreeSet<String> {
        self.waiting.iter().filter_map(|w| w.job.clone()).collect()
    }

    /// Takes out of the hold the messages `ours` picks (to go back to their queue at once).
    pub fn hand_back(&mut self, ours: impl Fn(&H) -> bool) -> Vec<H> {
        let (back, keep): (Vec<Held<H>>, Vec<Held<H>>) = std::mem::take(&mut self.waiting).into_iter().partition(|w| ours(&w.handle));
        self.waiting = keep;
        back.into_iter().map(|w| w.handle).collect()
    }

    /// The held messages due for another extension at `now` (their extension is taken as done).
    pub fn due_for_extension(&mut self, now: Instant) -> Vec<&H> {
        let due = self.waiting.iter_mut().filter(|w| now.saturating_duration_since(w.extended) >= EXTEND_EVERY);
        due.map(|w| {
            w.extended = now;
            &w.handle
        })
        .collect()
    }

    /// Takes every held message out to be applied again, when it is time at `now`: the back-off has
    /// passed and the store's breaker is not open (while it is, the retry comes as soon as it
    /// closes). Nothing when it is not time.
    pub fn take_for_retry(&mut self, now: Instant, breaker_open: bool) -> Vec<Held<H>> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        if breaker_open {
            self.retry_at = now;
            return Vec::new();
        }
        if now < self.retry_at {
            return Vec::new();
        }
        std::mem::take(&mut self.waiting)
    }

    /// A retry taken at `extended` ended at `now`, having applied the messages `retried` makes
    /// visible again (kept until their extension lapses); what failed again is held by now.
    pub fn retry_ended(&mut self, retried: Vec<V>, extended: Instant, now: Instant) -> Retried {
        let lapse = extended + HOLD_VISIBILITY;
        self.retried.retain(|(_, until)| *until > now);
        self.retried.extend(retried.into_iter().map(|v| (v, lapse)));
        if self.waiting.is_empty() {
            self.failures = 0;
            Retried::Cleared
        } else {
            self.failures = self.failures.saturating_add(1);
            let next_in = retry_delay(self.failures);
            self.retry_at = now + next_in;
            Retried::HeldAgain { held: self.waiting.len(), next_in }
        }
    }

    /// The messages retries applied whose extension has not lapsed at `now` (all are forgotten).
    pub fn take_unlapsed(&mut self, now: Instant) -> Vec<V> {
        std::mem::take(&mut self.retried).into_iter().filter(|(_, until)| *until > now).map(|(v, _)| v).collect()
    }
}

/// The wait before the next retry after `failures` retries in a row held messages again: doubling from
/// a second, at most half a minute.
fn retry_delay(failures: u32) -> Duration {
    FIRST_RETRY.saturating_mul(1u32 << failures.min(8)).min(MAX_RETRY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_retry_comes_after_a_doubling_back_off_and_at_once_when_the_breaker_closes() {
        let t0 = Instant::now();
        let mut h: Hold<u32, u32> = Hold::new(t0);
        assert_eq!(h.hold(vec![(Source::Results, 1, Some("j".into())), (Source::WorkDeadLetter, 2, None)], t0), 2);
        assert_eq!((h.held(None), h.held(Some(Source::Results))), (2, 1));
        assert_eq!(h.jobs(), BTreeSet::from(["j".to_string()]));
        assert!(h.take_for_retry(t0 + Duration::from_millis(999), false).is_empty(), "a second's back-off first");
        let taken = h.take_for_retry(t0 + secs(1), false);
        assert_eq!(taken.iter().map(|w| w.handle).collect::<Vec<_>>(), [1, 2]);
        // Both fail again: held again, the next retry two seconds on, then four.
        h.hold(taken.into_iter().map(|w| (w.source, w.handle, w.job)).collect(), t0 + secs(2));
        assert_eq!(h.retry_ended(vec![], t0 + secs(1), t0 + secs(2)), Retried::HeldAgain { held: 2, next_in: secs(2) });
        assert!(h.take_for_retry(t0 + secs(3), false).is_empty());
        let taken = h.take_for_retry(t0 + secs(4), false);
        h.hold(taken.into_iter().map(|w| (w.source, w.handle, w.job)).collect(), t0 + secs(5));
        assert_eq!(h.retry_ended(vec![], t0 + secs(4), t0 + secs(5)), Retried::HeldAgain { held: 2, next_in: secs(4) });
        // The breaker opens: no retry while it is open, one as soon as it closes.
        assert!(h.take_for_retry(t0 + secs(6), true).is_empty());
        assert_eq!(h.take_for_retry(t0 + secs(6), false).len(), 2, "at once after the breaker closed");
        assert_eq!(h.retry_ended(vec![7], t0 + secs(6), t0 + secs(8)), Retried::Cleared);
        // Cleared: the back-off starts over.
        h.hold(vec![(Source::Results, 3, None)], t0 + secs(10));
        assert!(h.take_for_retry(t0 + secs(10), false).is_empty());
        assert_eq!(h.take_for_retry(t0 + secs(11), false).len(), 1);
    }

    #[test]
    fn the_back_off_is_capped() {
        assert_eq!(retry_delay(0), secs(1));
        assert_eq!(retry_delay(4), secs(16));
        assert_eq!(retry_delay(5), MAX_RETRY);
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY);
    }

    #[test]
    fn held_messages_are_extended_when_due_and_handed_back_by_partition() {
        let t0 = Instant::now();
        let mut h: Hold<u32, u32> = Hold::new(t0);
        h.hold(vec![(Source::Results, 1, None), (Source::Results, 2, None)], t0);
        h.hold(vec![(Source::Results, 3, None)], t0 + secs(30));
        assert!(h.due_for_extension(t0 + secs(39)).is_empty());
        assert_eq!(h.due_for_extension(t0 + secs(40)), [&1, &2]);
        assert!(h.due_for_extension(t0 + secs(41)).is_empty(), "extended at 40 s");
        assert_eq!(h.due_for_extension(t0 + secs(70)), [&3]);
        assert_eq!(h.hand_back(|m| m % 2 == 1), [1, 3]);
        assert_eq!(h.held(None), 1);
    }

    #[test]
    fn messages_a_retry_applied_are_kept_until_their_extension_lapses() {
        let t0 = Instant::now();
        let mut h: Hold<u32, &str> = Hold::new(t0);
        h.hold(vec![(Source::Results, 1, None)], t0);
        let taken = h.take_for_retry(t0 + secs(1), false);
        assert_eq!(taken.len(), 1);
        h.retry_ended(vec!["first"], t0 + secs(1), t0 + secs(2));
        assert_eq!(h.take_unlapsed(t0 + secs(1) + HOLD_VISIBILITY - secs(1)), ["first"]);
        assert!(h.take_unlapsed(t0 + secs(3)).is_empty(), "taken once");
        h.retry_ended(vec!["second"], t0 + secs(3), t0 + secs(4));
        assert!(h.take_unlapsed(t0 + secs(3) + HOLD_VISIBILITY).is_empty(), "lapsed: visible again by itself");
    }
}
