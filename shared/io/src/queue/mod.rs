//! The queue service: a small trait over what the fleet needs from a message queue; its SQS
//! implementation is in `sqs`, the in-memory twin in `memory`. Sends, deletes and visibility changes
//! are batched (10 entries, 256 KiB per call); every call is counted. Engine metadata (priority, job
//! deadline, dead-letter reason) travels as SQS message attributes and the FIFO group as
//! MessageGroupId, so listeners never parse bodies for it.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::call::CallCounter;
use crate::error::{Error, Result};

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
    /// The W3C trace context (`traceparent`) of the span that sent it: the receiver's span joins the
    /// job's trace (see `telemetry`).
    pub trace: Option<String>,
    /// Its sender's role signature (see `auth`): kept wherever the message travels (a dead-letter
    /// queue, the quarantine and its redrive, a stray forwarded to its partition).
    pub auth: Option<String>,
    /// A work item's chunk token (see `auth::Key::chunk_token`), passed on with its result.
    pub chunk_token: Option<String>,
}

/// A message to send.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outgoing {
    pub body: String,
    pub attrs: Attrs,
    /// FIFO queues: the de-duplication id (`None`: the body's hash, so the same work item sent twice
    /// within SQS's 5-minute window is kept once). A redrive gives its own, so that a message sent
    /// back soon after its first send is not dropped as that send's duplicate.
    pub dedup: Option<String>,
}

impl Outgoing {
    pub fn plain(body: String) -> Outgoing {
        Outgoing { body, attrs: Attrs::default(), dedup: None }
    }

    /// The FIFO de-duplication id this message is sent with.
    pub fn dedup_id(&self) -> String {
        self.dedup.clone().unwrap_or_else(|| format!("{:032x}", xxhash_rust::xxh3::xxh3_128(self.body.as_bytes())))
    }

    /// A de-duplication id for sending `body` again as a redrive of the message `message_id` (its id
    /// in the queue it is moved from): a retry of the same move is still kept once.
    pub fn redrive_dedup(body: &str, message_id: &str) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(body.as_bytes());
        h.update(b"\0redrive\0");
        h.update(message_id.as_bytes());
        format!("{:032x}", h.digest128())
    }
}

/// What a received message says: its content and the metadata a listener acts on. Plain data (it can
/// be cloned, logged and quarantined); the right to complete the message is its [`Delivery`]'s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    pub id: String,
    pub body: String,
    /// How many times the message has been received, this time included.
    pub receive_count: u32,
    /// When the queue got it (Unix ms; SQS's `SentTimestamp`), when the queue says.
    pub sent_ms: Option<u64>,
    pub attrs: Attrs,
}

impl Message {
    /// How long it has been since the queue got it (none when the queue did not say; zero when this
    /// host's clock is behind the queue's).
    pub fn age(&self) -> Option<Duration> {
        let sent = self.sent_ms?;
        Some(Duration::from_millis(unix_ms().saturating_sub(sent)))
    }
}

/// Now, as Unix ms.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The handle SQS gives with a receive to delete the message or change its visibility (valid for that
/// receive only). It cannot be cloned: a completion takes it by value, so a message is completed once.
#[derive(Debug, PartialEq, Eq)]
pub struct Receipt(String);

impl Receipt {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A received message and the right to complete it, used up by its completion: `delete`, `release`
/// (back to the queue after a delay) or `dead_letter`. It cannot be cloned, so it is completed at most
/// once; a completion that fails hands it back with the error (as omniqueue's `Delivery::ack`). One
/// dropped without a completion comes back to the queue after its visibility timeout. It reads as its
/// [`Message`] (`Deref`).
///
/// Completing it twice does not compile:
/// ```compile_fail,E0382
/// async fn twice(d: fleet_io::queue::Delivery, q: &dyn fleet_io::queue::Queue) {
///     let _ = d.delete(q).await;
///     let _ = d.delete(q).await; // use of moved value
/// }
/// ```
#[derive(Debug)]
pub struct Delivery {
    message: Message,
    receipt: Receipt,
}

impl std::ops::Deref for Delivery {
    type Target = Message;
    fn deref(&self) -> &Message {
        &self.message
    }
}

/// A batch completion's answer: `Ok` with the entries that failed (handed back, to try again), or the
/// error of the call with all of its entries handed back.
pub type Handback<T> = std::result::Result<Vec<T>, (Error, Vec<T>)>;

impl Delivery {
    /// A delivery of `message` under `receipt`: for [`Queue`] implementations (and tests).
    pub fn new(message: Message, receipt: String) -> Delivery {
        Delivery { message, receipt: Receipt(receipt) }
    }

