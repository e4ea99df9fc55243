//! The (deliberately simple) queue listener: `consumers` tasks long-poll the work queue in batches of
//! ten and handle each batch in parallel. Consumer 0 always polls; the others park after an empty
//! receive and wake when consumer 0 finds work or a work-detected trigger arrives, so an idle processor
//! makes one long poll per 20 s instead of one per consumer. (The adaptive engine replaces this.)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use shared::error::Error;
use shared::model::{ChunkResult, ResultMessage};
use shared::queue::{plan_batches, Message};
use shared::requests::RequestCounts;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::handle::{failed_result, parse_work_item, process};
use crate::{Deps, Settings};

struct Shared {
    settings: Settings,
    deps: Deps,
    /// maxReceiveCount of the work queue's redrive; a failure on that receive is final.
    max_receive: Option<u32>,
    wake: Notify,
}

pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> shared::Result<()> {
    let max_receive = deps.work.max_receive_count().await?;
    tracing::info!(queue = deps.work.name(), consumers = settings.consumers, ?max_receive, "processor started");
    let shared = Arc::new(Shared { settings, deps, max_receive, wake: Notify::new() });
    let tracker = TaskTracker::new();
    if let Some(tx) = &shared.deps.triggers {
        let mut rx = tx.subscribe();
        let (s, stop) = (shared.clone(), shutdown.clone());
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    ev = rx.recv() => match ev {
                        Ok(ev) if ev.queue == s.deps.work.name() => {
                            tracing::debug!(source = %ev.source, messages = ev.messages, "work-detected trigger");
                            s.wake.notify_waiters();
                        }
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(_) => return,
                    }
                }
            }
        });
    }
    // In-flight batches are not cancelled by the shutdown token: a consumer stops receiving, finishes
    // its batch and exits; the drain bound below caps how long that may take.
    for i in 0..shared.settings.consumers.max(1) {
        let (s, stop) = (shared.clone(), shutdown.clone());
        tracker.spawn(async move { consume(i, s, stop).await });
    }
    shutdown.cancelled().await;
    shared.wake.notify_waiters();
    let grace = Duration::from_secs(shared.settings.drain_secs);
    shared::shutdown::drain(&tracker, grace).await;
    tracing::info!("processor stopped");
    Ok(())
}

