//! In-memory queue and blob store with SQS/S3 semantics (visibility timeouts, receive counts,
//! dead-letter redrive, long polls, and on a queue named `*.fifo` per-group order and the 5-minute
//! de-duplication window), for fast deterministic tests. They use tokio's clock, so tests can run
//! them under paused time. Never a substitute for the real services in integration tests.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::call::CallCounter;
use crate::error::Result;
use crate::op::Op;
use crate::queue::{plan_batches, Attrs, Delivery, Message, Outgoing, Queue, QueueDepth, QueueInfo, Receipt};

struct Stored {
    id: String,
    body: String,
    attrs: Attrs,
    receive_count: u32,
    /// When it was sent (Unix ms), as SQS's `SentTimestamp`.
    sent_ms: u64,
    visible_at: Instant,
    /// Receipt of the current receive; stale receipts are ignored.
    receipt: Option<String>,
}

struct State {
    messages: VecDeque<Stored>,
    next_id: u64,
    /// FIFO: de-duplication ids (the body's hash, as the SQS backend sends them) and when each was
    /// first sent; a send of the same id within [`DEDUP_WINDOW`] is accepted and dropped.
    /// De-duplication ids (hashed) sent within the window, with when.
    sent: VecDeque<(u128, Instant)>,
}

/// SQS FIFO's de-duplication interval.
pub const DEDUP_WINDOW: Duration = Duration::from_secs(300);

/// An in-memory queue.
pub struct MemoryQueue {
    name: String,
    visibility: Duration,
    redrive: Option<(u32, Arc<MemoryQueue>)>,
    state: Mutex<State>,
    arrived: Notify,
    calls: CallCounter,
    /// Entries of batch calls (delete, visibility) still to fail, for tests of partial batch failures.
    fail_entries: std::sync::atomic::AtomicUsize,
    /// Simulated round-trip time of a receive call.
    latency: Mutex<Duration>,
    /// Visibility calls still to answer late, and how late (the change lands when the answer comes).
    slow_changes: Mutex<(usize, Duration)>,
}

impl MemoryQueue {
    pub fn new(name: &str, visibility: Duration) -> Arc<MemoryQueue> {
        Self::build(name, visibility, None)
    }

    /// A queue whose messages move to `dlq` when received more than `max_receive` times.
    pub fn with_dlq(name: &str, visibility: Duration, max_receive: u32, dlq: Arc<MemoryQueue>) -> Arc<MemoryQueue> {
        Self::build(name, visibility, Some((max_receive, dlq)))
    }