    /// The receipt, to name the message in logs and keep it in hand longer ([`Queue::extend`]); not to
    /// complete it.
    pub fn receipt(&self) -> &str {
        self.receipt.as_str()
    }

    /// Gives up the message's content, keeping the right to complete it.
    pub fn into_receipt(self) -> Receipt {
        self.receipt
    }

    /// Splits the delivery into its content and its receipt (completed on its own later).
    pub fn into_parts(self) -> (Message, Receipt) {
        (self.message, self.receipt)
    }

    /// Deletes the message (one call; listeners batch through their engine instead).
    pub async fn delete(self, queue: &dyn Queue) -> std::result::Result<(), (Error, Delivery)> {
        match queue.delete_receipts(&[&self.receipt]).await {
            Ok(failed) if failed.is_empty() => Ok(()),
            Ok(_) => Err((entry_failed(queue, "DeleteMessageBatch"), self)),
            Err(e) => Err((e, self)),
        }
    }

    /// Returns the message to the queue, visible again after `after` (zero: at once).
    pub async fn release(self, queue: &dyn Queue, after: Duration) -> std::result::Result<(), (Error, Delivery)> {
        match queue.change_visibility(&[(self.receipt(), after)]).await {
            Ok(failed) if failed.is_empty() => Ok(()),
            Ok(_) => Err((entry_failed(queue, "ChangeMessageVisibilityBatch"), self)),
            Err(e) => Err((e, self)),
        }
    }

