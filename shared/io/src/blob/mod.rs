//! The blob store: what the fleet needs from object storage (conditional puts with metadata, gets with
//! the ETag, heads, listing, deletes); its S3 implementation is in `s3`, the in-memory twin in `memory`,
//! and the pass-through store tests hook in `hooked`.

use std::collections::BTreeMap;

use async_trait::async_trait;
use bytes::Bytes;

use crate::call::CallCounter;
use crate::error::Result;

/// The condition of a write (S3 `If-None-Match: *` / `If-Match: etag`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cond {
    /// Whatever is there (a plain put).
    Any,
    /// Only if the object does not exist.
    Absent,
    /// Only if the object's current ETag is this one.
    Matches(String),
}

/// What the fleet needs from object storage. An implementation provides the required methods; plain
/// puts and gets are built on them.
#[async_trait]
pub trait BlobStore: Send + Sync + 'static {
    fn bucket(&self) -> &str;
    /// Writes an object with user metadata (small string fields `head` returns without the body) if
    /// `cond` holds: `Some(new etag)`, or `None` when it did not (another writer came first: the
    /// fencing primitive of leases and checkpoints).
    async fn put_if(&self, key: &str, body: Bytes, content_type: &str, meta: &BTreeMap<String, String>, cond: &Cond) -> Result<Option<String>>;
    /// An object's body and ETag; `None` when it does not exist.
    async fn get_tagged(&self, key: &str) -> Result<Option<(Bytes, String)>>;
    /// The user metadata of an object, without its body; `None` when the object does not exist.
    async fn head(&self, key: &str) -> Result<Option<BTreeMap<String, String>>>;
    /// Writes an object from a local file. The S3 store streams it (a report of a million accounts is
    /// never whole in memory); this default reads it whole (the in-memory twin).
    async fn put_file(&self, key: &str, path: &std::path::Path, content_type: &str) -> Result<()> {
        let body = tokio::fs::read(path).await.map_err(|e| crate::Error::local_file(path, e))?;
        self.put(key, Bytes::from(body), content_type).await
    }
    async fn put(&self, key: &str, body: Bytes, content_type: &str) -> Result<()> {
        self.put_if(key, body, content_type, &BTreeMap::new(), &Cond::Any).await.map(drop)
    }
    /// `None` when the object does not exist.
    async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        Ok(self.get_tagged(key).await?.map(|(body, _)| body))
    }
    /// An object of at most `max` bytes (`None` when it does not exist); a larger one is an error
    /// ([`Error::Corrupt`](crate::Error::Corrupt)), and no more than about `max` bytes of it are read
    /// (the S3 store asks for a byte range).
    async fn get_capped(&self, key: &str, max: u64) -> Result<Option<Bytes>> {
        match self.get(key).await? {
            Some(b) if b.len() as u64 > max => Err(too_large(key, max)),
            found => Ok(found),
        }
    }
    /// An object's body as a stream of chunks (`None` when it does not exist), with its length when
    /// known: a reader that passes it on (the status page serving a report) never holds it whole.
    /// The S3 store streams the response body; this default reads it whole (the in-memory twin).
    async fn get_stream(&self, key: &str) -> Result<Option<BlobStream>> {
        Ok(self.get(key).await?.map(|b| BlobStream { len: Some(b.len() as u64), chunks: Box::pin(futures::stream::once(async move { Ok(b) })) }))
    }
    /// Keys under `prefix`, in key order, at most `limit` of them.
    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<String>>;
    /// Deletes an object (no error when it does not exist).
    async fn delete(&self, key: &str) -> Result<()>;
    fn calls(&self) -> &CallCounter;

    /// The breaker this store's calls report to (none for the in-memory twin unless given one).
    fn breaker(&self) -> Option<std::sync::Arc<crate::breaker::Breaker>> {
        None
    }
}

/// An object's body read as it arrives ([`BlobStore::get_stream`]): a chunk error is a broken-off
/// body (the object is not read again).
pub struct BlobStream {
    /// The body's length, when the store said.
    pub len: Option<u64>,
    pub chunks: std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes>> + Send>>,
}

/// The metadata of the first of `keys` that exists (an object that moved: where it is now, then
/// where it was; `fleet_domain::layout::checkpoint_keys`).
pub async fn head_first(store: &dyn BlobStore, keys: &[String]) -> Result<Option<BTreeMap<String, String>>> {
    for key in keys {
        if let Some(meta) = store.head(key).await? {
            return Ok(Some(meta));
        }
    }
    Ok(None)
}

/// A conditional write that tells a lost answer from a lost race. [`BlobStore::put_if`] is retried
/// by the call policy when an attempt gets no answer; when that attempt had in fact written the
/// object, the retry finds its own write and fails the condition (412), which reads as "another
/// writer came first". Here a failed condition is checked by reading the object back: when it holds
/// exactly this body, the write was ours and its ETag is returned. (Every body the fleet writes
/// conditionally carries a time or an epoch, so another writer's body is never byte-equal to ours.)
pub async fn put_if_owned(
    store: &dyn BlobStore,
    key: &str,
    body: Bytes,
    content_type: &str,
    meta: &BTreeMap<String, String>,
    cond: &Cond,
) -> Result<Option<String>> {
    put_if_owned_after(store, key, body, content_type, meta, cond, &[]).await
}

