//! The queue service: a small trait over what the fleet needs from a message queue, and its SQS
//! implementation. Sends and deletes are batched (10 entries, 256 KiB per call); every call is counted.

use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageSystemAttributeName, QueueAttributeName, SendMessageBatchRequestEntry,
};
use serde::Serialize;

use crate::error::{Error, Result, Service};
use crate::requests::CallCounter;

/// Most entries in one SQS batch call.
pub const MAX_BATCH_ENTRIES: usize = 10;
/// Most payload bytes in one SendMessageBatch call.
pub const MAX_BATCH_BYTES: usize = 256 * 1024;

/// A received message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub id: String,
    pub body: String,
    /// Handle to delete the message or change its visibility (valid for this receive only).
    pub receipt: String,
    /// How many times the message has been received, this time included.
    pub receive_count: u32,
}

/// Approximate message counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    /// Messages available to receive.
    pub visible: u64,
    /// Messages received and not yet deleted.
    pub in_flight: u64,
}

#[async_trait]
pub trait Queue: Send + Sync + 'static {
    /// Queue name, for logs.
    fn name(&self) -> &str;
    /// Sends the bodies with as few SendMessageBatch calls as the limits allow; failed entries are
    /// retried. Returns the number of calls made.
    async fn send(&self, bodies: &[String]) -> Result<u64>;
    /// Receives up to `max` (1..=10) messages, waiting up to `wait` (long poll, at most 20 s) for one.
    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Message>>;
    /// Deletes by receipt handle with DeleteMessageBatch calls. Returns the number of calls made.
    async fn delete(&self, receipts: &[String]) -> Result<u64>;
    /// Makes a received message visible again after `timeout` (zero: at once).
    async fn set_visibility(&self, receipt: &str, timeout: Duration) -> Result<()>;
    /// Approximate depth.
    async fn depth(&self) -> Result<QueueDepth>;
    /// The dead-letter redrive's maxReceiveCount, if the queue has one.
    async fn max_receive_count(&self) -> Result<Option<u32>>;
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
            let retryable = matches!(
                code,
                "ThrottlingException" | "RequestThrottled" | "SlowDown" | "InternalError" | "ServiceUnavailable" | "KmsThrottled"
            ) || se.raw().status().as_u16() >= 500;
            Error::Service { service, operation, detail, retryable }
        }
        _ => Error::Service { service, operation, detail: format!("{}", DisplayErrorContext(&e)), retryable: true },
    }
}

/// An SQS queue.
pub struct SqsQueue {
    client: aws_sdk_sqs::Client,
    name: String,
    url: String,
    endpoint: String,
    calls: CallCounter,
}

