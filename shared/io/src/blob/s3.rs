//! The S3 implementation of [`BlobStore`]: every call bounded by its [`CallPolicy`], conditional
//! writes with If-None-Match / If-Match.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;

use super::{BlobStore, Cond};
use crate::breaker::Breaker;
use crate::call::{CallCounter, CallPolicy, Guarded, On, Precondition};
use crate::error::{sdk_error, Error, Result, Service};
use crate::op::Op;

/// An S3 bucket. Every call is bounded by its [`CallPolicy`]; a GetObject's attempt covers reading the
/// body too.
pub struct S3Store {
    client: aws_sdk_s3::Client,
    bucket: String,
    endpoint: String,
    policy: Guarded,
}

impl S3Store {
    pub fn new(client: aws_sdk_s3::Client, endpoint: &str, bucket: &str, policy: CallPolicy) -> S3Store {
        S3Store { client, bucket: bucket.to_string(), endpoint: endpoint.to_string(), policy: Guarded::new(policy) }
    }

    /// Reports every call to `breaker` (S3's of the process) and offers it a probe: HeadBucket.
    pub fn with_breaker(mut self, breaker: std::sync::Arc<Breaker>) -> S3Store {
        let (client, bucket, endpoint, policy) = (self.client.clone(), self.bucket.clone(), self.endpoint.clone(), self.policy.policy);
        breaker.set_probe(std::sync::Arc::new(move || {
            let (client, bucket, endpoint) = (client.clone(), bucket.clone(), endpoint.clone());
            Box::pin(async move {
                policy
                    .once(Op::S3HeadBucket, On::bucket(&bucket), Duration::ZERO, async {
                        client.head_bucket().bucket(&bucket).send().await.map(|_| ()).map_err(|e| sdk_error(Op::S3HeadBucket, &endpoint, e))
                    })
                    .await
            })
        }));
        self.policy.breaker = Some(breaker);
        self
    }

    /// Checks that the bucket exists and is reachable (HeadBucket).
    pub async fn check(&self) -> Result<()> {
        self.policy
            .run(Op::S3HeadBucket, On::bucket(&self.bucket), Duration::ZERO, || async {
                self.client.head_bucket().bucket(&self.bucket).send().await.map_err(|e| {
                    if e.as_service_error().is_some_and(|s| s.is_not_found()) {
                        Error::NotFound { service: Service::S3, what: format!("bucket {:?} does not exist at {}", self.bucket, self.endpoint) }
                    } else {
                        sdk_error(Op::S3HeadBucket, &self.endpoint, e)
                    }
                })
            })
            .await?;
        Ok(())
    }
}

#[async_trait]
impl BlobStore for S3Store {
    fn bucket(&self) -> &str {
        &self.bucket
    }

    async fn get_tagged(&self, key: &str) -> Result<Option<(Bytes, String)>> {
        self.policy
            .run(Op::S3GetObject, On::object(&self.bucket, key), Duration::ZERO, || async {
                match self.client.get_object().bucket(&self.bucket).key(key).send().await {
                    Ok(out) => {
                        let etag = out.e_tag().unwrap_or_default().to_string();
                        let data = out.body.collect().await.map_err(|e| body_error(key, e))?;
                        Ok(Some((data.into_bytes(), etag)))
                    }
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => Ok(None),
                    Err(e) => Err(sdk_error(Op::S3GetObject, &self.endpoint, e)),
                }
            })
            .await
    }

    async fn get_capped(&self, key: &str, max: u64) -> Result<Option<Bytes>> {
        // One byte past the cap tells a larger object from one of exactly `max` bytes.
        let range = format!("bytes=0-{max}");
        self.policy
            .run(Op::S3GetObject, On::object(&self.bucket, key), Duration::ZERO, || async {
                match self.client.get_object().bucket(&self.bucket).key(key).range(&range).send().await {
                    Ok(out) => {
                        let data = out.body.collect().await.map_err(|e| body_error(key, e))?;
                        let data = data.into_bytes();
                        if data.len() as u64 > max {
                            return Err(super::too_large(key, max));
                        }
                        Ok(Some(data))
                    }
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => Ok(None),
                    // A range of an empty object is not satisfiable.
                    Err(e) if e.raw_response().is_some_and(|r| r.status().as_u16() == 416) => Ok(Some(Bytes::new())),
                    Err(e) => Err(sdk_error(Op::S3GetObject, &self.endpoint, e)),
                }
            })
            .await
    }

