"""Creates every queue and bucket the billing fleet uses. Idempotent.

Runs as a LocalStack `ready.d` init hook (LocalStack executes *.py hooks with its own interpreter, which
has boto3) and on the host with the LocalStack virtualenv's python (localstack/init-resources.sh).

With FLEET_WORK_SHARDS=N (default 1) it creates the work queue's shards 1..N-1 too (`billing-work-1`, ...,
each with its dead-letter queue). Besides the standard work queue it creates a FIFO one (`billing-work.fifo`, dead letters to
`billing-work-dlq.fifo`) for per-account ordered jobs (`initiator submit --group-by account`). A queue
named *.fifo is created as FIFO, and so is its dead-letter queue (SQS requires both to match).

Environment (all optional): AWS_ENDPOINT_URL (default http://127.0.0.1:4566), AWS_REGION (us-east-1),
FLEET_BUCKET, FLEET_WORK_QUEUE, FLEET_WORK_DLQ, FLEET_RESULTS_QUEUE, FLEET_MAX_RECEIVE_COUNT (5),
FLEET_VISIBILITY_TIMEOUT (30), FLEET_JOBS_EXPIRE_DAYS (30: the lifecycle rule that expires `jobs/` and
`purge/`, the backstop of the controller's purge of finished jobs' transactions), FLEET_SSE_KMS_KEY_ID
(when set: default encryption SSE-KMS with this key, and a bucket key).
"""
import json
import os

import boto3

env = os.environ.get
endpoint = env("AWS_ENDPOINT_URL") or "http://127.0.0.1:4566"
region = env("AWS_REGION") or env("AWS_DEFAULT_REGION") or "us-east-1"
creds = dict(
    aws_access_key_id=env("AWS_ACCESS_KEY_ID") or "test",
    aws_secret_access_key=env("AWS_SECRET_ACCESS_KEY") or "test",
)
sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=region, **creds)
s3 = boto3.client("s3", endpoint_url=endpoint, region_name=region, **creds)

bucket = env("FLEET_BUCKET") or "billing-fleet"


def dlq_name(queue):
    """`-dlq` appended, before `.fifo` for a FIFO queue (as the fleet's binaries derive it)."""
    return queue[: -len(".fifo")] + "-dlq.fifo" if queue.endswith(".fifo") else queue + "-dlq"


work = env("FLEET_WORK_QUEUE") or "billing-work"
work_dlq = env("FLEET_WORK_DLQ") or dlq_name(work)
results = env("FLEET_RESULTS_QUEUE") or "billing-results"
shards = int(env("FLEET_WORK_SHARDS") or "1")
partitions = int(env("FLEET_RESULTS_PARTITIONS") or "1")
max_receive = env("FLEET_MAX_RECEIVE_COUNT") or "5"
visibility = env("FLEET_VISIBILITY_TIMEOUT") or "30"


def create(name, attrs):
    if name.endswith(".fifo"):
        attrs = dict(attrs, FifoQueue="true")
    return sqs.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]


def queue_with_dlq(name, dlq):
    dlq_url = create(dlq, {"MessageRetentionPeriod": "1209600"})
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    attrs = {
        "VisibilityTimeout": visibility,
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_receive}),
    }
    url = create(name, {})
    sqs.set_queue_attributes(QueueUrl=url, Attributes=attrs)
    print(f"queue {name} (dead letters to {dlq} after {max_receive} receives)")


def shard_name(queue, i):
    """Shard i of a work queue: shard 0 is the queue itself, shard i its name with `-i`, before `.fifo`
    (as the fleet's binaries derive it with --work-shards)."""
    if i == 0:
        return queue
    return queue[: -len(".fifo")] + f"-{i}.fifo" if queue.endswith(".fifo") else f"{queue}-{i}"


queue_with_dlq(work, work_dlq)
for i in range(1, shards):
    queue_with_dlq(shard_name(work, i), dlq_name(shard_name(work, i)))
if not work.endswith(".fifo") and not env("FLEET_WORK_DLQ"):
    fifo = work + ".fifo"
    for i in range(shards):
        queue_with_dlq(shard_name(fifo, i), dlq_name(shard_name(fifo, i)))
# Each partition of the results queue with its own dead-letter queue (partition i is named as shard i).
for i in range(partitions):
    queue_with_dlq(shard_name(results, i), dlq_name(shard_name(results, i)))
try:
    s3.create_bucket(Bucket=bucket)
except s3.exceptions.BucketAlreadyOwnedByYou:
    pass
# Billing data does not pile up: the controller deletes a finished job's chunk and result blobs; this
# rule expires whatever it never got to (and stray uploads).
expire_days = int(env("FLEET_JOBS_EXPIRE_DAYS") or "30")
s3.put_bucket_lifecycle_configuration(
    Bucket=bucket,
    LifecycleConfiguration={
        "Rules": [
            {"ID": f"expire-{p.rstrip('/')}", "Filter": {"Prefix": p}, "Status": "Enabled", "Expiration": {"Days": expire_days}}
            for p in ("jobs/", "checkpoints/", "purge/", "purge-due/")
        ]
        + [{"ID": "abort-incomplete-uploads", "Filter": {"Prefix": ""}, "Status": "Enabled", "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}]
    },
)
kms_key = env("FLEET_SSE_KMS_KEY_ID")
if kms_key:
    s3.put_bucket_encryption(
        Bucket=bucket,
        ServerSideEncryptionConfiguration={
            "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": kms_key}, "BucketKeyEnabled": True}]
        },
    )
print(f"bucket {bucket} (jobs/ expire after {expire_days} days{', SSE-KMS' if kms_key else ''})")
