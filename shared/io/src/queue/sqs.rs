//! Why: everything SQS-specific (batch limits, attributes, FIFO ids, move tasks, what SQS bills) stays
//! behind the [`Queue`] trait in this one file, so the engine and the services never see the SDK.
//!
//! The SQS implementation of [`Queue`]: every call bounded by its [`CallPolicy`], sends, deletes and
//! visibility changes batched, engine metadata carried as message attributes.

use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};

use crate::op::{sqs_extra_chunks, Billed, Op};

use super::{plan_batches, Attrs, Delivery, Message, Outgoing, Queue, QueueDepth, QueueInfo, Receipt};
use crate::breaker::Breaker;
use crate::call::CallCounter;
use crate::call::{CallPolicy, Guarded, On};
use crate::error::{sdk_error, Error, Result, Service};

/// A message move task's state, as `ListMessageMoveTasks` says it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MoveTask {
    /// `RUNNING`, `COMPLETED`, `CANCELLING`, `CANCELLED` or `FAILED`.
    pub status: String,
    pub moved: i64,
    pub to_move: Option<i64>,
    pub failure: Option<String>,
    /// Given while it runs (to cancel it with `CancelMessageMoveTask`).
    pub handle: Option<String>,
}

impl MoveTask {
    /// Whether it has ended (completed, cancelled or failed).
    pub fn ended(&self) -> bool {
        !matches!(self.status.as_str(), "RUNNING" | "CANCELLING")
    }
}

/// An SQS queue. Every call is bounded by its [`CallPolicy`] (attempt timeout, deadline, jittered
/// back-off).
pub struct SqsQueue {
    client: aws_sdk_sqs::Client,
    name: String,
    url: String,
    endpoint: String,
    policy: Guarded,
}

impl SqsQueue {
    /// Resolves the queue by name (GetQueueUrl) or takes a full queue URL as is.
    pub async fn open(client: aws_sdk_sqs::Client, endpoint: &str, name_or_url: &str, policy: CallPolicy) -> Result<SqsQueue> {
        let calls = CallCounter::default();
        let (name, url) = if name_or_url.starts_with("http://") || name_or_url.starts_with("https://") {
            (name_or_url.rsplit('/').next().unwrap_or(name_or_url).to_string(), name_or_url.to_string())
        } else {
            let out = policy
                .run(Op::SqsGetQueueUrl, On::Queue(name_or_url), Duration::ZERO, || async {
                    calls.add(Billed::Call { op: Op::SqsGetQueueUrl, fifo: crate::config::is_fifo(name_or_url) }, 1);
                    client.get_queue_url().queue_name(name_or_url).send().await.map_err(|e| match sdk_error(Op::SqsGetQueueUrl, endpoint, e) {
                        Error::NotFound { .. } => {
                            Error::NotFound { service: Service::Sqs, what: format!("queue {name_or_url:?} does not exist at {endpoint}") }
                        }
                        other => other,
                    })
                })
                .await?;
            (name_or_url.to_string(), out.queue_url().unwrap_or_default().to_string())
        };
        let fifo = crate::config::is_fifo(&name);
        Ok(SqsQueue { client, name, url, endpoint: endpoint.to_string(), policy: Guarded { calls, fifo, ..Guarded::new(policy) } })
    }

    /// Counts the further 64 KiB chunks of a call's `payload` bytes (each billed as one request).
    fn count_payload(&self, payload: usize) {
        self.policy.calls.add(Billed::Extra64KiB { fifo: self.policy.fifo }, sqs_extra_chunks(payload));
    }

    /// The same queue counting its calls into `calls` from now on (the shards of a sharded queue share
    /// one counter).
    pub fn counting_into(mut self, calls: &CallCounter) -> SqsQueue {
        self.policy.calls = calls.clone();
        self
    }

    /// The same queue with its calls bounded by `policy` from now on.
    pub fn with_policy(mut self, policy: CallPolicy) -> SqsQueue {
        self.policy.policy = policy;
        self
    }

    /// Reports every call to `breaker` (SQS's of the process) and offers it a probe: this queue's
    /// GetQueueAttributes.
    pub fn with_breaker(mut self, breaker: std::sync::Arc<Breaker>) -> SqsQueue {
        let (client, name, url, endpoint, policy) = (self.client.clone(), self.name.clone(), self.url.clone(), self.endpoint.clone(), self.policy.policy);
        breaker.set_probe(std::sync::Arc::new(move || {
            let (client, name, url, endpoint) = (client.clone(), name.clone(), url.clone(), endpoint.clone());
            Box::pin(async move {
                policy
                    .once(Op::SqsGetQueueAttributes, On::Queue(&name), Duration::ZERO, async {
                        client
                            .get_queue_attributes()
                            .queue_url(&url)
                            .attribute_names(QueueAttributeName::VisibilityTimeout)
                            .send()
                            .await
                            .map(|_| ())
                            .map_err(|e| sdk_error(Op::SqsGetQueueAttributes, &endpoint, e))
                    })
                    .await
            })
        }));
        self.policy.breaker = Some(breaker);
        self
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn err<E>(&self, op: Op, e: SdkError<E, HttpResponse>) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        sdk_error(op, &self.endpoint, e)
    }