    async fn get_stream(&self, key: &str) -> Result<Option<super::BlobStream>> {
        // The request is retried by the policy; the body, once it flows, is not (a reader passing it
        // on has sent part of it).
        let out = self
            .policy
            .run(Op::S3GetObject, On::object(&self.bucket, key), Duration::ZERO, || async {
                match self.client.get_object().bucket(&self.bucket).key(key).send().await {
                    Ok(out) => Ok(Some(out)),
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => Ok(None),
                    Err(e) => Err(sdk_error(Op::S3GetObject, &self.endpoint, e)),
                }
            })
            .await?;
        Ok(out.map(|out| {
            let len = out.content_length().and_then(|n| u64::try_from(n).ok());
            let key = key.to_string();
            let chunks = futures::stream::unfold((out.body, key), |(mut body, key)| async move {
                let next = body.next().await?;
                Some((next.map_err(|e| body_error(&key, e)), (body, key)))
            });
            super::BlobStream { len, chunks: Box::pin(chunks) }
        }))
    }

    async fn put_if(&self, key: &str, body: Bytes, content_type: &str, meta: &BTreeMap<String, String>, cond: &Cond) -> Result<Option<String>> {
        let precondition = match cond {
            Cond::Any => None,
            Cond::Absent => Some(Precondition::IfNoneMatch),
            Cond::Matches(_) => Some(Precondition::IfMatch),
        };
        self.policy
            .run(Op::S3PutObject, On::Object { bucket: &self.bucket, key, cond: precondition }, Duration::ZERO, || async {
                let req = self
                    .client
                    .put_object()
                    .bucket(&self.bucket)
                    .key(key)
                    .content_type(content_type)
                    .set_metadata((!meta.is_empty()).then(|| meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect()))
                    .body(ByteStream::from(body.clone()));
                let req = match cond {
                    Cond::Any => req,
                    Cond::Absent => req.if_none_match("*"),
                    Cond::Matches(etag) => req.if_match(etag),
                };
                match req.send().await {
                    Ok(out) => Ok(Some(out.e_tag().unwrap_or_default().to_string())),
                    // 412: the condition failed; 409: a concurrent conditional write won.
                    Err(e) if e.raw_response().is_some_and(|r| matches!(r.status().as_u16(), 409 | 412)) => Ok(None),
                    Err(e) => Err(sdk_error(Op::S3PutObject, &self.endpoint, e)),
                }
            })
            .await
    }

    async fn put_file(&self, key: &str, path: &std::path::Path, content_type: &str) -> Result<()> {
        self.policy
            .run(Op::S3PutObject, On::object(&self.bucket, key), Duration::ZERO, || async {
                // Read as it is sent, a piece at a time (opened again by each attempt).
                let body = ByteStream::from_path(path).await.map_err(|e| crate::Error::local_file(path, e))?;
                match self.client.put_object().bucket(&self.bucket).key(key).content_type(content_type).body(body).send().await {
                    Ok(_) => Ok(()),
                    Err(e) => Err(sdk_error(Op::S3PutObject, &self.endpoint, e)),
                }
            })
            .await
    }

    async fn head(&self, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        self.policy
            .run(Op::S3HeadObject, On::object(&self.bucket, key), Duration::ZERO, || async {
                match self.client.head_object().bucket(&self.bucket).key(key).send().await {
                    Ok(out) => Ok(Some(out.metadata().map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default())),
                    Err(e) if e.as_service_error().is_some_and(|s| s.is_not_found()) => Ok(None),
                    Err(e) => Err(sdk_error(Op::S3HeadObject, &self.endpoint, e)),
                }
            })
            .await
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        while keys.len() < limit {
            let page = self
                .policy
                .run(Op::S3ListObjectsV2, On::Bucket { bucket: &self.bucket, prefix: Some(prefix) }, Duration::ZERO, || async {
                    self.client
                        .list_objects_v2()
                        .bucket(&self.bucket)
                        .prefix(prefix)
                        .max_keys((limit - keys.len()).min(1000) as i32)
                        .set_continuation_token(token.clone())
                        .send()
                        .await
                        .map_err(|e| sdk_error(Op::S3ListObjectsV2, &self.endpoint, e))
                })
                .await?;
            keys.extend(page.contents().iter().filter_map(|o| o.key().map(str::to_string)));
            match page.next_continuation_token() {
                Some(t) if page.is_truncated() == Some(true) => token = Some(t.to_string()),
                _ => break,
            }
        }
        keys.truncate(limit);
        Ok(keys)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.policy
            .run(Op::S3DeleteObject, On::object(&self.bucket, key), Duration::ZERO, || async {
                self.client.delete_object().bucket(&self.bucket).key(key).send().await.map_err(|e| sdk_error(Op::S3DeleteObject, &self.endpoint, e))
            })
            .await?;
        Ok(())
    }

    fn calls(&self) -> &CallCounter {
        &self.policy.calls
    }

    fn breaker(&self) -> Option<std::sync::Arc<Breaker>> {
        self.policy.breaker.clone()
    }
}

/// A GetObject whose body broke off while it was read (worth another try).
fn body_error(key: &str, e: aws_sdk_s3::primitives::ByteStreamError) -> Error {
    Error::Service { service: Service::S3, operation: "GetObject", detail: format!("reading body of {key}: {e}"), retryable: true, source: Some(Box::new(e)) }
}
