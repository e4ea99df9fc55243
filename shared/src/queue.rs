//! The queue service: a small trait over what the fleet needs from a message queue, and its SQS
//! implementation. Sends, deletes and visibility changes are batched (10 entries, 256 KiB per call);
//! every call is counted. Engine metadata (priority, job deadline, dead-letter reason) travels as SQS
//! message attributes and the FIFO group as MessageGroupId, so listeners never parse bodies for it.

use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use serde::{Deserialize, Serialize};

use crate::call::CallPolicy;
use crate::error::{Error, Result, Service};
use crate::requests::CallCounter;

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

/// Maps an SDK error to the library error, telling unreachable endpoints apart from service errors.
pub(crate) fn sdk_error<E>(service: Service, operation: &'static str, endpoint: &str, e: SdkError<E, HttpResponse>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match &e {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => {
            Error::Unreachable { service, endpoint: endpoint.to_string(), detail: format!("{}", DisplayErrorContext(&e)) }
        }
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("");
            let detail = format!("{code}: {}", se.err().message().unwrap_or("(no message)"));
            if matches!(code, "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist" | "NoSuchBucket" | "NoSuchKey") {
                return Error::NotFound { service, what: detail };
            }
            let retryable = matches!(code, "ThrottlingException" | "RequestThrottled" | "SlowDown" | "InternalError" | "ServiceUnavailable" | "KmsThrottled")
                || se.raw().status().as_u16() >= 500;
            Error::Service { service, operation, detail, retryable }
        }
        _ => Error::Service { service, operation, detail: format!("{}", DisplayErrorContext(&e)), retryable: true },
    }
}

/// An SQS queue. Every call is bounded by its [`CallPolicy`] (attempt timeout, deadline, jittered
/// back-off).
pub struct SqsQueue {
    client: aws_sdk_sqs::Client,
    name: String,
    url: String,
    endpoint: String,
    calls: CallCounter,
    policy: CallPolicy,
}

impl SqsQueue {
    /// Resolves the queue by name (GetQueueUrl) or takes a full queue URL as is.
    pub async fn open(client: aws_sdk_sqs::Client, endpoint: &str, name_or_url: &str, policy: CallPolicy) -> Result<SqsQueue> {
        let calls = CallCounter::default();
        let (name, url) = if name_or_url.starts_with("http://") || name_or_url.starts_with("https://") {
            (name_or_url.rsplit('/').next().unwrap_or(name_or_url).to_string(), name_or_url.to_string())
        } else {
            let out = policy
                .run(Service::Sqs, "GetQueueUrl", Duration::ZERO, || async {
                    calls.bump("sqs.GetQueueUrl");
                    client.get_queue_url().queue_name(name_or_url).send().await.map_err(|e| match sdk_error(Service::Sqs, "GetQueueUrl", endpoint, e) {
                        Error::NotFound { .. } => {
                            Error::NotFound { service: Service::Sqs, what: format!("queue {name_or_url:?} does not exist at {endpoint}") }
                        }
                        other => other,
                    })
                })
                .await?;
            (name_or_url.to_string(), out.queue_url().unwrap_or_default().to_string())
        };
        Ok(SqsQueue { client, name, url, endpoint: endpoint.to_string(), calls, policy })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn err<E>(&self, op: &'static str, e: SdkError<E, HttpResponse>) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        sdk_error(Service::Sqs, op, &self.endpoint, e)
    }

    fn is_fifo(&self) -> bool {
        self.name.ends_with(".fifo")
    }

    async fn attributes(&self, names: &[QueueAttributeName]) -> Result<aws_sdk_sqs::operation::get_queue_attributes::GetQueueAttributesOutput> {
        self.policy
            .run(Service::Sqs, "GetQueueAttributes", Duration::ZERO, || async {
                self.calls.bump("sqs.GetQueueAttributes");
                self.client
                    .get_queue_attributes()
                    .queue_url(&self.url)
                    .set_attribute_names(Some(names.to_vec()))
                    .send()
                    .await
                    .map_err(|e| self.err("GetQueueAttributes", e))
            })
            .await
    }

    async fn send_once(&self, msgs: &[(usize, &Outgoing)]) -> Result<Vec<usize>> {
        let fifo = self.is_fifo();
        let entries = msgs
            .iter()
            .map(|(i, m)| {
                let mut e = SendMessageBatchRequestEntry::builder().id(i.to_string()).message_body(m.body.as_str());
                for (name, value) in attribute_values(&m.attrs) {
                    e = e.message_attributes(name, value);
                }
                if fifo {
                    // The body names the job and chunk, so its hash is a stable de-duplication id.
                    let dedup = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(m.body.as_bytes()));
                    e = e.message_group_id(m.attrs.group.as_deref().unwrap_or("default")).message_deduplication_id(dedup);
                }
                e.build()
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(e.to_string()))?;
        let out = self
            .policy
            .run(Service::Sqs, "SendMessageBatch", Duration::ZERO, || async {
                self.calls.bump("sqs.SendMessageBatch");
                self.client
                    .send_message_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(entries.clone()))
                    .send()
                    .await
                    .map_err(|e| self.err("SendMessageBatch", e))
            })
            .await?;
        let mut failed = Vec::new();
        for f in out.failed() {
            if f.sender_fault() {
                return Err(Error::Service {
                    service: Service::Sqs,
                    operation: "SendMessageBatch",
                    detail: format!("entry rejected: {}: {}", f.code(), f.message().unwrap_or("")),
                    retryable: false,
                });
            }
            failed.push(f.id().parse::<usize>().unwrap_or(usize::MAX));
        }
        Ok(failed)
    }
}

