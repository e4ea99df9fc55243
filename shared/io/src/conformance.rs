//! Conformance suites for the queue and the blob store: the behaviour the fleet relies on, run
//! against the in-memory twins (unit tests) and the SQS/S3 implementations on LocalStack (fleet-io's
//! `tests/it`), so a twin that drifts from the real service fails here instead of passing a test of
//! the algorithms it stands in for. Each check panics with what differed.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;

use crate::blob::{BlobStore, Cond};
use crate::queue::{Delivery, Outgoing, Queue, MAX_BATCH_ENTRIES};

/// How long a receive may wait for what the suite expects to be there.
const WAIT: Duration = Duration::from_secs(2);

/// Receives until `n` messages came or a receive brings nothing.
async fn receive_n(q: &dyn Queue, n: usize) -> Vec<Delivery> {
    let mut got = Vec::new();
    while got.len() < n {
        let batch = q.receive(((n - got.len()).min(MAX_BATCH_ENTRIES)) as u32, WAIT).await.expect("receive");
        if batch.is_empty() {
            break;
        }
        got.extend(batch);
    }
    got
}

/// A standard queue `q` with redrive to `dlq` after `max_receive_count` = 2, both empty.
/// Visibility: a received message is invisible until deleted or released; a release makes it
/// receivable again with its receive count raised; a delete is final. (Not checked: a stale receipt;
/// SQS says a delete with one "succeeds, but the message might not be deleted".)
/// Batch limits: 25 messages go out in batch calls of at most 10 and a receive brings at most 10.
/// Redrive: the receive after the second moves the message to the dead-letter queue.
pub async fn queue_semantics(q: &dyn Queue, dlq: &dyn Queue) {
    let info = q.info().await.expect("info");
    assert_eq!(info.max_receive_count, Some(2), "{}: the suite needs maxReceiveCount 2", q.name());
    assert!(!info.fifo);

    // Batch limits: 25 bodies need 3 SendMessageBatch calls; a receive asks for at most 10.
    let bodies: Vec<String> = (0..25).map(|i| format!("m{i:02}")).collect();
    assert_eq!(q.send(bodies.clone()).await.expect("send"), 3, "25 messages in batches of 10");
    let first = q.receive(10, WAIT).await.expect("receive");
    assert!(!first.is_empty() && first.len() <= 10, "a receive of 10 brought {}", first.len());
    let mut all = first;
    all.extend(receive_n(q, 25 - all.len()).await);
    let mut got: Vec<String> = all.iter().map(|m| m.body.clone()).collect();
    got.sort();
    assert_eq!(got, bodies, "every message once");
    assert!(all.iter().all(|m| m.receive_count == 1), "first receive counts 1");
    // In flight: invisible.
    assert!(q.receive(10, Duration::ZERO).await.expect("receive").is_empty(), "in-flight messages are invisible");
    // Delete 24 of them (in batches of 10); release the last at once.
    let keep = all.pop().expect("25 messages");
    let kept = keep.body.clone();
    assert_eq!(q.delete(all).await.expect("delete"), 3, "24 deletes in 3 calls");
    keep.release(q, Duration::ZERO).await.map_err(|(e, _)| e).expect("release");
    let mut again = receive_n(q, 1).await;
    assert_eq!(again.len(), 1, "a released message is receivable again");
    assert_eq!((again[0].body.as_str(), again[0].receive_count), (kept.as_str(), 2), "same message, second receive");
    // A release with a delay: invisible until it passes.
    let second = again.pop().expect("one");
    second.release(q, Duration::from_secs(1)).await.map_err(|(e, _)| e).expect("release with a delay");
    assert!(q.receive(10, Duration::ZERO).await.expect("receive").is_empty(), "invisible during its delay");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Third receive: past maxReceiveCount, the message moves to the dead-letter queue instead.
    let third = q.receive(10, WAIT).await.expect("receive");
    assert!(third.is_empty(), "the receive past maxReceiveCount moves it, it does not deliver it: {third:?}");
    let dead = receive_n(dlq, 1).await;
    assert_eq!(dead.len(), 1, "redriven to the dead-letter queue");
    assert_eq!(dead[0].body, kept);
    dlq.delete(dead).await.expect("delete");
    assert!(q.receive(10, Duration::ZERO).await.expect("receive").is_empty(), "nothing left");
}

