//! Dispatch: takes ready messages from the throttle (priority order, FIFO groups one at a time), runs
//! the handler on them in batches as work tasks, and turns each outcome into its completion (delete,
//! release after a delay, retry with back-off, poison on the last receive; on a FIFO queue a failed
//! delivery is retried in place and dead-lettered by the listener on its last attempt, so that its
//! group's later messages never go back with it). A delivery a dependency's
//! outage stopped (`Outcome::Unavailable`) is held in its slot, its visibility kept by the heartbeat,
//! and handled again once the dependency's breaker closes: an outage spends no receive count and
//! poisons nothing. Expired messages are handed to `expiry`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use fleet_io::breaker::{all_closed, any_open};
use fleet_io::queue::Delivery;

use crate::consumer::fifo_group;
use crate::events;
use crate::expiry::expire;
use crate::{lock, release, sleep_until, Inner, Outcome};

/// Marks a batch's messages finished in the throttle even if the handler panics.
pub(crate) struct Running {
    inner: Arc<Inner>,
    groups: Vec<Option<String>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut t = lock(&self.inner.buffer.throttle);
        let back: Vec<Delivery> = self.groups.iter().flat_map(|g| t.finish(g.as_deref())).collect();
        drop(t);
        for m in back {
            release(&self.inner, m, Duration::ZERO);
        }
        self.inner.buffer.changed();
    }
}

pub(crate) async fn dispatch_loop(inner: Arc<Inner>) {
    let batch = inner.handler.batch_size().max(1);
    loop {
        let notified = inner.buffer.dispatch.notified();
        let (ready, expired, next) = {
            let mut t = lock(&inner.buffer.throttle);
            let expired = t.expire(Instant::now());
            let mut ready = Vec::new();
            while let Some(x) = t.pop_ready() {
                ready.push(x);
            }
            (ready, expired, t.next_expiry())
        };
        if !expired.is_empty() {
            inner.buffer.room.notify_waiters();
        }
        for m in expired {
            inner.lifecycle.work_tasks.spawn(expire(inner.clone(), m));
        }
        let mut ready = ready.into_iter().peekable();
        while ready.peek().is_some() {
            let (msgs, groups): (Vec<Delivery>, Vec<Option<String>>) = ready.by_ref().take(batch).unzip();
            let running = Running { inner: inner.clone(), groups };
            inner.lifecycle.work_tasks.spawn(process(inner.clone(), msgs, running));
        }
        tokio::select! {
            biased;
            _ = inner.lifecycle.stop_all.cancelled() => return,
            _ = notified => {}
            _ = sleep_until(next) => {}
        }
    }
}