impl SqsQueue {
    /// Resolves the queue by name (GetQueueUrl) or takes a full queue URL as is.
    pub async fn open(client: aws_sdk_sqs::Client, endpoint: &str, name_or_url: &str) -> Result<SqsQueue> {
        let calls = CallCounter::default();
        let (name, url) = if name_or_url.starts_with("http://") || name_or_url.starts_with("https://") {
            (name_or_url.rsplit('/').next().unwrap_or(name_or_url).to_string(), name_or_url.to_string())
        } else {
            calls.bump("sqs.GetQueueUrl");
            let out = client
                .get_queue_url()
                .queue_name(name_or_url)
                .send()
                .await
                .map_err(|e| match sdk_error(Service::Sqs, "GetQueueUrl", endpoint, e) {
                    Error::NotFound { .. } => Error::NotFound { service: Service::Sqs, what: format!("queue {name_or_url:?} does not exist at {endpoint}") },
                    other => other,
                })?;
            (name_or_url.to_string(), out.queue_url().unwrap_or_default().to_string())
        };
        Ok(SqsQueue { client, name, url, endpoint: endpoint.to_string(), calls })
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

    async fn send_once(&self, bodies: &[(usize, &String)]) -> Result<Vec<usize>> {
        let entries = bodies
            .iter()
            .map(|(i, b)| SendMessageBatchRequestEntry::builder().id(i.to_string()).message_body(b.as_str()).build())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(e.to_string()))?;
        self.calls.bump("sqs.SendMessageBatch");
        let out = self
            .client
            .send_message_batch()
            .queue_url(&self.url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| self.err("SendMessageBatch", e))?;
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

#[async_trait]
impl Queue for SqsQueue {
    fn name(&self) -> &str {
        &self.name
    }

    async fn send(&self, bodies: &[String]) -> Result<u64> {
        let sizes: Vec<usize> = bodies.iter().map(String::len).collect();
        let mut calls = 0;
        for range in plan_batches(&sizes) {
            let mut pending: Vec<(usize, &String)> = range.map(|i| (i, &bodies[i])).collect();
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
        self.calls.bump("sqs.ReceiveMessage");
        let out = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(max.clamp(1, 10) as i32)
            .wait_time_seconds(wait.as_secs().min(20) as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await
            .map_err(|e| self.err("ReceiveMessage", e))?;
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
            })
            .collect())
    }

    async fn delete(&self, receipts: &[String]) -> Result<u64> {
        let mut calls = 0;
        for batch in receipts.chunks(MAX_BATCH_ENTRIES) {
            let mut pending: Vec<(usize, &String)> = batch.iter().enumerate().collect();
            for attempt in 0..3 {
                let entries = pending
                    .iter()
                    .map(|(i, r)| DeleteMessageBatchRequestEntry::builder().id(i.to_string()).receipt_handle(r.as_str()).build())
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| Error::Config(e.to_string()))?;
                calls += 1;
                self.calls.bump("sqs.DeleteMessageBatch");
                let out = self
                    .client
                    .delete_message_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map_err(|e| self.err("DeleteMessageBatch", e))?;
                if out.failed().is_empty() {
                    break;
                }
                let failed: Vec<String> = out.failed().iter().map(|f| f.id().to_string()).collect();
                tracing::warn!(queue = %self.name, failed = failed.len(), attempt, "delete entries failed; retrying");
                pending.retain(|(i, _)| failed.contains(&i.to_string()));
                if attempt < 2 {
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                } else {
                    // Not deleted: the message comes back after its visibility timeout and is handled
                    // again, idempotently.
                    tracing::warn!(queue = %self.name, failed = pending.len(), "giving up deleting; messages will be redelivered");
                }
            }
        }
        Ok(calls)
    }

    async fn set_visibility(&self, receipt: &str, timeout: Duration) -> Result<()> {
        self.calls.bump("sqs.ChangeMessageVisibility");
        self.client
            .change_message_visibility()
            .queue_url(&self.url)
            .receipt_handle(receipt)
            .visibility_timeout(timeout.as_secs().min(43_200) as i32)
            .send()
            .await
            .map_err(|e| self.err("ChangeMessageVisibility", e))?;
        Ok(())
    }

    async fn depth(&self) -> Result<QueueDepth> {
        self.calls.bump("sqs.GetQueueAttributes");
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| self.err("GetQueueAttributes", e))?;
        let get = |n: QueueAttributeName| out.attributes().and_then(|a| a.get(&n)).and_then(|v| v.parse().ok()).unwrap_or(0);
        Ok(QueueDepth {
            visible: get(QueueAttributeName::ApproximateNumberOfMessages),
            in_flight: get(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        })
    }

    async fn max_receive_count(&self) -> Result<Option<u32>> {
        self.calls.bump("sqs.GetQueueAttributes");
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(&self.url)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(|e| self.err("GetQueueAttributes", e))?;
        let Some(policy) = out.attributes().and_then(|a| a.get(&QueueAttributeName::RedrivePolicy)) else {
            return Ok(None);
        };
        let v: serde_json::Value = serde_json::from_str(policy)?;
        Ok(match &v["maxReceiveCount"] {
            serde_json::Value::Number(n) => n.as_u64().map(|n| n as u32),
            serde_json::Value::String(s) => s.parse().ok(),
            _ => None,
        })
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }
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
