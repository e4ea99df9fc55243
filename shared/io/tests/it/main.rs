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

/// SQS bills each 64 KiB of a call's payload as one request: the client counts the chunks beyond the
/// first of what it sends and receives.
#[tokio::test]
async fn sqs_counts_the_further_64k_chunks_it_is_billed_for() {
    use fleet_io::call::Billed;
    use fleet_io::queue::{Outgoing, Queue};
    let Some(st) = fleet_test_support::stack(SETTINGS).await else { return };
    let extra = |q: &dyn Queue| q.calls().snapshot().of(Billed::Extra64KiB { fifo: false });
    // Five bodies of 40 KiB: batches under 256 KiB, so one call of 200 KiB (four chunks: three further).
    let bodies: Vec<Outgoing> = (0..5).map(|i| Outgoing::plain(format!("{i}{}", "x".repeat(40 * 1024 - 1)))).collect();
    let before = extra(st.work.as_ref());
    st.work.send_messages(&bodies).await.unwrap();
    assert_eq!(extra(st.work.as_ref()) - before, 3, "{:?}", st.work.calls().snapshot());
    // A small send adds none.
    st.work.send(vec!["small".to_string()]).await.unwrap();
    assert_eq!(extra(st.work.as_ref()) - before, 3);
    let mut got = 0;
    let mut received_bytes = 0;
    let t = std::time::Instant::now();
    while got < 6 && t.elapsed() < Duration::from_secs(30) {
        let batch = st.work.receive(10, Duration::from_secs(1)).await.unwrap();
        got += batch.len();
        let bytes: usize = batch.iter().map(|d| d.body.len()).sum();
        received_bytes += fleet_io::op::sqs_extra_chunks(bytes);
    }
    assert_eq!(got, 6);
    assert_eq!(extra(st.work.as_ref()) - before, 3 + received_bytes, "receives count theirs too");
}
