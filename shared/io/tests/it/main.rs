//! fleet-io's integration tests, in one binary: the queue and blob store conformance suites against
//! SQS and S3 on the LocalStack that `deploy/test.sh` starts (the same suites run against the
//! in-memory twins in the unit tests).

use std::time::Duration;

use fleet_io::conformance;
use fleet_io::provision::QueueSettings;

const SETTINGS: QueueSettings = QueueSettings { max_receive_count: 2, visibility_timeout: Duration::from_secs(30) };

#[tokio::test]
async fn sqs_conforms() {
    let Some(st) = fleet_test_support::stack(SETTINGS).await else { return };
    conformance::queue_semantics(st.work.as_ref(), st.work_dlq.as_ref()).await;
}

#[tokio::test]
async fn sqs_fifo_conforms() {
    let Some(st) = fleet_test_support::fifo_stack(SETTINGS).await else { return };
    conformance::fifo_order(st.work.as_ref()).await;
}

#[tokio::test]
async fn s3_conforms() {
    let Some(st) = fleet_test_support::stack(SETTINGS).await else { return };
    conformance::blob_semantics(st.store.as_ref(), "conformance/").await;
}