async fn consume(id: usize, s: Arc<Shared>, stop: CancellationToken) {
    let mut error_backoff = Duration::from_millis(100);
    let mut idle = false;
    loop {
        if id > 0 && idle {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = s.wake.notified() => {}
            }
        }
        let received = tokio::select! {
            _ = stop.cancelled() => return,
            r = s.deps.work.receive(10, s.settings.receive_wait()) => r,
        };
        match received {
            Ok(msgs) if msgs.is_empty() => idle = true,
            Ok(msgs) => {
                idle = false;
                error_backoff = Duration::from_millis(100);
                if id == 0 {
                    s.wake.notify_waiters();
                }
                handle_batch(&s, msgs).await;
            }
            Err(e) => {
                tracing::warn!(consumer = id, error = %e, retry_in_ms = error_backoff.as_millis() as u64, "receive failed");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(error_backoff) => {}
                }
                error_backoff = (error_backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// What became of one message of a batch.
enum Done {
    /// Send this result, then delete the work item.
    Processed(ChunkResult),
    /// Final failure: send this result, leave the work item to the dead-letter queue.
    FailedFinal(ChunkResult),
    /// Leave for redelivery.
    Retry,
}

async fn handle_batch(s: &Shared, msgs: Vec<Message>) {
    let outcomes = join_all(msgs.iter().map(|m| handle_one(s, m))).await;
    // Group by job so that per-job request counts are exact: each job's results and deletes go in
    // their own batch calls; a receive that served several jobs counts once for each.
    let mut by_job: BTreeMap<String, Vec<(usize, bool, ChunkResult)>> = BTreeMap::new();
    let mut retry = Vec::new();
    for (i, d) in outcomes.into_iter().enumerate() {
        match d {
            Done::Processed(r) => by_job.entry(r.job_id.clone()).or_default().push((i, true, r)),
            Done::FailedFinal(r) => {
                // Released at once: the next receive moves it to the dead-letter queue.
                retry.push(i);
                by_job.entry(r.job_id.clone()).or_default().push((i, false, r));
            }
            Done::Retry => retry.push(i),
        }
    }
    for (job, items) in by_job {
        let deletes: Vec<String> = items.iter().filter(|(_, delete, _)| *delete).map(|(i, _, _)| msgs[*i].receipt.clone()).collect();
        let mut results = items.into_iter().map(|(_, _, r)| r);
        let Some(mut first) = results.next() else { continue };
        // The first result carries the batch's calls, which depend on the body sizes: size it before
        // adding them (the slack covers the enum tag and the count digits), encode it once after.
        let encoded = serde_json::to_vec(&first).map(|b| b.len() + 128).and_then(|first_size| {
            let rest = results.map(|r| serde_json::to_string(&ResultMessage::Chunk(r))).collect::<Result<Vec<_>, _>>()?;
            let sizes: Vec<usize> = std::iter::once(first_size).chain(rest.iter().map(String::len)).collect();
            let mut batch_calls = RequestCounts::default();
            batch_calls.add("sqs.ReceiveMessage", 1);
            batch_calls.add("sqs.SendMessageBatch", plan_batches(&sizes).len() as u64);
            batch_calls.add("sqs.DeleteMessageBatch", deletes.len().div_ceil(10) as u64);
            first.requests.merge(&batch_calls);
            let head = serde_json::to_string(&ResultMessage::Chunk(first))?;
            Ok(std::iter::once(head).chain(rest).collect::<Vec<_>>())
        });
        let bodies = match encoded {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(%job, error = %e, "cannot encode results");
                continue;
            }
        };
        if let Err(e) = s.deps.results.send(&bodies).await {
            // Results not sent: do not delete; the work items come back and are processed again.
            tracing::warn!(%job, error = %e, "sending results failed; work items will be redelivered");
            continue;
        }
        if !deletes.is_empty() {
            if let Err(e) = s.deps.work.delete(&deletes).await {
                tracing::warn!(%job, error = %e, "deleting work items failed; they will be redelivered and counted once");
            }
        }
        tracing::debug!(%job, chunks = bodies.len(), "batch done");
    }
    let delay = Duration::from_secs(s.settings.retry_delay_secs);
    for i in retry {
        if let Err(e) = s.deps.work.set_visibility(&msgs[i].receipt, delay).await {
            tracing::debug!(error = %e, "could not shorten visibility of a failed work item");
        }
    }
}

async fn handle_one(s: &Shared, m: &Message) -> Done {
    let item = match parse_work_item(&m.body) {
        Ok(w) => w,
        Err(e) => {
            // No job to report to: it stays on the queue and goes to the dead-letter queue.
            tracing::error!(message_id = %m.id, receive_count = m.receive_count, error = %e, "unreadable work item");
            return Done::Retry;
        }
    };
    match process(&item, s.deps.store.as_ref(), s.settings.max_chunk_bytes).await {
        Ok(r) => Done::Processed(r),
        Err(e) => {
            let last = s.max_receive.is_some_and(|max| m.receive_count >= max);
            tracing::warn!(
                job = %item.job_id, chunk = item.chunk, receive_count = m.receive_count, retryable = e.is_retryable(), last_attempt = last,
                error = %e, "work item failed"
            );
            if last {
                Done::FailedFinal(failed_result(&item, failure_reason(&e, m.receive_count)))
            } else {
                Done::Retry
            }
        }
    }
}

fn failure_reason(e: &Error, receives: u32) -> String {
    format!("{e} (after {receives} attempts)")
}
