//! Operator commands: `abandon` (finish a job that will never seal, now, with what was processed) and
//! `dlq` (list, show and redrive what sits in the work and results dead-letter queues and in the
//! quarantine of unreadable messages).

use std::time::Duration;

use fleet_domain::layout::check_job_id;
use fleet_domain::model::{ResultMessage, WIRE_VERSION};
use fleet_io::auth::Key;
use fleet_io::blob::BlobStore;
use fleet_io::quarantine::{self, Quarantined};
use fleet_io::queue::{Delivery, Message, Outgoing, Queue, SqsQueue};
use fleet_io::trigger::{announce, TriggerBus, WorkDetected};
use serde::Serialize;

use crate::cli::RedriveMethod;
use crate::CliError;

/// Sends the job's `Abandon` message: the controller finishes it as `abandoned` when it reads it.
/// The abandon goes to the job's results partition: `partition` (its manifest's, when it has one),
/// else the one its id hashes to with the fleet's partition count (as `submit` chose it).
/// It is signed with `key` (`--signing-key`: an operator's for `initiator abandon`, the submitter's for
/// a submission that gives up on itself); a controller with a keyring counts an abandon only from a
/// submitter or an operator. `None`: sent unsigned.
pub async fn abandon(
    results: &std::sync::Arc<dyn Queue>,
    triggers: Option<&dyn TriggerBus>,
    job_id: &str,
    reason: &str,
    partition: Option<u16>,
    key: Option<&Key>,
) -> Result<(), CliError> {
    check_job_id(job_id).map_err(|e| CliError::Input(e.to_string()))?;
    let p = partition.unwrap_or_else(|| fleet_domain::layout::partition_of(job_id, fleet_io::queue::partitions(results).len() as u16));
    let results = fleet_io::queue::partition(results, p)?;
    let body = serde_json::to_string(&ResultMessage::Abandon { v: WIRE_VERSION, job_id: job_id.to_string(), reason: reason.to_string() })
        .map_err(fleet_io::Error::from)?;
    let out = Outgoing { attrs: fleet_io::queue::Attrs { auth: key.map(|k| k.sign(&body)), ..Default::default() }, body, dedup: None };
    results.send_messages(std::slice::from_ref(&out)).await?;
    if let Some(bus) = triggers {
        announce(bus, &WorkDetected { queue: results.name().to_string(), messages: 1, source: "initiator".into() }).await;
    }
    Ok(())
}

/// A dead letter or quarantined message, as listed.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    /// `billing-work-dlq`, `billing-results-dlq` or `quarantine`.
    pub place: String,
    /// SQS message id, or the quarantine key.
    pub id: String,
    pub receive_count: u32,
    /// Why it is there (the listener's reason attribute, or the quarantine reason), when known.
    pub reason: Option<String>,
    /// Job and chunk, when the body names them.
    pub job_id: Option<String>,
    pub chunk: Option<u32>,
    pub body_bytes: usize,
    /// The whole body (`show`) or its first 200 characters (`list`).
    pub body: String,
}

fn describe(body: &str) -> (Option<String>, Option<u32>) {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    (v.get("job_id").and_then(|j| j.as_str()).map(str::to_string), v.get("chunk").and_then(|c| c.as_u64()).and_then(|c| u32::try_from(c).ok()))
}

fn preview(body: &str, full: bool) -> String {
    if full {
        body.to_string()
    } else {
        body.chars().take(200).collect()
    }
}

fn entry_of_message(place: &str, m: &Message, full: bool) -> Entry {
    let (job_id, chunk) = describe(&m.body);
    Entry {
        place: place.to_string(),
        id: m.id.clone(),
        receive_count: m.receive_count,
        reason: m.attrs.reason.clone(),
        job_id,
        chunk,
        body_bytes: m.body.len(),
        body: preview(&m.body, full),
    }
}

fn entry_of_quarantined(key: &str, q: &Quarantined, full: bool) -> Entry {
    let (job_id, chunk) = describe(&q.body);
    Entry {
        place: "quarantine".into(),
        id: key.to_string(),
        receive_count: q.receive_count,
        reason: Some(format!("{} (from {})", q.reason, q.queue)),
        job_id,
        chunk,
        body_bytes: q.body.len(),
        body: preview(&q.body, full),
    }
}

/// Looks at up to `limit` messages of a queue without consuming them: each received message is made
/// visible again at once (its receive count grows by one).
async fn peek(q: &dyn Queue, limit: usize) -> Result<Vec<Message>, CliError> {
    let mut out: Vec<Message> = Vec::new();
    // Every delivery is held until the whole look is over, so one look does not see a message twice;
    // then all of them (a message received twice too) go back at once.
    let mut held: Vec<Delivery> = Vec::new();
    while out.len() < limit {
        let got = q.receive((limit - out.len()).min(10) as u32, Duration::ZERO).await?;
        if got.is_empty() {
            break;
        }
        let before = out.len();
        for d in got {
            if !out.iter().any(|o| o.id == d.id) {
                out.push((*d).clone());
            }
            held.push(d);
        }
        if out.len() == before {
            break;
        }
    }
    q.release(held, Duration::ZERO).await?;
    Ok(out)
}

