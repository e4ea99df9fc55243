//! Visibility heartbeat: a message still in hand (buffered or being processed) when half its visibility
//! timeout has passed is extended by another full timeout, batched across messages with
//! ChangeMessageVisibilityBatch, until it is done or the maximum processing time has passed (after that
//! it is let go: it comes back and is processed again, idempotently).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::events;
use crate::{lock, sleep_until, ErrorEvent};

struct Tracked {
    received: Instant,
    /// When the message's visibility was last set to a full timeout.
    extended: Instant,
}

/// The messages in hand and when they need extending.
pub struct Heartbeat {
    visibility: Duration,
    max_processing: Duration,
    entries: HashMap<String, Tracked>,
}

/// What is due at a heartbeat.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Due {
    /// Extend these by a full visibility timeout.
    pub extend: Vec<String>,
    /// These passed the maximum processing time: no longer extended.
    pub overdue: Vec<String>,
}

impl Heartbeat {
    pub fn new(visibility: Duration, max_processing: Duration) -> Heartbeat {
        Heartbeat { visibility: visibility.max(Duration::from_secs(1)), max_processing, entries: HashMap::new() }
    }

    pub fn visibility(&self) -> Duration {
        self.visibility
    }

    /// A message was received at `now`.
    pub fn track(&mut self, receipt: &str, now: Instant) {
        self.entries.insert(receipt.to_string(), Tracked { received: now, extended: now });
    }

    /// A message stays in hand but its processing clock starts again at `now` (it waited out an
    /// outage: not processing); its extensions go on as scheduled.
    pub fn restart(&mut self, receipt: &str, now: Instant) {
        if let Some(t) = self.entries.get_mut(receipt) {
            t.received = now;
        }
    }

    /// A message is done (deleted, released, or handed to a later completion).
    pub fn untrack(&mut self, receipt: &str) {
        self.entries.remove(receipt);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn half(&self) -> Duration {
        self.visibility / 2
    }

    /// When the next extension is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.entries.values().map(|t| (t.extended + self.half()).min(t.received + self.max_processing)).min()
    }

    /// Takes what is due at `now`: the extended ones count as extended from now.
    pub fn due(&mut self, now: Instant) -> Due {
        let mut due = Due::default();
        let half = self.half();
        let max = self.max_processing;
        self.entries.retain(|receipt, t| {
            if now.duration_since(t.received) >= max {
                due.overdue.push(receipt.clone());
                return false;
            }
            if now.duration_since(t.extended) >= half {
                t.extended = now;
                due.extend.push(receipt.clone());
            }
            true
        });
        due.extend.sort();
        due.overdue.sort();
        due
    }
}

/// The heartbeat task: extends the visibility of messages in hand at half the timeout (one batched
/// ChangeMessageVisibility per due message) until their maximum processing time, then reports them
/// overdue through the error hook.
pub(crate) async fn heartbeat_loop(inner: Arc<crate::Inner>) {
    loop {
        let notified = inner.in_hand.changed.notified();
        let (due, next, visibility) = {
            let mut hb = lock(&inner.in_hand.schedule);
            let due = hb.due(Instant::now());
            (due, hb.next_due(), hb.visibility())
        };
        events::VisibilityExtended { queue: inner.queue.name(), messages: due.extend.len() }.emit(&inner.observed.stats);
        for r in due.extend {
            inner.completions.extend(&r, visibility);
        }
        for r in &due.overdue {
            inner.handler.on_error(ErrorEvent::Overdue { receipt: r });
            events::Overdue { queue: inner.queue.name() }.emit();
        }
        tokio::select! {
            biased;
            _ = inner.lifecycle.stop_all.cancelled() => return,
            _ = notified => {}
            _ = sleep_until(next) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extends_at_half_visibility_until_max_processing() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = Heartbeat::new(s(30), s(100));
        h.track("a", t0);
        h.track("b", t0 + s(10));
        assert_eq!(h.next_due(), Some(t0 + s(15)));
        assert_eq!(h.due(t0 + s(14)), Due::default());
        assert_eq!(h.due(t0 + s(15)).extend, vec!["a"]);
        assert_eq!(h.next_due(), Some(t0 + s(25)), "b is due 15 s after its receive");
        assert_eq!(h.due(t0 + s(25)).extend, vec!["b"]);
        // a: extended at 15, due again at 30.
        assert_eq!(h.due(t0 + s(30)).extend, vec!["a"]);
        h.untrack("b");
        // a keeps being extended every 15 s until 100 s after its receive.
        let mut extended_at = Vec::new();
        let mut t = t0 + s(30);
        while let Some(next) = h.next_due() {
            t = next.max(t);
            let d = h.due(t);
            if !d.extend.is_empty() {
                extended_at.push(t.duration_since(t0).as_secs());
            }
            if !d.overdue.is_empty() {
                assert_eq!(d.overdue, vec!["a"]);
                assert_eq!(t.duration_since(t0), s(100));
            }
        }
        assert_eq!(extended_at, vec![45, 60, 75, 90]);
        assert!(h.is_empty());
    }
}
