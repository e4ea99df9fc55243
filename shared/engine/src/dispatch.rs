//! Dispatch: takes ready messages from the throttle (priority order, FIFO groups one at a time), runs
//! the handler on them in batches as work tasks, and turns each outcome into its completion (delete,
//! release after a delay, retry with back-off, poison on the last receive). Expired messages are
//! handed to `expiry`.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

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

pub(crate) async fn process(inner: Arc<Inner>, msgs: Vec<Delivery>, running: Running) {
    // Every delivery handed over leaves the heartbeat when the handler returns, given back or kept (a
    // kept one is completed soon, e.g. by the next checkpoint, or comes back by its timeout).
    let receipts: Vec<String> = msgs.iter().map(|m| m.receipt().to_string()).collect();
    let handed = msgs.len();
    let given_back = inner.handler.handle(msgs, &inner.completions).await;
    {
        let mut hb = lock(&inner.heartbeat);
        for r in &receipts {
            hb.untrack(r);
        }
    }
    bump(&inner.stats.processed, handed.saturating_sub(given_back.len()) as u64);
    for (m, outcome) in given_back {
        match outcome {
            Outcome::Done => {
                bump(&inner.stats.processed, 1);
                inner.completions.delete(m);
            }
            Outcome::Release(after) => inner.completions.release(m, after),
            Outcome::Failed(reason) => {
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
                let successors = match fifo_group(&inner, &m) {
                    Some(g) => lock(&inner.throttle).take_group(&g),
                    None => Vec::new(),
                };
                let ahead = if delay > Duration::from_secs(1) { delay - Duration::from_secs(1) } else { delay };
                if delay.is_zero() {
                    inner.completions.release(m, delay);
                    for b in successors {
                        release(&inner, b, ahead);
                    }
                } else {
                    for b in successors {
                        release(&inner, b, ahead);
                    }
                    inner.completions.release(m, delay);
                }
            }
        }
    }
    drop(running);
}
