//! An in-memory blob store with S3 semantics (conditional writes, ETags, metadata), for fast
//! deterministic tests. Never a substitute for S3 in integration tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;

use super::{BlobStore, Cond};
use crate::call::CallCounter;
use crate::error::Result;
use crate::op::Op;

/// An in-memory blob store. ETags are write numbers.
#[derive(Default)]
pub struct MemoryStore {
    objects: Mutex<HashMap<String, StoredBlob>>,
    writes: std::sync::atomic::AtomicU64,
    calls: CallCounter,
    /// Reads (`get_tagged`) still to fail, as an S3 503 would (see [`MemoryStore::fail_reads`]).
    failing_reads: std::sync::atomic::AtomicUsize,
}

struct StoredBlob {
    body: Bytes,
    meta: BTreeMap<String, String>,
    etag: String,
}

impl MemoryStore {
    pub fn new() -> Arc<MemoryStore> {
        Arc::new(MemoryStore::default())
    }

    /// The next `n` reads (`get_tagged`, and so `get`) fail with a retryable S3 error (503
    /// SlowDown), nothing read: a store that answers, but not every time.
    pub fn fail_reads(&self, n: usize) {
        self.failing_reads.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = crate::lock(&self.objects).keys().cloned().collect();
        k.sort();
        k
    }
}

#[async_trait]
impl BlobStore for MemoryStore {
    fn bucket(&self) -> &str {
        "memory"
    }

    async fn put_if(&self, key: &str, body: Bytes, _content_type: &str, meta: &BTreeMap<String, String>, cond: &Cond) -> Result<Option<String>> {
        self.calls.bump(Op::S3PutObject);
        let mut objects = crate::lock(&self.objects);
        let current = objects.get(key).map(|o| o.etag.as_str());
        let holds = match cond {
            Cond::Any => true,
            Cond::Absent => current.is_none(),
            Cond::Matches(e) => current == Some(e.as_str()),
        };
        if !holds {
            return Ok(None);
        }
        let etag = format!("\"{}\"", self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1);
        objects.insert(key.to_string(), StoredBlob { body, meta: meta.clone(), etag: etag.clone() });
        Ok(Some(etag))
    }

    async fn get_tagged(&self, key: &str) -> Result<Option<(Bytes, String)>> {
        self.calls.bump(Op::S3GetObject);
        let fail = self.failing_reads.fetch_update(std::sync::atomic::Ordering::SeqCst, std::sync::atomic::Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if fail {
            let service = crate::error::Service::S3;
            return Err(crate::Error::Service { service, operation: "GetObject", detail: "503 SlowDown (simulated)".into(), retryable: true, source: None });
        }
        Ok(crate::lock(&self.objects).get(key).map(|o| (o.body.clone(), o.etag.clone())))
    }

    async fn head(&self, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        self.calls.bump(Op::S3HeadObject);
        Ok(crate::lock(&self.objects).get(key).map(|o| o.meta.clone()))
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        self.calls.bump(Op::S3ListObjectsV2);
        let mut k: Vec<String> = crate::lock(&self.objects).keys().filter(|k| k.starts_with(prefix)).cloned().collect();
        k.sort();
        k.truncate(limit);
        Ok(k)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.calls.bump(Op::S3DeleteObject);
        crate::lock(&self.objects).remove(key);
        Ok(())
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }
}
