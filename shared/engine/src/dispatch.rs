//! Dispatch: takes ready messages from the throttle (priority order, FIFO groups one at a time), runs
//! the handler on them in batches as work tasks, and turns each outcome into its completion (delete,
//! release after a delay, retry with back-off, poison on the last receive). A delivery a dependency's
//! outage stopped (`Outcome::Unavailable`) is held in its slot, its visibility kept by the heartbeat,
//! and handled again once the dependency's breaker closes: an outage spends no receive count and
//! poisons nothing. Expired messages are handed to `expiry`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use fleet_io::breaker::{all_closed, any_open};
use fleet_io::queue::Delivery;

use crate::consumer::fifo_group;
use crate::expiry::expire;
use crate::{bump, lock, release, sleep_until, Inner, Outcome};

/// Marks a batch's messages finished in the throttle even if the handler panics.
pub(crate) struct Running {
    inner: Arc<Inner>,
    groups: Vec<Option<String>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut t = lock(&self.inner.throttle);
        let back: Vec<Delivery> = self.groups.iter().flat_map(|g| t.finish(g.as_deref())).collect();
        drop(t);
        for m in back {
            release(&self.inner, m, Duration::ZERO);
        }
        self.inner.dispatch.notify_one();
        self.inner.room.notify_waiters();
    }
}

pub(crate) async fn dispatch_loop(inner: Arc<Inner>) {
    let batch = inner.handler.batch_size().max(1);
    loop {
        let notified = inner.dispatch.notified();
        let (ready, expired, next) = {
            let mut t = lock(&inner.throttle);
            let expired = t.expire(Instant::now());
            let mut ready = Vec::new();
            while let Some(x) = t.pop_ready() {
                ready.push(x);
            }
            (ready, expired, t.next_expiry())
        };
        if !expired.is_empty() {
            inner.room.notify_waiters();
        }
        for m in expired {
            inner.work_tasks.spawn(expire(inner.clone(), m));
        }
        let mut ready = ready.into_iter().peekable();
        while ready.peek().is_some() {
            let (msgs, groups): (Vec<Delivery>, Vec<Option<String>>) = ready.by_ref().take(batch).unzip();
            let running = Running { inner: inner.clone(), groups };
            inner.work_tasks.spawn(process(inner.clone(), msgs, running));
        }
        tokio::select! {
            _ = inner.stop_all.cancelled() => return,
            _ = notified => {}
            _ = sleep_until(next) => {}
        }
    }
}

