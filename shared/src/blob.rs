//! The blob store: what the fleet needs from object storage (put, get), and its S3 implementation.

use async_trait::async_trait;
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;

use crate::error::{Error, Result, Service};
use crate::queue::sdk_error;
use crate::requests::CallCounter;

#[async_trait]
pub trait BlobStore: Send + Sync + 'static {
    fn bucket(&self) -> &str;
    async fn put(&self, key: &str, body: Bytes, content_type: &str) -> Result<()>;
    /// `None` when the object does not exist.
    async fn get(&self, key: &str) -> Result<Option<Bytes>>;
    fn calls(&self) -> &CallCounter;
}

/// An S3 bucket.
pub struct S3Store {
    client: aws_sdk_s3::Client,
    bucket: String,
    endpoint: String,
    calls: CallCounter,
}

impl S3Store {
    pub fn new(client: aws_sdk_s3::Client, endpoint: &str, bucket: &str) -> S3Store {
        S3Store { client, bucket: bucket.to_string(), endpoint: endpoint.to_string(), calls: CallCounter::default() }
    }

    /// Checks that the bucket exists and is reachable (HeadBucket).
    pub async fn check(&self) -> Result<()> {
        self.calls.bump("s3.HeadBucket");
        self.client.head_bucket().bucket(&self.bucket).send().await.map_err(|e| {
            if e.as_service_error().is_some_and(|s| s.is_not_found()) {
                Error::NotFound { service: Service::S3, what: format!("bucket {:?} does not exist at {}", self.bucket, self.endpoint) }
            } else {
                sdk_error(Service::S3, "HeadBucket", &self.endpoint, e)
            }
        })?;
        Ok(())
    }
}

#[async_trait]
impl BlobStore for S3Store {
    fn bucket(&self) -> &str {
        &self.bucket
    }

    async fn put(&self, key: &str, body: Bytes, content_type: &str) -> Result<()> {
        self.calls.bump("s3.PutObject");
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(key)
            .content_type(content_type)
            .body(ByteStream::from(body))
            .send()
            .await
            .map_err(|e| sdk_error(Service::S3, "PutObject", &self.endpoint, e))?;
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>> {
        self.calls.bump("s3.GetObject");
        match self.client.get_object().bucket(&self.bucket).key(key).send().await {
            Ok(out) => {
                let data = out.body.collect().await.map_err(|e| Error::Service {
                    service: Service::S3,
                    operation: "GetObject",
                    detail: format!("reading body of {key}: {e}"),
                    retryable: true,
                })?;
                Ok(Some(data.into_bytes()))
            }
            Err(e) if e.as_service_error().is_some_and(|s| s.is_no_such_key()) => Ok(None),
            Err(e) => Err(sdk_error(Service::S3, "GetObject", &self.endpoint, e)),
        }
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }
}