/// Dead-letter queues and the quarantine, listed (bodies cut to 200 characters).
pub async fn list(dlqs: &[&dyn Queue], store: &dyn BlobStore, limit: usize) -> Result<Vec<Entry>, CliError> {
    let mut out = Vec::new();
    for q in dlqs {
        out.extend(peek(*q, limit).await?.iter().map(|m| entry_of_message(q.name(), m, false)));
    }
    for key in quarantine::list(store, limit).await? {
        if let Some(q) = quarantine::read(store, &key).await? {
            out.push(entry_of_quarantined(&key, &q, false));
        }
    }
    Ok(out)
}

/// One entry by SQS message id or quarantine key.
pub async fn show(dlqs: &[&dyn Queue], store: &dyn BlobStore, id: &str) -> Result<Entry, CliError> {
    if id.starts_with(quarantine::QUARANTINE_PREFIX) {
        return match quarantine::read(store, id).await? {
            Some(q) => Ok(entry_of_quarantined(id, &q, true)),
            None => Err(CliError::Input(format!("nothing quarantined under {id}"))),
        };
    }
    for q in dlqs {
        if let Some(m) = peek(*q, 1000).await?.iter().find(|m| m.id == id) {
            return Ok(entry_of_message(q.name(), m, true));
        }
    }
    Err(CliError::Input(format!("no message {id} in {} (nor a quarantine key)", dlqs.iter().map(|q| q.name()).collect::<Vec<_>>().join(", "))))
}

/// Most messages `dlq redrive` copies per place when `--limit` is not given.
pub const REDRIVE_LIMIT: usize = 1000;

/// The method `dlq redrive` uses for the dead-letter queue `dlq`: `auto` is a move task for a standard
/// queue without a limit, else a copy; a move task is refused for a FIFO queue (its messages would
/// keep their de-duplication ids: one dead-lettered within 5 minutes of its first send would be
/// dropped on arrival) and with a limit (a move task moves them all).
pub fn redrive_method(asked: RedriveMethod, dlq: &str, limit: Option<usize>) -> Result<RedriveMethod, CliError> {
    let fifo = dlq.ends_with(".fifo");
    match asked {
        RedriveMethod::Auto if fifo || limit.is_some() => Ok(RedriveMethod::Copy),
        RedriveMethod::Auto => Ok(RedriveMethod::MoveTask),
        RedriveMethod::MoveTask if fifo => Err(CliError::Input(format!(
            "{dlq} is a FIFO queue: a move task would keep each message's de-duplication id, and SQS would drop those sent again within 5 minutes \
             of their first send; use --method copy (or auto), which sends each with an id of its own"
        ))),
        RedriveMethod::MoveTask if limit.is_some() => Err(CliError::Input("--limit applies to --method copy: a move task moves every message".into())),
        m => Ok(m),
    }
}

/// Moves every message of the dead-letter queue `dlq` to `to` with SQS's message move task, and follows
/// the task (progress on stderr) until it ends or `within` passes. Returns how many it moved; a failed
/// task is an infrastructure error naming its reason.
pub async fn move_back(dlq: &SqsQueue, to: &SqsQueue, within: Duration) -> Result<usize, CliError> {
    // Read once: the task is followed with it every 500 ms.
    let arn = dlq.arn().await?;
    let handle = dlq.start_move_to(&arn, to).await?;
    tracing::debug!(queue = dlq.name(), %handle, "message move task started");
    let until = tokio::time::Instant::now() + within;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let task = dlq.move_task(&arn).await?;
        let Some(task) = task else { continue };
        let to_move = task.to_move.map_or_else(|| "?".to_string(), |n| n.to_string());
        eprintln!("{}: move task {}, {} of {to_move} moved", dlq.name(), task.status.to_lowercase(), task.moved);
        if task.ended() {
            return match task.status.as_str() {
                "COMPLETED" => Ok(usize::try_from(task.moved).unwrap_or(0)),
                _ => Err(CliError::Infra(fleet_io::Error::Config(format!(
                    "the move task from {} ended {}: {} (moved {})",
                    dlq.name(),
                    task.status,
                    task.failure.as_deref().unwrap_or("no reason given"),
                    task.moved
                )))),
            };
        }
        if tokio::time::Instant::now() >= until {
            eprintln!("{}: the move task goes on without us ({} moved so far); `initiator dlq list` shows what is left", dlq.name(), task.moved);
            return Ok(usize::try_from(task.moved).unwrap_or(0));
        }
    }
}

