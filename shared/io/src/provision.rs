//! Creates the fleet's queues (each with a dead-letter queue and redrive) and bucket, idempotently.
//! A queue named `*.fifo` is created as a FIFO queue (with a FIFO dead-letter queue, as SQS requires);
//! senders give every message a de-duplication id, so content-based de-duplication stays off.
//! `localstack/init/ready.d/10-billing-fleet.py` does the same for deployments; tests use this to
//! make their own uniquely named resources. Its calls go to the SDK directly, not through the call policy,
//! so each records itself for the IAM test ([`crate::call::record`]).

use std::time::Duration;

use aws_sdk_sqs::types::QueueAttributeName;

use crate::call::{record, On};
use crate::config::{is_fifo, Aws, FleetArgs};
use crate::error::sdk_error;
use crate::error::{Error, Result};
use crate::op::Op;

/// Queue settings.
#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    pub max_receive_count: u32,
    pub visibility_timeout: Duration,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(30) }
    }
}

async fn create_queue(aws: &Aws, name: &str, mut attrs: Vec<(QueueAttributeName, String)>) -> Result<(String, String)> {
    let sqs = aws.sqs();
    if is_fifo(name) {
        attrs.push((QueueAttributeName::FifoQueue, "true".into()));
    }
    record(Op::SqsCreateQueue, On::Queue(name));
    let mut req = sqs.create_queue().queue_name(name);
    for (k, v) in attrs {
        req = req.attributes(k, v);
    }
    let url = req.send().await.map_err(|e| sdk_error(Op::SqsCreateQueue, &aws.endpoint, e))?.queue_url().unwrap_or_default().to_string();
    record(Op::SqsGetQueueAttributes, On::Queue(name));
    let arn = sqs
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| sdk_error(Op::SqsGetQueueAttributes, &aws.endpoint, e))?
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .ok_or_else(|| Error::Config(format!("queue {name} has no ARN")))?;
    Ok((url, arn))
}

/// Creates `name` and its dead-letter queue `dlq` with redrive after `max_receive_count`.
pub async fn ensure_queue_with_dlq(aws: &Aws, name: &str, dlq: &str, s: QueueSettings) -> Result<String> {
    if is_fifo(name) != is_fifo(dlq) {
        return Err(Error::Config(format!("queue {name} and its dead-letter queue {dlq} must both be FIFO (.fifo) or both standard")));
    }
    let (_, dlq_arn) = create_queue(aws, dlq, vec![(QueueAttributeName::MessageRetentionPeriod, "1209600".into())]).await?;
    let redrive = serde_json::json!({ "deadLetterTargetArn": dlq_arn, "maxReceiveCount": s.max_receive_count.to_string() }).to_string();
    let (url, _) = create_queue(
        aws,
        name,
        vec![(QueueAttributeName::VisibilityTimeout, s.visibility_timeout.as_secs().to_string()), (QueueAttributeName::RedrivePolicy, redrive.clone())],
    )
    .await?;
    // CreateQueue on an existing queue with other attributes fails on AWS; keep settings current.
    record(Op::SqsSetQueueAttributes, On::Queue(name));
    aws.sqs()
        .set_queue_attributes()
        .queue_url(&url)
        .attributes(QueueAttributeName::RedrivePolicy, redrive)
        .attributes(QueueAttributeName::VisibilityTimeout, s.visibility_timeout.as_secs().to_string())
        .send()
        .await
        .map_err(|e| sdk_error(Op::SqsSetQueueAttributes, &aws.endpoint, e))?;
    Ok(url)
}

/// How long a job's blobs (`jobs/`), checkpoints (`checkpoints/`) and purge markers (`purge/`,
/// `purge-due/`) may stay at most: the lifecycle rule that is the backstop of the controller's purge
/// of finished jobs.
pub const JOBS_EXPIRE_DAYS: i32 = 30;

/// The dedupe window: claims of billed transactions (`claims/`) expire this long after their last
/// write, as Stripe's meter events accept timestamps 35 days back (docs/claims.md).
pub const CLAIMS_WINDOW_DAYS: i32 = 35;

/// Creates the bucket (idempotent) with its lifecycle rules: `jobs/`, `checkpoints/`, `purge/` and
/// `purge-due/` expire after [`JOBS_EXPIRE_DAYS`], incomplete multipart uploads are aborted after a day.
pub async fn ensure_bucket(aws: &Aws, bucket: &str) -> Result<()> {
    use aws_sdk_s3::types::{
        AbortIncompleteMultipartUpload, BucketLifecycleConfiguration, ExpirationStatus, LifecycleExpiration, LifecycleRule, LifecycleRuleFilter,
    };
    let s3 = aws.s3();
    record(Op::S3CreateBucket, On::bucket(bucket));
    match s3.create_bucket().bucket(bucket).send().await {
        Ok(_) => {}
        Err(e) if e.as_service_error().is_some_and(|s| s.is_bucket_already_owned_by_you() || s.is_bucket_already_exists()) => {}
        Err(e) => return Err(sdk_error(Op::S3CreateBucket, &aws.endpoint, e)),
    }
    let build = |r: std::result::Result<LifecycleRule, aws_sdk_s3::error::BuildError>| r.map_err(|e| Error::Config(format!("lifecycle rule: {e}")));
    let mut rules = Vec::new();
    for prefix in ["jobs/", "checkpoints/", "purge/", "purge-due/"] {
        rules.push(build(
            LifecycleRule::builder()
                .id(format!("expire-{}", prefix.trim_end_matches('/')))
                .filter(LifecycleRuleFilter::builder().prefix(prefix).build())
                .status(ExpirationStatus::Enabled)
                .expiration(LifecycleExpiration::builder().days(JOBS_EXPIRE_DAYS).build())
                .build(),
        )?);
    }
    // The claims of billed transactions: a day's segment goes once nobody has billed into it for the
    // dedupe window (docs/claims.md).
    rules.push(build(
        LifecycleRule::builder()
            .id("expire-claims")
            .filter(LifecycleRuleFilter::builder().prefix("claims/").build())
            .status(ExpirationStatus::Enabled)
            .expiration(LifecycleExpiration::builder().days(CLAIMS_WINDOW_DAYS).build())
            .build(),
    )?);
    rules.push(build(
        LifecycleRule::builder()
            .id("abort-incomplete-uploads")
            .filter(LifecycleRuleFilter::builder().prefix("").build())
            .status(ExpirationStatus::Enabled)
            .abort_incomplete_multipart_upload(AbortIncompleteMultipartUpload::builder().days_after_initiation(1).build())
            .build(),
    )?);
    let cfg = BucketLifecycleConfiguration::builder().set_rules(Some(rules)).build().map_err(|e| Error::Config(format!("lifecycle: {e}")))?;
    record(Op::S3PutBucketLifecycleConfiguration, On::bucket(bucket));
    s3.put_bucket_lifecycle_configuration()
        .bucket(bucket)
        .lifecycle_configuration(cfg)
        .send()
        .await
        .map_err(|e| sdk_error(Op::S3PutBucketLifecycleConfiguration, &aws.endpoint, e))?;
    Ok(())
}

/// Creates every resource of a fleet: work queue + DLQ (each shard's), results queue + DLQ (each
/// partition's), bucket.
pub async fn ensure_fleet(aws: &Aws, names: &FleetArgs, s: QueueSettings) -> Result<()> {
    for (q, dlq) in names.work_shard_names().into_iter().chain(names.results_partition_names()) {
        ensure_queue_with_dlq(aws, &q, &dlq, s).await?;
    }
    ensure_bucket(aws, &names.bucket).await
}