/// A FIFO queue, empty: messages of one group come in order, and while one is in flight the group's
/// later messages are not delivered; other groups are; a body sent twice within the de-duplication
/// window is delivered once, and again when it is sent with a de-duplication id of its own (a redrive).
pub async fn fifo_order(q: &dyn Queue) {
    assert!(q.info().await.expect("info").fifo, "{} is not FIFO", q.name());
    let msg = |group: &str, i: u32| {
        let mut m = Outgoing::plain(format!("{group}{i}"));
        m.attrs.group = Some(group.to_string());
        m
    };
    let out: Vec<Outgoing> = (1..=3).flat_map(|i| [msg("a", i), msg("b", i)]).collect();
    q.send_messages(&out).await.expect("send");
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // One message at a time: each group yields its next only after the previous is deleted.
    for _ in 0..6 {
        let got = q.receive(1, WAIT).await.expect("receive");
        assert_eq!(got.len(), 1, "a message of some group is available");
        let m = got.into_iter().next().expect("one");
        let group = m.attrs.group.clone().expect("a FIFO message has its group");
        order.entry(group).or_default().push(m.body.clone());
        m.delete(q).await.map_err(|(e, _)| e).expect("delete");
    }
    assert_eq!(order.get("a").map(Vec::as_slice), Some(&["a1".to_string(), "a2".into(), "a3".into()][..]), "{order:?}");
    assert_eq!(order.get("b").map(Vec::as_slice), Some(&["b1".to_string(), "b2".into(), "b3".into()][..]), "{order:?}");
    // While a group's message is in flight, its successors wait.
    q.send_messages(&[msg("c", 1), msg("c", 2)]).await.expect("send");
    let first = q.receive(10, WAIT).await.expect("receive");
    assert_eq!(first.iter().map(|m| m.body.as_str()).collect::<Vec<_>>().first(), Some(&"c1"), "c1 first");
    let held: Vec<_> = first.iter().filter(|m| m.body == "c2").collect();
    if held.is_empty() {
        assert!(q.receive(10, Duration::ZERO).await.expect("receive").is_empty(), "c2 waits while c1 is in flight");
    }
    q.delete(first).await.expect("delete");
    q.delete(receive_n(q, 1).await).await.expect("delete");
    // The same body sent again within the de-duplication window (a send retried after a lost
    // answer, or a redrive too soon) is accepted and dropped: one copy is delivered.
    q.send_messages(&[msg("d", 1)]).await.expect("send");
    q.send_messages(&[msg("d", 1)]).await.expect("a duplicate send is accepted");
    let got = receive_n(q, 1).await;
    assert_eq!(got.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), ["d1"]);
    q.delete(got).await.expect("delete");
    assert!(q.receive(10, Duration::from_secs(2)).await.expect("receive").is_empty(), "the duplicate was dropped");
    // A redrive of it, still within the window, carries its own de-duplication id: delivered again;
    // the redrive's own retry is dropped.
    let redrive = Outgoing { dedup: Some(Outgoing::redrive_dedup("d1", "dlq-message-1")), ..msg("d", 1) };
    q.send_messages(std::slice::from_ref(&redrive)).await.expect("send the redrive");
    q.send_messages(&[redrive]).await.expect("a retried redrive is accepted");
    let got = receive_n(q, 1).await;
    assert_eq!(got.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), ["d1"], "the redrive is delivered");
    q.delete(got).await.expect("delete");
    assert!(q.receive(10, Duration::from_secs(2)).await.expect("receive").is_empty(), "the redrive's retry was dropped");
}

