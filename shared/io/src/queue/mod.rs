//! The queue service: a small trait over what the fleet needs from a message queue; its SQS
//! implementation is in `sqs`, the in-memory twin in `memory`. Sends, deletes and visibility changes
//! are batched (10 entries, 256 KiB per call); every call is counted. Engine metadata (priority, job
//! deadline, dead-letter reason) travels as SQS message attributes and the FIFO group as
//! MessageGroupId, so listeners never parse bodies for it.

use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::call::CallCounter;
use crate::error::Result;

/// Most entries in one SQS batch call.
pub const MAX_BATCH_ENTRIES: usize = 10;
/// Most payload bytes in one SendMessageBatch call.
pub const MAX_BATCH_BYTES: usize = 256 * 1024;

/// Metadata a listener acts on without reading the body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attrs {
    /// Processing priority, higher first (0 when not set).
    pub priority: i32,
    /// Unix time (ms) after which the job no longer wants the message: an expired message is then
    /// dead-lettered instead of going back to the queue.
    pub deadline_ms: Option<u64>,
    /// FIFO message group: messages of one group are processed one at a time, in order.
    pub group: Option<String>,
    /// Why a listener moved the message to a dead-letter queue (e.g. `expired`).
    pub reason: Option<String>,
}

/// A message to send.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outgoing {
    pub body: String,
    pub attrs: Attrs,
}

impl Outgoing {
    pub fn plain(body: String) -> Outgoing {
        Outgoing { body, attrs: Attrs::default() }
    }
}

/// A received message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub id: String,
    pub body: String,
    /// Handle to delete the message or change its visibility (valid for this receive only).
    pub receipt: String,
    /// How many times the message has been received, this time included.
    pub receive_count: u32,
    pub attrs: Attrs,
}

/// What a listener needs to know about a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueInfo {
    /// The dead-letter redrive's maxReceiveCount, if the queue has one.
    pub max_receive_count: Option<u32>,
    /// Default visibility timeout of a received message.
    pub visibility_timeout: Duration,
    /// A FIFO queue (per-group order).
    pub fifo: bool,
}

/// Approximate message counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueDepth {
    /// Messages available to receive.
    pub visible: u64,
    /// Messages received and not yet deleted.
    pub in_flight: u64,
    /// Messages sent with a delay (or released with one) that are not visible yet.
    #[serde(default)]
    pub delayed: u64,
}

#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// Queue name, for logs.
    fn name(&self) -> &str;
    /// Sends the messages with as few SendMessageBatch calls as the limits allow; failed entries are
    /// retried. Returns the number of calls made.
    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64>;
    /// Sends plain bodies (no attributes); takes them by value so large results are not copied.
    async fn send(&self, bodies: Vec<String>) -> Result<u64> {
        let msgs: Vec<Outgoing> = bodies.into_iter().map(Outgoing::plain).collect();
        self.send_messages(&msgs).await
    }
    /// Receives up to `max` (1..=10) messages, waiting up to `wait` (long poll, at most 20 s) for one.
    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Message>>;
    /// One DeleteMessageBatch call for up to 10 receipts; returns the receipts whose entries failed.
    async fn delete_batch(&self, receipts: &[String]) -> Result<Vec<String>>;
    /// One ChangeMessageVisibilityBatch call for up to 10 entries; returns the receipts whose entries
    /// failed.
    async fn set_visibility_batch(&self, entries: &[(String, Duration)]) -> Result<Vec<String>>;
    /// Approximate depth.
    async fn depth(&self) -> Result<QueueDepth>;
    /// Redrive, visibility timeout and kind of the queue.
    async fn info(&self) -> Result<QueueInfo>;
    /// Deletes any number of receipts in batches of 10; failed entries are retried twice, then left to
    /// come back after their visibility timeout (and be handled again, idempotently). Returns the number
    /// of calls made.
    async fn delete(&self, receipts: &[String]) -> Result<u64> {
        let mut calls = 0;
        for batch in receipts.chunks(MAX_BATCH_ENTRIES) {
            let mut pending = batch.to_vec();
            for attempt in 0..3 {
                calls += 1;
                pending = self.delete_batch(&pending).await?;
                if pending.is_empty() {
                    break;
                }
                tracing::warn!(queue = self.name(), failed = pending.len(), attempt, "delete entries failed");
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
        }
        Ok(calls)
    }
    /// Makes a received message visible again after `timeout` (zero: at once).
    async fn set_visibility(&self, receipt: &str, timeout: Duration) -> Result<()> {
        self.set_visibility_batch(&[(receipt.to_string(), timeout)]).await.map(drop)
    }
    /// Calls made through this client.
    fn calls(&self) -> &CallCounter;
}

/// Splits message sizes into batches that respect the entry and byte limits, in order.
pub fn plan_batches(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && (i - start == MAX_BATCH_ENTRIES || bytes + s > MAX_BATCH_BYTES) {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += s;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

#[cfg(feature = "test-util")]
pub mod memory;
pub mod sqs;

pub use sqs::SqsQueue;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_respect_count_and_bytes() {
        assert_eq!(plan_batches(&[]), Vec::<Range<usize>>::new());
        assert_eq!(plan_batches(&[1; 25]), vec![0..10, 10..20, 20..25]);
        let big = MAX_BATCH_BYTES / 3 + 1;
        assert_eq!(plan_batches(&[big, big, big, 10]), vec![0..2, 2..4]);
        // A single message at the limit still goes out, alone.
        assert_eq!(plan_batches(&[MAX_BATCH_BYTES, 1]), vec![0..1, 1..2]);
    }
}
