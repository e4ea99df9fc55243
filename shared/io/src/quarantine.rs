//! Quarantine: a message no consumer can read (not JSON, not the fleet's schema, an invalid job id)
//! is stored in S3 with its queue, receive count, reason and body, and only then deleted from its
//! queue. Nothing is hidden for hours or lost; `initiator dlq` lists, shows and redrives it.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::blob::BlobStore;
use crate::error::{Error, Result};
use crate::queue::{Attrs, Message, Outgoing, Queue};

/// Messages no consumer could read, kept for an operator (`quarantine/{queue}/{message}.json`).
pub const QUARANTINE_PREFIX: &str = "quarantine/";

/// A quarantined message's key; queue names and message ids are reduced to key-safe characters.
pub fn quarantine_key(queue: &str, message_id: &str) -> String {
    let safe = |s: &str| s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).take(128).collect::<String>();
    format!("{QUARANTINE_PREFIX}{}/{}.json", safe(queue), safe(message_id))
}

/// Largest quarantined document read back.
const MAX_DOC: usize = 2 << 20;

/// A quarantined message as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quarantined {
    /// Queue it was received from.
    pub queue: String,
    pub message_id: String,
    /// Receives so far, the one that quarantined it included.
    pub receive_count: u32,
    /// Why no consumer can read it.
    pub reason: String,
    /// The body as received.
    pub body: String,
    #[serde(default)]
    pub priority: i32,
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    #[serde(default)]
    pub group: Option<String>,
    /// Its sender's role signature (`auth`), so that a redrive keeps its sender's word.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<String>,
    /// Its chunk token (`auth::Key::chunk_token`), kept for a redrive too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_token: Option<String>,
    pub quarantined_at: String,
}

impl Quarantined {
    pub fn of(queue: &str, m: &Message, reason: &str) -> Quarantined {
        Quarantined {
            queue: queue.to_string(),
            message_id: m.id.clone(),
            receive_count: m.receive_count,
            reason: reason.to_string(),
            body: m.body.clone(),
            priority: m.attrs.priority,
            deadline_ms: m.attrs.deadline_ms,
            group: m.attrs.group.clone(),
            auth: m.attrs.auth.clone(),
            chunk_token: m.attrs.chunk_token.clone(),
            quarantined_at: time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default(),
        }
    }

    pub fn key(&self) -> String {
        quarantine_key(&self.queue, &self.message_id)
    }

    /// The message as it was sent (for a redrive).
    pub fn outgoing(&self) -> Outgoing {
        Outgoing {
            body: self.body.clone(),
            attrs: Attrs {
                priority: self.priority,
                deadline_ms: self.deadline_ms,
                group: self.group.clone(),
                reason: None,
                trace: None,
                auth: self.auth.clone(),
                chunk_token: self.chunk_token.clone(),
            },
            // Sent back later than a first send's window may be, or not: never dropped as its duplicate.
            dedup: Some(Outgoing::redrive_dedup(&self.body, &self.message_id)),
        }
    }
}

/// Stores `m` in the quarantine and returns its key; the caller deletes it from its queue once this
/// returned `Ok`, and says so (the controller's `MessageQuarantined` event: its log line and metric).
pub async fn put(store: &dyn BlobStore, queue: &str, m: &Message, reason: &str) -> Result<String> {
    let q = Quarantined::of(queue, m, reason);
    let key = q.key();
    store.put(&key, Bytes::from(serde_json::to_vec_pretty(&q)?), "application/json").await?;
    Ok(key)
}

/// Keys of quarantined messages, oldest key order, at most `limit`.
pub async fn list(store: &dyn BlobStore, limit: usize) -> Result<Vec<String>> {
    store.list(QUARANTINE_PREFIX, limit).await
}

/// Reads one quarantined message by key.
pub async fn read(store: &dyn BlobStore, key: &str) -> Result<Option<Quarantined>> {
    if !key.starts_with(QUARANTINE_PREFIX) {
        return Err(Error::Config(format!("{key:?} is not a quarantine key (they start with {QUARANTINE_PREFIX})")));
    }
    match store.get(key).await? {
        None => Ok(None),
        Some(b) if b.len() > MAX_DOC => Err(Error::Corrupt(format!("{key}: {} bytes, more than a quarantined message can hold", b.len()))),
        Some(b) => Ok(Some(serde_json::from_slice(&b)?)),
    }
}

/// Sends the quarantined message stored under `key` back to `queue`, then removes it from the
/// quarantine; `false` when there is none.
pub async fn redrive(store: &dyn BlobStore, key: &str, queue: &dyn Queue) -> Result<bool> {
    let Some(q) = read(store, key).await? else { return Ok(false) };
    send_back(store, key, &q, queue).await?;
    Ok(true)
}

/// Sends `q`, read from `key`, back to `queue`, then removes it from the quarantine.
pub async fn send_back(store: &dyn BlobStore, key: &str, q: &Quarantined, queue: &dyn Queue) -> Result<()> {
    queue.send_messages(&[q.outgoing()]).await?;
    store.delete(key).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryQueue, MemoryStore};

    #[tokio::test]
    async fn quarantine_keeps_everything_and_redrive_sends_it_back() {
        let store = MemoryStore::new();
        let m = Message {
            id: "id/1".into(),
            body: "{not json".into(),
            receive_count: 3,
            sent_ms: Some(1),
            attrs: Attrs {
                priority: 2,
                deadline_ms: Some(9),
                group: None,
                reason: Some("x".into()),
                trace: None,
                auth: Some("v1.processor.k.m".into()),
                chunk_token: None,
            },
        };
        let key = put(store.as_ref(), "billing-results-dlq", &m, "invalid JSON").await.unwrap();
        assert_eq!(key, "quarantine/billing-results-dlq/id_1.json");
        assert_eq!(list(store.as_ref(), 10).await.unwrap(), vec![key.clone()]);
        let q = read(store.as_ref(), &key).await.unwrap().unwrap();
        assert_eq!((q.body.as_str(), q.receive_count, q.reason.as_str(), q.priority), ("{not json", 3, "invalid JSON", 2));
        assert!(read(store.as_ref(), "jobs/x").await.is_err(), "only quarantine keys");
        let queue = MemoryQueue::new("billing-results", std::time::Duration::from_secs(30));
        assert!(redrive(store.as_ref(), &key, queue.as_ref()).await.unwrap());
        let back = queue.receive(10, std::time::Duration::ZERO).await.unwrap();
        assert_eq!((back.len(), back[0].body.as_str(), back[0].attrs.priority), (1, "{not json", 2));
        assert_eq!(back[0].attrs.auth.as_deref(), Some("v1.processor.k.m"), "a redrive keeps its sender's signature");
        assert!(list(store.as_ref(), 10).await.unwrap().is_empty());
        assert!(!redrive(store.as_ref(), &key, queue.as_ref()).await.unwrap(), "already redriven");
    }
}