/// A blob store with nothing under `prefix`: a missing object reads as `None`; conditional writes
/// (If-None-Match `*`, If-Match ETag) succeed exactly when their condition holds; metadata travels
/// with the object and `head` reads it without the body; listing is by prefix in key order, with a
/// limit; a delete is idempotent.
pub async fn blob_semantics(store: &dyn BlobStore, prefix: &str) {
    let key = format!("{prefix}doc");
    assert!(store.get(&key).await.expect("get").is_none(), "missing object reads as None");
    assert!(store.head(&key).await.expect("head").is_none(), "missing object heads as None");
    let meta = BTreeMap::from([("progress".to_string(), "3/4".to_string())]);
    let e1 = store.put_if(&key, Bytes::from_static(b"one"), "text/plain", &meta, &Cond::Absent).await.expect("put").expect("created when absent");
    assert!(
        store.put_if(&key, Bytes::from_static(b"two"), "text/plain", &meta, &Cond::Absent).await.expect("put").is_none(),
        "If-None-Match refuses an existing key"
    );
    let (body, etag) = store.get_tagged(&key).await.expect("get").expect("exists");
    assert_eq!((body.as_ref(), etag.as_str()), (&b"one"[..], e1.as_str()), "body and ETag as written");
    assert_eq!(store.head(&key).await.expect("head"), Some(meta.clone()), "metadata via head");
    let e2 =
        store.put_if(&key, Bytes::from_static(b"two"), "text/plain", &meta, &Cond::Matches(e1.clone())).await.expect("put").expect("If-Match the current ETag");
    assert_ne!(e1, e2, "a write changes the ETag");
    assert!(store.put_if(&key, Bytes::from_static(b"three"), "text/plain", &meta, &Cond::Matches(e1)).await.expect("put").is_none(), "a stale ETag is refused");
    assert_eq!(store.get(&key).await.expect("get").as_deref(), Some(&b"two"[..]), "the refused write changed nothing");
    // Capped reads: an object within the cap reads whole, a larger one is refused as corrupt, an empty
    // one reads empty, a missing one as None.
    assert_eq!(store.get_capped(&key, 3).await.expect("get").as_deref(), Some(&b"two"[..]), "exactly at the cap");
    assert!(matches!(store.get_capped(&key, 2).await, Err(crate::Error::Corrupt(_))), "over the cap");
    let empty = format!("{prefix}empty");
    store.put(&empty, Bytes::new(), "text/plain").await.expect("put");
    assert_eq!(store.get_capped(&empty, 10).await.expect("get").as_deref(), Some(&b""[..]), "an empty object");
    assert!(store.get_capped(&format!("{prefix}none"), 10).await.expect("get").is_none(), "a missing object");
    store.delete(&empty).await.expect("delete");
    for k in ["b", "a", "c"] {
        store.put(&format!("{prefix}list/{k}"), Bytes::from_static(b"x"), "text/plain").await.expect("put");
    }
    assert_eq!(store.list(&format!("{prefix}list/"), 10).await.expect("list"), ["a", "b", "c"].map(|k| format!("{prefix}list/{k}")), "by prefix, in key order");
    assert_eq!(store.list(&format!("{prefix}list/"), 2).await.expect("list").len(), 2, "limit");
    store.delete(&key).await.expect("delete");
    store.delete(&key).await.expect("a second delete is no error");
    assert!(store.get(&key).await.expect("get").is_none(), "deleted");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryQueue, MemoryStore};

    #[tokio::test]
    async fn the_memory_queue_conforms() {
        let dlq = MemoryQueue::new("conformance-dlq", Duration::from_secs(30));
        let q = MemoryQueue::with_dlq("conformance", Duration::from_secs(30), 2, dlq.clone());
        queue_semantics(q.as_ref(), dlq.as_ref()).await;
    }

    #[tokio::test]
    async fn the_memory_fifo_queue_conforms() {
        let q = MemoryQueue::new("conformance.fifo", Duration::from_secs(30));
        fifo_order(q.as_ref()).await;
    }

    #[tokio::test]
    async fn the_memory_store_conforms() {
        blob_semantics(MemoryStore::new().as_ref(), "conformance/").await;
    }
}