/// Moves up to `limit` messages from `from` back to `to` (sent first, then deleted: a crash between
/// the two leaves a duplicate, which every consumer ignores). Returns how many moved.
pub async fn redrive_queue(from: &dyn Queue, to: &dyn Queue, limit: usize) -> Result<usize, CliError> {
    let mut moved = 0;
    while moved < limit {
        let got = from.receive((limit - moved).min(10) as u32, Duration::ZERO).await?;
        if got.is_empty() {
            break;
        }
        // Each with a de-duplication id of its own on a FIFO queue: a message dead-lettered within 5
        // minutes of its first send would otherwise be dropped as that send's duplicate. Its other
        // attributes go with it as they came, its sender's signature (`auth`) among them: the redrive
        // signs nothing of its own.
        let out: Vec<Outgoing> = got
            .iter()
            .map(|m| Outgoing {
                body: m.body.clone(),
                attrs: fleet_io::queue::Attrs { reason: None, ..m.attrs.clone() },
                dedup: Some(Outgoing::redrive_dedup(&m.body, &m.id)),
            })
            .collect();
        to.send_messages(&out).await?;
        moved += got.len();
        from.delete(got).await?;
    }
    Ok(moved)
}

/// Sends quarantined messages back to where they are read: a message quarantined from a dead-letter
/// queue goes to that queue's source (`targets` maps queue names to the queue to send to). Returns how
/// many moved; those whose queue is unknown stay.
pub async fn redrive_quarantine(store: &dyn BlobStore, targets: &[(&str, &dyn Queue)], limit: usize) -> Result<usize, CliError> {
    let mut moved = 0;
    for key in quarantine::list(store, limit).await? {
        let Some(q) = quarantine::read(store, &key).await? else { continue };
        match targets.iter().find(|(name, _)| *name == q.queue) {
            Some((_, to)) => {
                quarantine::send_back(store, &key, &q, *to).await?;
                moved += 1;
            }
            None => tracing::warn!(%key, queue = %q.queue, "no queue of this fleet to redrive it to; left in quarantine"),
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use fleet_io::auth::{Keyring, Refused, Role};
    use fleet_io::memory::MemoryQueue;
    use fleet_io::queue::Attrs;

    use super::*;

    const JOB: &str = "0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b";

    /// The messages on `q`, taken off it: body and signature each.
    async fn taken(q: &MemoryQueue) -> Vec<(String, Option<String>)> {
        let got = q.receive(10, Duration::ZERO).await.unwrap();
        let out = got.iter().map(|d| (d.body.clone(), d.attrs.auth.clone())).collect();
        q.delete(got).await.unwrap();
        out
    }

    #[tokio::test]
    async fn an_abandon_is_signed_with_the_key_it_is_given() {
        let operator = Key::generate(Role::Operator);
        let ring = Keyring::new([operator.clone(), Key::generate(Role::Submitter)]);
        let mem = MemoryQueue::new("results", Duration::from_secs(30));
        let results: std::sync::Arc<dyn Queue> = mem.clone();
        abandon(&results, None, JOB, "operator gave up", None, Some(&operator)).await.unwrap();
        let sent = taken(&mem).await;
        assert_eq!(sent.len(), 1);
        let (body, auth) = &sent[0];
        assert!(matches!(serde_json::from_str(body).unwrap(), ResultMessage::Abandon { .. }), "{body}");
        assert_eq!(ring.verify(body, auth.as_deref()), Ok(Role::Operator));
        // Without a key: unsigned, and a keyring does not count it.
        abandon(&results, None, JOB, "operator gave up", None, None).await.unwrap();
        let sent = taken(&mem).await;
        assert_eq!(ring.verify(&sent[0].0, sent[0].1.as_deref()), Err(Refused::Unsigned));
    }

    #[tokio::test]
    async fn a_work_item_keeps_its_submitters_signature_through_expiry_and_a_redrive() {
        let submitter = Key::generate(Role::Submitter);
        let ring = Keyring::new([submitter.clone()]);
        let work = MemoryQueue::new("work", Duration::from_secs(30));
        let dlq = MemoryQueue::new("work-dlq", Duration::from_secs(30));
        let body = r#"{"v":1,"job_id":"j","chunk":0}"#.to_string();
        let attrs = Attrs { priority: 3, auth: Some(submitter.sign(&body)), ..Attrs::default() };
        work.send_messages(&[Outgoing { body: body.clone(), attrs, dedup: None }]).await.unwrap();
        // Dead-lettered as a listener does with an expired work item.
        let d = work.receive(1, Duration::ZERO).await.unwrap().pop().unwrap();
        d.dead_letter(work.as_ref(), dlq.as_ref(), "expired").await.map_err(|(e, _)| e).unwrap();
        let peeked = peek(dlq.as_ref(), 10).await.unwrap();
        assert_eq!(ring.verify(&peeked[0].body, peeked[0].attrs.auth.as_deref()), Ok(Role::Submitter), "in the dead-letter queue");
        // `initiator dlq redrive` (a copy) sends it back with its signature, not a new one nor none.
        assert_eq!(redrive_queue(dlq.as_ref(), work.as_ref(), 10).await.unwrap(), 1);
        let back = taken(&work).await;
        assert_eq!(back, vec![(body.clone(), Some(submitter.sign(&body)))]);
        assert_eq!(ring.verify(&back[0].0, back[0].1.as_deref()), Ok(Role::Submitter), "redriven");
    }
}