pub(crate) async fn process(inner: Arc<Inner>, mut msgs: Vec<Delivery>, running: Running) {
    // Deliveries a dependency's outage stopped, and how often in a row none of the breakers was open
    // when that happened.
    let mut unopened: u32 = 0;
    loop {
        // Every delivery handed over leaves the heartbeat when the handler returns, given back or kept
        // (a kept one is completed soon, e.g. by the next checkpoint, or comes back by its timeout),
        // except those held through an outage.
        let receipts: Vec<String> = msgs.iter().map(|m| m.receipt().to_string()).collect();
        let handed = msgs.len();
        let given_back = inner.handler.handle(msgs, &inner.completions).await;
        let (held, given_back): (Vec<_>, Vec<_>) = given_back.into_iter().partition(|(_, o)| matches!(o, Outcome::Unavailable(_)));
        {
            let mut hb = lock(&inner.heartbeat);
            let now = Instant::now();
            for r in &receipts {
                if held.iter().any(|(m, _)| m.receipt() == r) {
                    // Waiting out an outage is not processing: its clock starts again.
                    hb.restart(r, now);
                } else {
                    hb.untrack(r);
                }
            }
        }
        // A handler may give back deliveries of earlier batches (kept ones it completes now).
        bump(&inner.stats.processed, handed.saturating_sub(held.len() + given_back.len()) as u64);
        for (m, outcome) in given_back {
            complete(&inner, m, outcome).await;
        }
        if held.is_empty() {
            break;
        }
        let open = any_open(&inner.breakers);
        unopened = if open { 0 } else { unopened + 1 };
        let reason = match &held[0].1 {
            Outcome::Unavailable(r) => r.clone(),
            _ => String::new(),
        };
        if unopened > HELD_WITHOUT_OUTAGE {
            // The dependency answers everyone else: this one's failures are its own.
            tracing::warn!(queue = inner.queue.name(), held = held.len(), %reason, "a dependency keeps failing for these messages only: treated as failures");
            for (m, o) in held {
                let Outcome::Unavailable(reason) = o else { continue };
                complete(&inner, m, Outcome::Failed(reason)).await;
            }
            break;
        }
        msgs = held.into_iter().map(|(m, _)| m).collect();
        bump(&inner.stats.held, msgs.len() as u64);
        tracing::info!(
            queue = inner.queue.name(), held = msgs.len(), dependency_down = open, %reason,
            "a dependency failed: holding the messages (visibility kept, receive count unspent) until it answers"
        );
        let wait = async {
            if open {
                all_closed(&inner.breakers).await;
                // Not every held batch at the same instant.
                tokio::time::sleep(Duration::from_millis(rand::random_range(0..1000))).await;
            } else {
                tokio::time::sleep(inner.cfg.retry.delay(unopened).min(HELD_RETRY_CAP)).await;
            }
        };
        inner.holding.fetch_add(msgs.len(), Ordering::SeqCst);
        let stopped = tokio::select! {
            _ = wait => false,
            _ = inner.stop_receiving.cancelled() => true,
        };
        inner.holding.fetch_sub(msgs.len(), Ordering::SeqCst);
        if stopped {
            // A drain: they go back now, their receive count unspent beyond this one.
            for m in msgs {
                release(&inner, m, Duration::ZERO);
            }
            break;
        }
    }
    drop(running);
}

/// Consecutive failures of a dependency, none with an open breaker, that a held message waits out
/// before they count as its own failure.
const HELD_WITHOUT_OUTAGE: u32 = 5;
/// Longest wait between tries of a held message while no breaker is open.
const HELD_RETRY_CAP: Duration = Duration::from_secs(30);

/// Completes a delivery the handler gave back.
async fn complete(inner: &Arc<Inner>, m: Delivery, outcome: Outcome) {
    match outcome {
        Outcome::Done => {
            bump(&inner.stats.processed, 1);
            inner.completions.delete(m);
        }
        Outcome::Release(after) => inner.completions.release(m, after),
        // Handled by `process` (held); as a failure when it gets here.
        Outcome::Failed(reason) | Outcome::Unavailable(reason) => {
            bump(&inner.stats.failed, 1);
            let last = inner.info.max_receive_count.is_some_and(|max| m.receive_count >= max);
            let delay = if last {
                inner.handler.on_poison(&m, &reason).await;
                Duration::ZERO
            } else {
                inner.cfg.retry.delay(m.receive_count)
            };
            tracing::warn!(
                queue = inner.queue.name(), message_id = %m.id, receive_count = m.receive_count, last_attempt = last,
                retry_in_s = delay.as_secs(), %reason, "message failed"
            );
            // FIFO: the group's later messages must not overtake it; they go back too, and become
            // visible no later than it (a visible message behind an invisible one of its group
            // could be received first): a second earlier on a delayed retry, right after it on
            // the last attempt.
            let successors = match fifo_group(inner, &m) {
                Some(g) => lock(&inner.throttle).take_group(&g),
                None => Vec::new(),
            };
            let ahead = if delay > Duration::from_secs(1) { delay - Duration::from_secs(1) } else { delay };
            if delay.is_zero() {
                inner.completions.release(m, delay);
                for b in successors {
                    release(inner, b, ahead);
                }
            } else {
                for b in successors {
                    release(inner, b, ahead);
                }
                inner.completions.release(m, delay);
            }
        }
    }
}