    fn is_fifo(&self) -> bool {
        self.name.ends_with(".fifo")
    }

    /// The queue's ARN.
    pub async fn arn(&self) -> Result<String> {
        let out = self.attributes(&[QueueAttributeName::QueueArn]).await?;
        out.attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn))
            .cloned()
            .ok_or_else(|| Error::Config(format!("SQS gave no ARN for queue {}", self.name)))
    }

    /// Starts moving every message of this dead-letter queue to `to` (SQS's `StartMessageMoveTask`,
    /// the destination named: a message sent to the dead-letter queue directly has no source for SQS
    /// to find), at SQS's own pace. Returns the task's handle. A standard queue's only: a FIFO queue's
    /// move would keep each message's de-duplication id, and one sent again within 5 minutes of its
    /// first send would be dropped (see `initiator dlq redrive`). `arn` is this queue's ([`Self::arn`],
    /// read once by the caller, which follows the task with it).
    pub async fn start_move_to(&self, arn: &str, to: &SqsQueue) -> Result<String> {
        let to_arn = to.arn().await?;
        self.policy
            .run(Op::SqsStartMessageMoveTask, On::Move { from: &self.name, to: &to.name }, Duration::ZERO, || async {
                let out = self
                    .client
                    .start_message_move_task()
                    .source_arn(arn)
                    .destination_arn(&to_arn)
                    .send()
                    .await
                    .map_err(|e| self.err(Op::SqsStartMessageMoveTask, e))?;
                Ok(out.task_handle().unwrap_or_default().to_string())
            })
            .await
    }

    /// The most recent message move task from this queue (its `arn`), if any (`ListMessageMoveTasks`).
    pub async fn move_task(&self, arn: &str) -> Result<Option<MoveTask>> {
        self.policy
            .run(Op::SqsListMessageMoveTasks, On::Queue(&self.name), Duration::ZERO, || async {
                let out =
                    self.client.list_message_move_tasks().source_arn(arn).max_results(1).send().await.map_err(|e| self.err(Op::SqsListMessageMoveTasks, e))?;
                Ok(out.results().first().map(|t| MoveTask {
                    status: t.status().unwrap_or("UNKNOWN").to_string(),
                    moved: t.approximate_number_of_messages_moved(),
                    to_move: t.approximate_number_of_messages_to_move(),
                    failure: t.failure_reason().map(str::to_string),
                    handle: t.task_handle().map(str::to_string),
                }))
            })
            .await
    }

    async fn attributes(&self, names: &[QueueAttributeName]) -> Result<aws_sdk_sqs::operation::get_queue_attributes::GetQueueAttributesOutput> {
        self.policy
            .run(Op::SqsGetQueueAttributes, On::Queue(&self.name), Duration::ZERO, || async {
                self.client
                    .get_queue_attributes()
                    .queue_url(&self.url)
                    .set_attribute_names(Some(names.to_vec()))
                    .send()
                    .await
                    .map_err(|e| self.err(Op::SqsGetQueueAttributes, e))
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
                    // The body names the job and chunk, so its hash is a stable de-duplication id
                    // (a redrive brings its own).
                    e = e.message_group_id(m.attrs.group.as_deref().unwrap_or("default")).message_deduplication_id(m.dedup_id());
                }
                e.build()
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(e.to_string()))?;
        // What SQS bills: one request per 64 KiB of the call's payload (bodies and attributes).
        let payload: usize = msgs.iter().map(|(_, m)| m.body.len() + attrs_len(&m.attrs)).sum();
        let out = self
            .policy
            .run(Op::SqsSendMessageBatch, On::Queue(&self.name), Duration::ZERO, || async {
                self.count_payload(payload);
                self.client
                    .send_message_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(entries.clone()))
                    .send()
                    .await
                    .map_err(|e| self.err(Op::SqsSendMessageBatch, e))
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
                    source: None,
                });
            }
            failed.push(f.id().parse::<usize>().unwrap_or(usize::MAX));
        }
        Ok(failed)
    }
}

/// The bytes `attrs` add to a message's payload, as SQS counts them (names, types and values).
fn attrs_len(attrs: &Attrs) -> usize {
    attribute_values(attrs).iter().map(|(name, v)| name.len() + v.data_type().len() + v.string_value().map_or(0, str::len)).sum()
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
    if let Some(t) = &attrs.trace {
        out.extend(text(t).map(|v| ("traceparent", v)));
    }
    if let Some(a) = &attrs.auth {
        out.extend(text(a).map(|v| (crate::auth::ATTRIBUTE, v)));
    }
    if let Some(t) = &attrs.chunk_token {
        out.extend(text(t).map(|v| (crate::auth::CHUNK_ATTRIBUTE, v)));
    }
    out
}

