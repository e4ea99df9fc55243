"""Creates every queue and bucket the billing fleet uses. Idempotent.

Runs as a LocalStack `ready.d` init hook (LocalStack executes *.py hooks with its own interpreter, which
has boto3) and on the host with the LocalStack virtualenv's python (localstack/init-resources.sh).

Besides the standard work queue it creates a FIFO one (`billing-work.fifo`, dead letters to
`billing-work-dlq.fifo`) for per-account ordered jobs (`initiator submit --group-by account`). A queue
named *.fifo is created as FIFO, and so is its dead-letter queue (SQS requires both to match).

Environment (all optional): AWS_ENDPOINT_URL (default http://127.0.0.1:4566), AWS_REGION (us-east-1),
FLEET_BUCKET, FLEET_WORK_QUEUE, FLEET_WORK_DLQ, FLEET_RESULTS_QUEUE, FLEET_MAX_RECEIVE_COUNT (5),
FLEET_VISIBILITY_TIMEOUT (30).
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


queue_with_dlq(work, work_dlq)
if not work.endswith(".fifo") and not env("FLEET_WORK_DLQ"):
    queue_with_dlq(work + ".fifo", dlq_name(work + ".fifo"))
queue_with_dlq(results, dlq_name(results))
try:
    s3.create_bucket(Bucket=bucket)
except s3.exceptions.BucketAlreadyOwnedByYou:
    pass
print(f"bucket {bucket}")