/// The message attributes that carry `attrs` (none for defaults, to keep messages small).
fn attribute_values(attrs: &Attrs) -> Vec<(&'static str, MessageAttributeValue)> {
    let num = |v: String| MessageAttributeValue::builder().data_type("Number").string_value(v).build().ok();
    let text = |v: &str| MessageAttributeValue::builder().data_type("String").string_value(v).build().ok();
    let mut out = Vec::new();
    if attrs.priority != 0 {
        out.extend(num(attrs.priority.to_string()).map(|v| ("priority", v)));
    }
    if let Some(d) = attrs.deadline_ms {
        out.extend(num(d.to_string()).map(|v| ("deadline", v)));
    }
    if let Some(r) = &attrs.reason {
        out.extend(text(r).map(|v| ("reason", v)));
    }
    out
}

#[async_trait]
impl Queue for SqsQueue {
    fn name(&self) -> &str {
        &self.name
    }

    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64> {
        let sizes: Vec<usize> = msgs.iter().map(|m| m.body.len() + 64).collect();
        let mut calls = 0;
        for range in plan_batches(&sizes) {
            let mut pending: Vec<(usize, &Outgoing)> = range.map(|i| (i, &msgs[i])).collect();
            for attempt in 0.. {
                calls += 1;
                let failed = self.send_once(&pending).await?;
                if failed.is_empty() {
                    break;
                }
                if attempt == 4 {
                    return Err(Error::Service {
                        service: Service::Sqs,
                        operation: "SendMessageBatch",
                        detail: format!("{} entries still failing after 5 attempts", failed.len()),
                        retryable: true,
                    });
                }
                pending.retain(|(i, _)| failed.contains(i));
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
        }
        Ok(calls)
    }
    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Message>> {
        let wait = wait.min(Duration::from_secs(20));
        // One attempt: the listener has its own back-off for a failed receive, and messages a timed-out
        // receive took come back after their visibility timeout.
        let out = self
            .policy
            .once(Service::Sqs, "ReceiveMessage", wait, async {
                self.calls.bump("sqs.ReceiveMessage");
                self.client
                    .receive_message()
                    .queue_url(&self.url)
                    .max_number_of_messages(max.clamp(1, 10) as i32)
                    .wait_time_seconds(wait.as_secs() as i32)
                    .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                    .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                    .message_attribute_names("All")
                    .send()
                    .await
                    .map_err(|e| self.err("ReceiveMessage", e))
            })
            .await?;
        Ok(out
            .messages()
            .iter()
            .map(|m| Message {
                id: m.message_id().unwrap_or_default().to_string(),
                body: m.body().unwrap_or_default().to_string(),
                receipt: m.receipt_handle().unwrap_or_default().to_string(),
                receive_count: m
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
                attrs: {
                    let attr = |n: &str| m.message_attributes().and_then(|a| a.get(n)).and_then(|v| v.string_value());
                    Attrs {
                        priority: attr("priority").and_then(|v| v.parse().ok()).unwrap_or(0),
                        deadline_ms: attr("deadline").and_then(|v| v.parse().ok()),
                        group: m.attributes().and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId)).cloned(),
                        reason: attr("reason").map(str::to_string),
                    }
                },
            })
            .collect())
    }

    async fn delete_batch(&self, receipts: &[String]) -> Result<Vec<String>> {
        if receipts.is_empty() {
            return Ok(Vec::new());
        }
        let entries = receipts
            .iter()
            .enumerate()
            .map(|(i, r)| DeleteMessageBatchRequestEntry::builder().id(i.to_string()).receipt_handle(r.as_str()).build())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(e.to_string()))?;
        let out = self
            .policy
            .run(Service::Sqs, "DeleteMessageBatch", Duration::ZERO, || async {
                self.calls.bump("sqs.DeleteMessageBatch");
                self.client
                    .delete_message_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(entries.clone()))
                    .send()
                    .await
                    .map_err(|e| self.err("DeleteMessageBatch", e))
            })
            .await?;
        Ok(failed_receipts(|i| receipts.get(i).map(String::as_str), out.failed().iter().map(|f| (f.id(), f.code()))))
    }

    async fn set_visibility_batch(&self, entries: &[(String, Duration)]) -> Result<Vec<String>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let built = entries
            .iter()
            .enumerate()
            .map(|(i, (r, t))| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(r.as_str())
                    // Whole seconds on SQS: a part second rounds up (a short retry delay must not become 0).
                    .visibility_timeout((t.as_secs() + u64::from(t.subsec_nanos() > 0)).min(43_200) as i32)
                    .build()
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(e.to_string()))?;
        let out = self
            .policy
            .run(Service::Sqs, "ChangeMessageVisibilityBatch", Duration::ZERO, || async {
                self.calls.bump("sqs.ChangeMessageVisibilityBatch");
                self.client
                    .change_message_visibility_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(built.clone()))
                    .send()
                    .await
                    .map_err(|e| self.err("ChangeMessageVisibilityBatch", e))
            })
            .await?;
        Ok(failed_receipts(|i| entries.get(i).map(|(r, _)| r.as_str()), out.failed().iter().map(|f| (f.id(), f.code()))))
    }

    async fn depth(&self) -> Result<QueueDepth> {
        let out = self
            .attributes(&[
                QueueAttributeName::ApproximateNumberOfMessages,
                QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
                QueueAttributeName::ApproximateNumberOfMessagesDelayed,
            ])
            .await?;
        let get = |n: QueueAttributeName| out.attributes().and_then(|a| a.get(&n)).and_then(|v| v.parse().ok()).unwrap_or(0);
        Ok(QueueDepth {
            visible: get(QueueAttributeName::ApproximateNumberOfMessages),
            in_flight: get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
            delayed: get(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
        })
    }

    async fn info(&self) -> Result<QueueInfo> {
        let out = self.attributes(&[QueueAttributeName::RedrivePolicy, QueueAttributeName::VisibilityTimeout]).await?;
        let attrs = out.attributes();
        let visibility = attrs.and_then(|a| a.get(&QueueAttributeName::VisibilityTimeout)).and_then(|v| v.parse().ok()).unwrap_or(30);
        let max_receive_count = match attrs.and_then(|a| a.get(&QueueAttributeName::RedrivePolicy)) {
            None => None,
            Some(policy) => {
                let v: serde_json::Value = serde_json::from_str(policy)?;
                match &v["maxReceiveCount"] {
                    serde_json::Value::Number(n) => n.as_u64().map(|n| n as u32),
                    serde_json::Value::String(s) => s.parse().ok(),
                    _ => None,
                }
            }
        };
        Ok(QueueInfo { max_receive_count, visibility_timeout: Duration::from_secs(visibility), fifo: self.is_fifo() })
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }
}

/// The receipts of the failed entries of a batch call (entry ids are indexes: `receipt_at(i)`). An entry
/// whose receipt is no longer valid will never succeed: it is dropped, not retried.
fn failed_receipts<'r, 'a>(receipt_at: impl Fn(usize) -> Option<&'r str>, failed: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    failed
        .filter(|(_, code)| !matches!(*code, "ReceiptHandleIsInvalid" | "InvalidParameterValue" | "MessageNotInflight"))
        .filter_map(|(id, _)| id.parse::<usize>().ok().and_then(&receipt_at).map(str::to_string))
        .collect()
}

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