#[async_trait]
impl Queue for SqsQueue {
    fn name(&self) -> &str {
        &self.name
    }

    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64> {
        // The body and its attributes (priority, deadline, reason, traceparent, signature, chunk
        // token: under 400 bytes).
        let sizes: Vec<usize> = msgs.iter().map(|m| m.body.len() + 400).collect();
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
                        source: None,
                    });
                }
                pending.retain(|(i, _)| failed.contains(i));
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            }
        }
        Ok(calls)
    }
    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Delivery>> {
        let wait = wait.min(Duration::from_secs(20));
        // One attempt: the listener has its own back-off for a failed receive, and messages a timed-out
        // receive took come back after their visibility timeout.
        let out = self
            .policy
            .once(Op::SqsReceiveMessage, On::Queue(&self.name), wait, async {
                self.client
                    .receive_message()
                    .queue_url(&self.url)
                    .max_number_of_messages(max.clamp(1, 10) as i32)
                    .wait_time_seconds(wait.as_secs() as i32)
                    .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                    .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                    .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
                    .message_attribute_names("All")
                    .send()
                    .await
                    .map_err(|e| self.err(Op::SqsReceiveMessage, e))
            })
            .await?;
        let payload: usize = out.messages().iter().map(|m| m.body().map_or(0, str::len)).sum();
        self.count_payload(payload);
        Ok(out
            .messages()
            .iter()
            .map(|m| {
                let message = Message {
                    id: m.message_id().unwrap_or_default().to_string(),
                    body: m.body().unwrap_or_default().to_string(),
                    receive_count: m
                        .attributes()
                        .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(1),
                    sent_ms: m.attributes().and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp)).and_then(|v| v.parse().ok()),
                    attrs: {
                        let attr = |n: &str| m.message_attributes().and_then(|a| a.get(n)).and_then(|v| v.string_value());
                        Attrs {
                            priority: attr("priority").and_then(|v| v.parse().ok()).unwrap_or(0),
                            deadline_ms: attr("deadline").and_then(|v| v.parse().ok()),
                            group: m.attributes().and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId)).cloned(),
                            reason: attr("reason").map(str::to_string),
                            trace: attr("traceparent").map(str::to_string),
                            auth: attr(crate::auth::ATTRIBUTE).map(str::to_string),
                            chunk_token: attr(crate::auth::CHUNK_ATTRIBUTE).map(str::to_string),
                        }
                    },
                };
                Delivery::new(message, m.receipt_handle().unwrap_or_default().to_string())
            })
            .collect())
    }

    async fn delete_receipts(&self, receipts: &[&Receipt]) -> Result<Vec<usize>> {
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
            .run(Op::SqsDeleteMessageBatch, On::Queue(&self.name), Duration::ZERO, || async {
                self.client
                    .delete_message_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(entries.clone()))
                    .send()
                    .await
                    .map_err(|e| self.err(Op::SqsDeleteMessageBatch, e))
            })
            .await?;
        Ok(failed_entries(receipts.len(), out.failed().iter().map(|f| (f.id(), f.code()))))
    }

    async fn change_visibility(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let built = entries
            .iter()
            .enumerate()
            .map(|(i, (r, t))| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*r)
                    // Whole seconds on SQS: a part second rounds up (a short retry delay must not become 0).
                    .visibility_timeout((t.as_secs() + u64::from(t.subsec_nanos() > 0)).min(43_200) as i32)
                    .build()
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(e.to_string()))?;
        let out = self
            .policy
            .run(Op::SqsChangeMessageVisibilityBatch, On::Queue(&self.name), Duration::ZERO, || async {
                self.client
                    .change_message_visibility_batch()
                    .queue_url(&self.url)
                    .set_entries(Some(built.clone()))
                    .send()
                    .await
                    .map_err(|e| self.err(Op::SqsChangeMessageVisibilityBatch, e))
            })
            .await?;
        Ok(failed_entries(entries.len(), out.failed().iter().map(|f| (f.id(), f.code()))))
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
        &self.policy.calls
    }

    fn breaker(&self) -> Option<std::sync::Arc<Breaker>> {
        self.policy.breaker.clone()
    }
}

/// The indexes of the failed entries of a batch call (entry ids are indexes below `n`). An entry whose
/// receipt is no longer valid will never succeed: it is dropped, not retried.
fn failed_entries<'a>(n: usize, failed: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<usize> {
    failed
        .filter(|(_, code)| !matches!(*code, "ReceiptHandleIsInvalid" | "InvalidParameterValue" | "MessageNotInflight"))
        .filter_map(|(id, _)| id.parse::<usize>().ok().filter(|i| *i < n))
        .collect()
}
