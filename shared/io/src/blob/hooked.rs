//! A pass-through blob store with hooks, for tests and the fleet simulation: [`Hooked`] hands every
//! call to its [`Hook`] together with the inner store, and each of the hook's methods forwards the call
//! unchanged unless the hook overrides it. A test that needs a store that fails one job's calls, waits
//! at a gate, loses an answer or runs another controller between two calls writes that one method;
//! the forwarding of the rest of the trait is written once, here.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use super::{BlobStore, Cond};
use crate::breaker::Breaker;
use crate::call::CallCounter;
use crate::error::Result;

/// A write as a hook sees it: the arguments of [`BlobStore::put_if`], in one value.
#[derive(Clone)]
pub struct Put<'a> {
    pub key: &'a str,
    pub body: Bytes,
    pub content_type: &'a str,
    pub meta: &'a BTreeMap<String, String>,
    pub cond: &'a Cond,
}

impl Put<'_> {
    /// Makes the write on `store`.
    pub async fn to(self, store: &dyn BlobStore) -> Result<Option<String>> {
        store.put_if(self.key, self.body, self.content_type, self.meta, self.cond).await
    }
}

/// What a [`Hooked`] store does with each call: by default, what `inner` does.
#[async_trait]
pub trait Hook: Send + Sync + 'static {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        put.to(inner).await
    }
    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        inner.get_tagged(key).await
    }
    async fn head(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        inner.head(key).await
    }
    async fn list(&self, inner: &dyn BlobStore, prefix: &str, limit: usize) -> Result<Vec<String>> {
        inner.list(prefix, limit).await
    }
    async fn delete(&self, inner: &dyn BlobStore, key: &str) -> Result<()> {
        inner.delete(key).await
    }
    fn bucket<'a>(&'a self, inner: &'a dyn BlobStore) -> &'a str {
        inner.bucket()
    }
    fn calls<'a>(&'a self, inner: &'a dyn BlobStore) -> &'a CallCounter {
        inner.calls()
    }
    fn breaker(&self, inner: &dyn BlobStore) -> Option<Arc<Breaker>> {
        inner.breaker()
    }
}

/// A store that passes every call to `inner` through `hook`. It derefs to the hook, so a test reads
/// the hook's own counters and switches through the store it built.
pub struct Hooked<H> {
    inner: Arc<dyn BlobStore>,
    hook: H,
}

impl<H: Hook> Hooked<H> {
    pub fn new(inner: Arc<dyn BlobStore>, hook: H) -> Arc<Hooked<H>> {
        Arc::new(Hooked { inner, hook })
    }

    /// The store calls are passed to.
    pub fn inner(&self) -> &Arc<dyn BlobStore> {
        &self.inner
    }
}

impl<H> std::ops::Deref for Hooked<H> {
    type Target = H;

    fn deref(&self) -> &H {
        &self.hook
    }
}

#[async_trait]
impl<H: Hook> BlobStore for Hooked<H> {
    fn bucket(&self) -> &str {
        self.hook.bucket(&*self.inner)
    }
    async fn put_if(&self, key: &str, body: Bytes, content_type: &str, meta: &BTreeMap<String, String>, cond: &Cond) -> Result<Option<String>> {
        self.hook.put_if(&*self.inner, Put { key, body, content_type, meta, cond }).await
    }
    async fn get_tagged(&self, key: &str) -> Result<Option<(Bytes, String)>> {
        self.hook.get_tagged(&*self.inner, key).await
    }
    async fn head(&self, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        self.hook.head(&*self.inner, key).await
    }
    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        self.hook.list(&*self.inner, prefix, limit).await
    }
    async fn delete(&self, key: &str) -> Result<()> {
        self.hook.delete(&*self.inner, key).await
    }
    fn calls(&self) -> &CallCounter {
        self.hook.calls(&*self.inner)
    }
    fn breaker(&self) -> Option<Arc<Breaker>> {
        self.hook.breaker(&*self.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::memory::MemoryStore;

    /// Fails deletes; everything else passes through.
    struct NoDeletes;

    #[async_trait]
    impl Hook for NoDeletes {
        async fn delete(&self, _inner: &dyn BlobStore, key: &str) -> Result<()> {
            Err(crate::Error::Conflict(format!("delete of {key} refused")))
        }
    }

    #[tokio::test]
    async fn a_hook_changes_what_it_overrides_and_passes_the_rest_through() {
        let inner = MemoryStore::new();
        let store = Hooked::new(inner.clone(), NoDeletes);
        store.put("k", Bytes::from_static(b"v"), "text/plain").await.unwrap();
        assert_eq!(inner.get("k").await.unwrap().as_deref(), Some(&b"v"[..]), "the write reached the inner store");
        assert_eq!(store.get("k").await.unwrap().as_deref(), Some(&b"v"[..]));
        assert!(store.head("k").await.unwrap().is_some());
        assert_eq!(store.list("", 10).await.unwrap(), vec!["k".to_string()]);
        assert!(store.delete("k").await.is_err(), "the hook's delete");
        assert!(inner.get("k").await.unwrap().is_some(), "not deleted");
        assert_eq!(store.bucket(), inner.bucket());
        assert!(std::ptr::eq(store.calls(), inner.calls()), "the inner store's counter");
    }
}