/// [`put_if_owned`] after `earlier` writes of the same writer whose outcome is unknown (each failed
/// with no answer, or its read-back failed), given as the SHA-256 of each body ([`digest`]: a writer
/// can remember every one since its last confirmed write, not only the last few; at most one of them
/// landed, and it may be any): when the object holds exactly one of those bodies, that
/// write landed and nobody wrote after it, so this one is made again on its ETag. Without it the
/// writer took its own earlier write for another's (found by the simulation, seed 845123411: a
/// finish whose checkpoint landed with its answer lost, and whose read-back failed too, concluded
/// at the next try that another controller owned the job).
pub async fn put_if_owned_after(
    store: &dyn BlobStore,
    key: &str,
    body: Bytes,
    content_type: &str,
    meta: &BTreeMap<String, String>,
    cond: &Cond,
    earlier: &[[u8; 32]],
) -> Result<Option<String>> {
    match store.put_if(key, body.clone(), content_type, meta, cond).await? {
        Some(etag) => Ok(Some(etag)),
        None => match store.get_tagged(key).await? {
            Some((found, etag)) if found == body => {
                tracing::debug!(key, "a conditional write's answer was lost: the object holds our write");
                Ok(Some(etag))
            }
            Some((found, etag)) if !earlier.is_empty() && earlier.contains(&digest(&found)) => {
                tracing::debug!(key, "an earlier conditional write of ours landed unanswered: written again on its ETag");
                Box::pin(put_if_owned_after(store, key, body, content_type, meta, &Cond::Matches(etag), &[])).await
            }
            _ => Ok(None),
        },
    }
}

/// What [`put_if_owned_after`] remembers of an earlier write: the SHA-256 of its body.
pub fn digest(body: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(body).into()
}

/// The error of an object larger than a reader accepts.
pub(crate) fn too_large(key: &str, max: u64) -> crate::Error {
    crate::Error::Corrupt(format!("{key} is larger than the {max} bytes accepted"))
}

#[cfg(feature = "test-util")]
pub mod hooked;
#[cfg(feature = "test-util")]
pub mod memory;
pub mod s3;

pub use s3::S3Store;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_earlier_write_of_unknown_outcome_found_in_place_is_written_over_and_another_writers_is_not() {
        let store = memory::MemoryStore::new();
        let meta = BTreeMap::new();
        let put = |body: &'static str, cond: Cond| {
            let store = store.clone();
            let meta = meta.clone();
            async move { store.put_if("k", Bytes::from_static(body.as_bytes()), "text/plain", &meta, &cond).await.unwrap() }
        };
        let e0 = put("first", Cond::Absent).await.expect("written");
        // Written on e0, its answer lost, and the read-back failed: the writer still holds e0.
        let earlier = digest(b"second, unanswered");
        put("second, unanswered", Cond::Matches(e0.clone())).await.expect("landed");
        let third = Bytes::from_static(b"third");
        // Without the earlier body the writer takes its own write for another's.
        assert_eq!(put_if_owned(store.as_ref(), "k", third.clone(), "text/plain", &meta, &Cond::Matches(e0.clone())).await.unwrap(), None);
        let e2 = put_if_owned_after(store.as_ref(), "k", third.clone(), "text/plain", &meta, &Cond::Matches(e0.clone()), std::slice::from_ref(&earlier))
            .await
            .unwrap()
            .expect("written over its own earlier write");
        assert_eq!(store.get_tagged("k").await.unwrap(), Some((third, e2.clone())));
        // Another writer's body in place: refused, whatever the writer wrote before.
        put("another writer's", Cond::Matches(e2.clone())).await.expect("written");
        let fourth = Bytes::from_static(b"fourth");
        assert_eq!(
            put_if_owned_after(store.as_ref(), "k", fourth, "text/plain", &meta, &Cond::Matches(e2), std::slice::from_ref(&earlier)).await.unwrap(),
            None
        );
    }

    #[tokio::test]
    async fn the_first_of_many_writes_of_unknown_outcome_is_recognised_when_it_is_the_one_that_landed() {
        // Every try is fenced on the last confirmed ETag, so at most one landed, and it may be the
        // first: five more tries without an answer must not make the writer forget it (seed
        // 168173223 with the last four bodies remembered).
        let store = memory::MemoryStore::new();
        let meta = BTreeMap::new();
        let e0 = store.put_if("k", Bytes::from_static(b"confirmed"), "text/plain", &meta, &Cond::Absent).await.unwrap().expect("written");
        store.put_if("k", Bytes::from_static(b"try 0"), "text/plain", &meta, &Cond::Matches(e0.clone())).await.unwrap().expect("landed");
        let earlier: Vec<[u8; 32]> = (0..6).map(|i| digest(format!("try {i}").as_bytes())).collect();
        let next = Bytes::from_static(b"try 6");
        let e = put_if_owned_after(store.as_ref(), "k", next.clone(), "text/plain", &meta, &Cond::Matches(e0.clone()), &earlier).await.unwrap();
        assert!(e.is_some(), "the writer's own first try was taken for another's");
        assert_eq!(store.get("k").await.unwrap(), Some(next));
        // Without the first try remembered, it is another's.
        let store2 = memory::MemoryStore::new();
        let e0 = store2.put_if("k", Bytes::from_static(b"confirmed"), "text/plain", &meta, &Cond::Absent).await.unwrap().expect("written");
        store2.put_if("k", Bytes::from_static(b"try 0"), "text/plain", &meta, &Cond::Matches(e0.clone())).await.unwrap().expect("landed");
        assert_eq!(
            put_if_owned_after(store2.as_ref(), "k", Bytes::from_static(b"try 6"), "text/plain", &meta, &Cond::Matches(e0), &earlier[2..]).await.unwrap(),
            None
        );
    }
}