pub(crate) async fn process(inner: Arc<Inner>, mut msgs: Vec<Delivery>, running: Running) {
    // Deliveries a dependency's outage stopped, and how often in a row none of the breakers was open
    // when that happened.
    let mut unopened: u32 = 0;
    // FIFO deliveries that failed here and are tried again in place: failures so far, by receipt.
    let mut tried: HashMap<String, u32> = HashMap::new();
    loop {
        // Every delivery handed over leaves the heartbeat when the handler returns, given back or kept
        // (a kept one is completed soon, e.g. by the next checkpoint, or comes back by its timeout),
        // except those held through an outage or retried in place.
        let receipts: Vec<String> = msgs.iter().map(|m| m.receipt().to_string()).collect();
        let handed = msgs.len();
        let started = Instant::now();
        let given_back = inner.handler.handle(msgs, &inner.completions).await;
        crate::metrics::observe_handling(inner.queue.name(), handed, started.elapsed().as_secs_f64());
        let (held, given_back): (Vec<_>, Vec<_>) = given_back.into_iter().partition(|(_, o)| matches!(o, Outcome::Unavailable(_)));
        let (mut again, given_back): (Vec<_>, Vec<_>) = given_back.into_iter().partition(|(m, o)| retry_in_place(&inner, m, o, &tried));
        {
            let mut hb = lock(&inner.in_hand.schedule);
            let now = Instant::now();
            for r in &receipts {
                if held.iter().chain(&again).any(|(m, _)| m.receipt() == r) {
                    // Waiting out an outage or a back-off is not processing: its clock starts again.
                    hb.restart(r, now);
                } else {
                    hb.untrack(r);
                }
            }
        }
        // A handler may give back deliveries of earlier batches (kept ones it completes now).
        let processed = handed.saturating_sub(held.len() + given_back.len() + again.len()) as u64;
        events::Processed { queue: inner.queue.name(), messages: processed }.emit(&inner.observed.stats);
        for (m, outcome) in given_back {
            let attempt = attempt(&m, &tried);
            complete(&inner, m, outcome, attempt).await;
        }
        let mut outage = None;
        if !held.is_empty() {
            let open = any_open(&inner.breakers);
            unopened = if open { 0 } else { unopened + 1 };
            let reason = match &held[0].1 {
                Outcome::Unavailable(r) => r.clone(),
                _ => String::new(),
            };
            if unopened > HELD_WITHOUT_OUTAGE {
                // The dependency answers everyone else: this one's failures are its own.
                events::HeldFailing { queue: inner.queue.name(), held: held.len(), reason: &reason }.emit();
                for (m, o) in held {
                    let Outcome::Unavailable(reason) = o else { continue };
                    let failed = Outcome::Failed(reason);
                    if retry_in_place(&inner, &m, &failed, &tried) {
                        again.push((m, failed));
                    } else {
                        let attempt = attempt(&m, &tried);
                        complete(&inner, m, failed, attempt).await;
                    }
                }
            } else {
                events::DeliveriesHeld { queue: inner.queue.name(), held: held.len(), dependency_down: open, reason: &reason }.emit(&inner.observed.stats);
                outage = Some((open, held));
            }
        }
        if outage.is_none() && again.is_empty() {
            break;
        }
        // The back-off of the earliest retry in place.
        let mut back_off: Option<Duration> = None;
        for (m, o) in &again {
            let failures = tried.entry(m.receipt().to_string()).or_default();
            *failures += 1;
            let attempt = m.receive_count + *failures;
            let delay = inner.cfg.retry.delay(attempt - 1);
            back_off = Some(back_off.map_or(delay, |b| b.min(delay)));
            let reason = match o {
                Outcome::Failed(r) => r.as_str(),
                _ => "",
            };
            events::RetriedInPlace { queue: inner.queue.name(), message_id: &m.id, receive_count: m.receive_count, attempt, retry_in: delay, reason }
                .emit(&inner.observed.stats);
        }
        let open = outage.as_ref().is_some_and(|(open, _)| *open);
        let waits_outage = outage.is_some();
        msgs = outage.map(|(_, held)| held).unwrap_or_default().into_iter().chain(again).map(|(m, _)| m).collect();
        let wait = async {
            if open {
                all_closed(&inner.breakers).await;
                // Not every held batch at the same instant.
                tokio::time::sleep(Duration::from_millis(fleet_io::jitter::u64_in(0..1000))).await;
            } else if waits_outage {
                tokio::time::sleep(inner.cfg.retry.delay(unopened).min(HELD_RETRY_CAP)).await;
            } else {
                tokio::time::sleep(back_off.unwrap_or_default()).await;
            }
        };
        inner.observed.holding.fetch_add(msgs.len(), Ordering::SeqCst);
        let stopped = tokio::select! {
            biased;
            _ = wait => false,
            _ = inner.lifecycle.stop_receiving.cancelled() => true,
        };
        inner.observed.holding.fetch_sub(msgs.len(), Ordering::SeqCst);
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

/// Which attempt this is of a delivery: its receive count plus its failures retried in place.
fn attempt(m: &Delivery, tried: &HashMap<String, u32>) -> u32 {
    m.receive_count + tried.get(m.receipt()).copied().unwrap_or(0)
}

/// Whether a failed delivery is tried again here rather than given back: on a FIFO queue, while
/// attempts are left. Given back, it would take its group's later messages with it, and each of
/// them would spend a receive on every retry until the queue's redrive dead-lettered them too
/// (found by the fleet simulation on a FIFO work queue: a poison chunk took the chunks behind it in
/// its account partition to the dead-letter queue, and the job ended `partial` with them).
fn retry_in_place(inner: &Inner, m: &Delivery, outcome: &Outcome, tried: &HashMap<String, u32>) -> bool {
    matches!(outcome, Outcome::Failed(_)) && fifo_group(inner, m).is_some() && !last_attempt(inner, attempt(m, tried))
}

fn last_attempt(inner: &Inner, attempt: u32) -> bool {
    inner.info.max_receive_count.is_some_and(|max| attempt >= max)
}

/// Consecutive failures of a dependency, none with an open breaker, that a held message waits out
/// before they count as its own failure.
const HELD_WITHOUT_OUTAGE: u32 = 5;
/// Longest wait between tries of a held message while no breaker is open.
const HELD_RETRY_CAP: Duration = Duration::from_secs(30);

/// Completes a delivery the handler gave back.
async fn complete(inner: &Arc<Inner>, m: Delivery, outcome: Outcome, attempt: u32) {
    match outcome {
        Outcome::Done => {
            events::Processed { queue: inner.queue.name(), messages: 1 }.emit(&inner.observed.stats);
            inner.completions.delete(m);
        }
        Outcome::Release(after) => inner.completions.release(m, after),
        // Handled by `process` (held, or retried in place); as a failure when it gets here.
        Outcome::Failed(reason) | Outcome::Unavailable(reason) => {
            let last = last_attempt(inner, attempt);
            let delay = if last { Duration::ZERO } else { inner.cfg.retry.delay(attempt) };
            events::MessageFailed {
                queue: inner.queue.name(),
                message_id: &m.id,
                receive_count: m.receive_count,
                attempt,
                last_attempt: last,
                retry_in: delay,
                reason: &reason,
            }
            .emit(&inner.observed.stats);
            if last {
                inner.handler.on_poison(&m, &reason).await;
            }
            let group = fifo_group(inner, &m);
            // FIFO, last attempt: to the dead-letter queue now, so that the group's later messages
            // go on in order without going back (each would spend a receive).
            let m = match (&group, &inner.dead_letter) {
                (Some(_), Some(dlq)) if last => {
                    let receipt = m.receipt().to_string();
                    match m.dead_letter(inner.queue.as_ref(), dlq.as_ref(), "failed").await {
                        Ok(()) => {
                            inner.in_hand.untrack(&receipt);
                            return;
                        }
                        Err((e, m)) => {
                            events::DeadLetterFailed { queue: inner.queue.name(), why: "failed", error: &e }.emit();
                            m
                        }
                    }
                }
                _ => m,
            };
            // FIFO (its last attempt, not dead-lettered here): the group's later messages must not
            // overtake it; they go back right after it. (A FIFO failure with attempts left is
            // retried in place by `process` and never gets here.)
            let successors = match group {
                Some(g) => lock(&inner.buffer.throttle).take_group(&g),
                None => Vec::new(),
            };
            inner.completions.release(m, delay);
            for b in successors {
                release(inner, b, Duration::ZERO);
            }
        }
    }
}