    /// Moves the message to `dlq` with `reason` (a copy sent there, then this one deleted). If the
    /// delete fails after the copy was sent, the delivery comes back with the error: releasing it then
    /// means a second copy later, which every consumer of a dead-letter queue tolerates (idempotent).
    pub async fn dead_letter(self, queue: &dyn Queue, dlq: &dyn Queue, reason: &str) -> std::result::Result<(), (Error, Delivery)> {
        let out = Outgoing { body: self.body.clone(), attrs: Attrs { reason: Some(reason.to_string()), ..self.attrs.clone() }, dedup: None };
        if let Err(e) = dlq.send_messages(&[out]).await {
            return Err((e, self));
        }
        self.delete(queue).await
    }
}

/// The error for a batch entry that failed while its call succeeded (SQS throttling or an internal
/// error on that entry): worth another try.
fn entry_failed(queue: &dyn Queue, operation: &'static str) -> Error {
    Error::Service {
        service: crate::error::Service::Sqs,
        operation,
        detail: format!("the entry failed on queue {}", queue.name()),
        retryable: true,
        source: None,
    }
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
    /// The names of the queues messages really go to: this one's, or each shard's of a
    /// [`sharded::Sharded`] queue (triggers and instance reports name those).
    fn shard_names(&self) -> Vec<String> {
        vec![self.name().to_string()]
    }
    /// This queue as a [`sharded::Sharded`] one, if it is (a processor runs a listener per shard).
    fn as_sharded(&self) -> Option<&sharded::Sharded> {
        None
    }
    /// Sends the messages with as few SendMessageBatch calls as the limits allow; failed entries are
    /// retried. Returns the number of calls made.
    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64>;
    /// Sends plain bodies (no attributes); takes them by value so large results are not copied.
    async fn send(&self, bodies: Vec<String>) -> Result<u64> {
        let msgs: Vec<Outgoing> = bodies.into_iter().map(Outgoing::plain).collect();
        self.send_messages(&msgs).await
    }
    /// Receives up to `max` (1..=10) messages, waiting up to `wait` (long poll, at most 20 s) for one.
    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Delivery>>;
    /// One DeleteMessageBatch call for up to 10 receipts; returns the indexes of the entries that failed
    /// and may succeed later (an entry whose receipt is stale is not among them: its message comes back
    /// by itself). Reached through [`Queue::delete_batch`], which takes the receipts by value.
    async fn delete_receipts(&self, receipts: &[&Receipt]) -> Result<Vec<usize>>;
    /// One ChangeMessageVisibilityBatch call for up to 10 entries; returns the indexes of the entries
    /// that failed and may succeed later. Borrowed receipts: keeping a message in hand longer (the
    /// heartbeat, [`Queue::extend`]) is not a completion; a release goes through [`Queue::release_batch`].
    async fn change_visibility(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>>;
    /// Approximate depth.
    async fn depth(&self) -> Result<QueueDepth>;
    /// Redrive, visibility timeout and kind of the queue.
    async fn info(&self) -> Result<QueueInfo>;
    /// Deletes up to 10 messages in one call; the receipts of entries that failed come back, to try
    /// again (see [`Handback`]).
    async fn delete_batch(&self, receipts: Vec<Receipt>) -> Handback<Receipt> {
        let refs: Vec<&Receipt> = receipts.iter().collect();
        match self.delete_receipts(&refs).await {
            Ok(failed) => Ok(pick(receipts, &failed)),
            Err(e) => Err((e, receipts)),
        }
    }
    /// Returns up to 10 messages to the queue in one call, each visible after its delay; entries that
    /// failed come back.
    async fn release_batch(&self, entries: Vec<(Receipt, Duration)>) -> Handback<(Receipt, Duration)> {
        let refs: Vec<(&str, Duration)> = entries.iter().map(|(r, d)| (r.as_str(), *d)).collect();
        match self.change_visibility(&refs).await {
            Ok(failed) => Ok(pick(entries, &failed)),
            Err(e) => Err((e, entries)),
        }
    }
    /// Keeps messages still in hand invisible for another `timeout` each (the visibility heartbeat);
    /// returns the indexes of the entries that failed.
    async fn extend(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>> {
        self.change_visibility(entries).await
    }
    /// Deletes any number of messages in batches of 10; failed entries are retried twice, then left to
    /// come back after their visibility timeout (and be handled again, idempotently). Returns the number
    /// of calls made. (Tools and tests; listeners complete through their engine's batcher.)
    async fn delete(&self, deliveries: Vec<Delivery>) -> Result<u64> {
        let mut calls = 0;
        let mut receipts: Vec<Receipt> = deliveries.into_iter().map(Delivery::into_receipt).collect();
        while !receipts.is_empty() {
            let rest = receipts.split_off(receipts.len().min(MAX_BATCH_ENTRIES));
            let mut pending = std::mem::replace(&mut receipts, rest);
            for attempt in 0..3 {
                calls += 1;
                pending = self.delete_batch(pending).await.map_err(|(e, _)| e)?;
                if pending.is_empty() {
                    break;
                }
                tracing::warn!(queue = self.name(), failed = pending.len(), attempt, "delete entries failed");
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
        }
        Ok(calls)
    }
    /// Returns any number of messages to the queue, visible after `after`, in batches of 10. Returns
    /// the number of calls made; entries that failed come back by themselves after their timeout.
    async fn release(&self, deliveries: Vec<Delivery>, after: Duration) -> Result<u64> {
        let mut calls = 0;
        let mut entries: Vec<(Receipt, Duration)> = deliveries.into_iter().map(|d| (d.into_receipt(), after)).collect();
        while !entries.is_empty() {
            let rest = entries.split_off(entries.len().min(MAX_BATCH_ENTRIES));
            calls += 1;
            let failed = self.release_batch(std::mem::replace(&mut entries, rest)).await.map_err(|(e, _)| e)?;
            if !failed.is_empty() {
                tracing::warn!(queue = self.name(), failed = failed.len(), "release entries failed; they come back after their visibility timeout");
            }
        }
        Ok(calls)
    }
    /// Calls made through this client.
    fn calls(&self) -> &CallCounter;

    /// The breaker this queue's calls report to (none for the in-memory twin unless given one).
    fn breaker(&self) -> Option<std::sync::Arc<crate::breaker::Breaker>> {
        None
    }
}

/// The entries at `indexes` (the failed ones of a batch call), in order.
pub fn pick<T>(entries: Vec<T>, indexes: &[usize]) -> Vec<T> {
    entries.into_iter().enumerate().filter(|(i, _)| indexes.contains(i)).map(|(_, t)| t).collect()
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

/// Partition `p` of a partitioned queue (the results queue, `--results-partitions`): the shard of a
/// [`Sharded`] queue, the queue itself for partition 0 of a queue in one piece. A partition beyond the
/// count is an error that says so (the count was lowered while the job was in flight).
pub fn partition(queue: &Arc<dyn Queue>, p: u16) -> Result<Arc<dyn Queue>> {
    let shards = match queue.as_sharded() {
        Some(s) => s.shards().to_vec(),
        None => vec![queue.clone()],
    };
    shards.get(usize::from(p)).cloned().ok_or_else(|| {
        Error::Config(format!(
            "partition {p} of queue {} does not exist: it has {} (--results-partitions / FLEET_RESULTS_PARTITIONS was lowered while a job of that partition was in flight; raise it back until the job finishes)",
            queue.name(),
            shards.len()
        ))
    })
}

/// The partitions of a partitioned queue, in order (one queue: itself).
pub fn partitions(queue: &Arc<dyn Queue>) -> Vec<Arc<dyn Queue>> {
    match queue.as_sharded() {
        Some(s) => s.shards().to_vec(),
        None => vec![queue.clone()],
    }
}

#[cfg(feature = "test-util")]
pub mod memory;
pub mod sharded;
pub mod sqs;

pub use sharded::Sharded;
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