    fn build(name: &str, visibility: Duration, redrive: Option<(u32, Arc<MemoryQueue>)>) -> Arc<MemoryQueue> {
        Arc::new(MemoryQueue {
            name: name.to_string(),
            visibility,
            redrive,
            state: Mutex::new(State { messages: VecDeque::new(), next_id: 0, sent: VecDeque::new() }),
            arrived: Notify::new(),
            calls: CallCounter::default(),
            fail_entries: Default::default(),
            latency: Mutex::new(Duration::ZERO),
            slow_changes: Mutex::new((0, Duration::ZERO)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::lock(&self.state)
    }

    /// Makes every receive call take `d` before it looks at the queue (a network round trip).
    pub fn set_latency(&self, d: Duration) {
        *crate::lock(&self.latency) = d;
    }

    /// Makes the next `n` visibility calls land (and answer) `d` late, as a call in flight does.
    pub fn delay_next_changes(&self, n: usize, d: Duration) {
        *crate::lock(&self.slow_changes) = (n, d);
    }

    /// Makes the next `n` entries of batch calls fail (as SQS reports failed entries).
    pub fn fail_next_entries(&self, n: usize) {
        self.fail_entries.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    fn entry_fails(&self) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.fail_entries.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok()
    }

    /// Receipts of the messages currently received and not yet visible again (for assertions).
    pub fn in_flight(&self) -> usize {
        let now = Instant::now();
        self.lock().messages.iter().filter(|m| m.visible_at > now).count()
    }

    /// How much longer the message received with `receipt` stays invisible; `None` when the receipt
    /// is no longer its message's latest (deleted, or received again since: SQS refuses it then).
    pub fn hidden_for(&self, receipt: &str) -> Option<Duration> {
        let now = Instant::now();
        self.lock().messages.iter().find(|m| m.receipt.as_deref() == Some(receipt)).map(|m| m.visible_at.saturating_duration_since(now))
    }

    fn push(&self, body: String, attrs: Attrs, receive_count: u32) {
        let mut s = self.lock();
        s.next_id += 1;
        let id = format!("m{}", s.next_id);
        s.messages.push_back(Stored { id, body, attrs, receive_count, sent_ms: crate::queue::unix_ms(), visible_at: Instant::now(), receipt: None });
        drop(s);
        self.arrived.notify_waiters();
    }

    /// Whether a message with this body is to be kept: always on a standard queue; on a FIFO queue,
    /// unless the same de-duplication id was sent within the window (SQS accepts such a send and
    /// drops it).
    fn first_send(&self, m: &Outgoing) -> bool {
        if !self.name.ends_with(".fifo") {
            return true;
        }
        let id = xxhash_rust::xxh3::xxh3_128(m.dedup_id().as_bytes());
        let now = Instant::now();
        let mut s = self.lock();
        while s.sent.front().is_some_and(|(_, at)| now.duration_since(*at) >= DEDUP_WINDOW) {
            s.sent.pop_front();
        }
        if s.sent.iter().any(|(d, _)| *d == id) {
            return false;
        }
        s.sent.push_back((id, now));
        true
    }

    /// Bodies of all messages, visible or not (for assertions).
    pub fn bodies(&self) -> Vec<String> {
        self.lock().messages.iter().map(|m| m.body.clone()).collect()
    }

    fn try_take(&self, max: u32) -> Vec<Delivery> {
        let now = Instant::now();
        let mut s = self.lock();
        let mut out = Vec::new();
        let mut dead = Vec::new();
        let fifo = self.name.ends_with(".fifo");
        // FIFO: a group with an earlier message in flight is blocked.
        let mut blocked: Vec<Option<String>> = Vec::new();
        let mut i = 0;
        while i < s.messages.len() && out.len() < max as usize {
            let visible = s.messages[i].visible_at <= now;
            if fifo && blocked.contains(&s.messages[i].attrs.group) {
                i += 1;
                continue;
            }
            if !visible {
                if fifo {
                    blocked.push(s.messages[i].attrs.group.clone());
                }
                i += 1;
                continue;
            }
            if let Some((max_receive, _)) = &self.redrive {
                if s.messages[i].receive_count >= *max_receive {
                    if let Some(m) = s.messages.remove(i) {
                        dead.push(m);
                    }
                    continue;
                }
            }
            s.next_id += 1;
            // Named by queue too: as SQS's, a receipt is good on the queue it came from only.
            let receipt = format!("{}:{}#{}", self.name, s.messages[i].id, s.next_id);
            let m = &mut s.messages[i];
            m.receive_count += 1;
            m.visible_at = now + self.visibility;
            m.receipt = Some(receipt.clone());
            out.push(Delivery::new(
                Message { id: m.id.clone(), body: m.body.clone(), receive_count: m.receive_count, sent_ms: Some(m.sent_ms), attrs: m.attrs.clone() },
                receipt,
            ));
            i += 1;
        }
        drop(s);
        if let Some((_, dlq)) = &self.redrive {
            for m in dead {
                dlq.push(m.body, m.attrs, 0);
            }
        }
        out
    }

    /// When the next message in flight becomes visible again. A visible message that a FIFO group
    /// holds back waits for that (or for a delete, which wakes the long polls).
    fn next_visible_at(&self) -> Option<Instant> {
        let now = Instant::now();
        self.lock().messages.iter().map(|m| m.visible_at).filter(|t| *t > now).min()
    }
}

#[async_trait]
impl Queue for MemoryQueue {
    fn name(&self) -> &str {
        &self.name
    }

    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64> {
        let sizes: Vec<usize> = msgs.iter().map(|m| m.body.len()).collect();
        let plan = plan_batches(&sizes);
        for _ in &plan {
            self.calls.bump(Op::SqsSendMessageBatch);
        }
        for m in msgs {
            if !self.first_send(m) {
                continue;
            }
            self.push(m.body.clone(), m.attrs.clone(), 0);
        }
        Ok(plan.len() as u64)
    }

    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Delivery>> {
        self.calls.bump(Op::SqsReceiveMessage);
        let latency = *crate::lock(&self.latency);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let deadline = Instant::now() + wait;
        loop {
            let arrived = self.arrived.notified();
            let got = self.try_take(max.clamp(1, 10));
            if !got.is_empty() || Instant::now() >= deadline {
                return Ok(got);
            }
            let wake = self.next_visible_at().map_or(deadline, |t| t.max(Instant::now()).min(deadline));
            tokio::select! {
                biased;
                _ = arrived => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    async fn delete_receipts(&self, receipts: &[&Receipt]) -> Result<Vec<usize>> {
        if receipts.is_empty() {
            return Ok(Vec::new());
        }
        self.calls.bump(Op::SqsDeleteMessageBatch);
        let (failed, ok): (Vec<usize>, Vec<usize>) = (0..receipts.len()).partition(|_| self.entry_fails());
        let ok: Vec<&str> = ok.into_iter().map(|i| receipts[i].as_str()).collect();
        self.lock().messages.retain(|m| m.receipt.as_deref().is_none_or(|r| !ok.contains(&r)));
        // A delete may free a FIFO group whose next message is waiting.
        self.arrived.notify_waiters();
        Ok(failed)
    }

    async fn change_visibility(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        self.calls.bump(Op::SqsChangeMessageVisibilityBatch);
        let late = {
            let mut slow = crate::lock(&self.slow_changes);
            let late = (slow.0 > 0).then_some(slow.1);
            slow.0 = slow.0.saturating_sub(1);
            late
        };
        if let Some(d) = late {
            tokio::time::sleep(d).await;
        }
        let now = Instant::now();
        let mut failed = Vec::new();
        let mut s = self.lock();
        for (i, (receipt, timeout)) in entries.iter().enumerate() {
            if self.entry_fails() {
                failed.push(i);
            } else if let Some(m) = s.messages.iter_mut().find(|m| m.receipt.as_deref() == Some(*receipt)) {
                m.visible_at = now + *timeout;
            }
        }
        drop(s);
        self.arrived.notify_waiters();
        Ok(failed)
    }

    async fn depth(&self) -> Result<QueueDepth> {
        self.calls.bump(Op::SqsGetQueueAttributes);
        let now = Instant::now();
        let s = self.lock();
        let visible = s.messages.iter().filter(|m| m.visible_at <= now).count() as u64;
        Ok(QueueDepth { visible, in_flight: s.messages.len() as u64 - visible, delayed: 0 })
    }

    async fn info(&self) -> Result<QueueInfo> {
        Ok(QueueInfo { max_receive_count: self.redrive.as_ref().map(|(n, _)| *n), visibility_timeout: self.visibility, fifo: self.name.ends_with(".fifo") })
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn visibility_redelivery_and_dead_letter() {
        let dlq = MemoryQueue::new("dlq", Duration::from_secs(30));
        let q = MemoryQueue::with_dlq("q", Duration::from_secs(30), 2, dlq.clone());
        q.send(vec!["a".to_string()]).await.unwrap();
        let m = q.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].receive_count, 1);
        assert!(q.receive(10, Duration::ZERO).await.unwrap().is_empty(), "invisible while in flight");
        // A long poll returns when the message becomes visible again.
        let m2 = q.receive(10, Duration::from_secs(40)).await.unwrap();
        assert_eq!(m2[0].receive_count, 2);
        // The old receipt no longer deletes it.
        q.delete(m).await.unwrap();
        assert_eq!(q.bodies().len(), 1);
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(q.receive(10, Duration::ZERO).await.unwrap().is_empty(), "third receive moves it to the DLQ");
        assert_eq!(dlq.bodies(), ["a"]);
        assert!(q.bodies().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_completion_hands_the_delivery_back() {
        let q = MemoryQueue::new("q", Duration::from_secs(30));
        q.send(vec!["a".to_string(), "b".to_string()]).await.unwrap();
        let mut got = q.receive(10, Duration::ZERO).await.unwrap();
        let (a, b) = (got.remove(0), got.remove(0));
        q.fail_next_entries(1);
        let (e, a) = a.delete(q.as_ref()).await.expect_err("the entry fails");
        assert!(e.is_retryable(), "a failed entry may succeed later: {e}");
        assert_eq!(a.body, "a", "the same delivery comes back");
        a.delete(q.as_ref()).await.map_err(|(e, _)| e).unwrap();
        q.fail_next_entries(1);
        let (_, b) = b.release(q.as_ref(), Duration::ZERO).await.expect_err("the entry fails");
        b.release(q.as_ref(), Duration::ZERO).await.map_err(|(e, _)| e).unwrap();
        // Batches hand back exactly the failed entries.
        let got = q.receive(10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 1);
        q.fail_next_entries(1);
        let back = q.delete_batch(got.into_iter().map(Delivery::into_receipt).collect()).await.map_err(|(e, _)| e).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(q.delete_batch(back).await.map_err(|(e, _)| e).unwrap().len(), 0);
        assert!(q.bodies().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn long_poll_wakes_on_send() {
        let q = MemoryQueue::new("q", Duration::from_secs(30));
        let q2 = q.clone();
        let h = tokio::spawn(async move { q2.receive(10, Duration::from_secs(20)).await.unwrap() });
        tokio::time::sleep(Duration::from_secs(1)).await;
        q.send(vec!["x".to_string()]).await.unwrap();
        let got = h.await.unwrap();
        assert_eq!(got.len(), 1);
    }
}
