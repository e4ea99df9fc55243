//! Faults that used to hang a job or a service, on the LocalStack and RabbitMQ that deploy/test.sh
//! starts, with the service that misbehaves behind a TCP proxy the test freezes (connections open, no
//! byte flows: a hung service):
//! - every SQS and S3 call of the real clients ends within the call policy's deadline;
//! - a controller whose S3 hangs still shuts down within its drain and the deadline;
//! - S3 frozen for 3 minutes under the controller mid-job: results pass maxReceiveCount and land in
//!   the results dead-letter queue, which the controller reads; the job completes with exact totals.

use crate::support::Fleet as _;
use std::time::{Duration, Instant};

use crate::support::proxy::Proxy;
use crate::support::*;
use fleet_io::blob::BlobStore as _;
use fleet_io::call::CallPolicy;
use fleet_io::config::Aws;
use fleet_io::error::Error;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::{Queue, SqsQueue};

fn short() -> CallPolicy {
    CallPolicy { attempt_timeout: Duration::from_secs(1), deadline: Duration::from_secs(3), ..CallPolicy::default() }
}

/// Runs `f`, which must fail with a timeout within the deadline (plus slack).
async fn bounded<T: std::fmt::Debug>(what: &str, f: impl std::future::Future<Output = fleet_io::Result<T>>) {
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(20), f).await.unwrap_or_else(|_| panic!("{what} hung"));
    let took = t.elapsed();
    match r {
        Err(Error::Timeout { .. }) => {}
        other => panic!("{what}: expected a timeout, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "{what} took {took:?}, the deadline is 3 s");
    eprintln!("{what}: timed out after {:.1} s", took.as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_to_a_hung_service_ends_at_the_deadline() {
    let Some(s) = crate::support::stack(QueueSettings::default()).await else { return };
    s.work.send(vec!["x".into()]).await.unwrap();
    let proxy = Proxy::start(0, "127.0.0.1:4566").await;
    let hung = Aws::local(&proxy.endpoint()).await.with_policy(short());
    // Opened by URL (no call), then frozen.
    let url = s.work.url().replace("127.0.0.1:4566", &format!("127.0.0.1:{}", proxy.port)).replace("localhost:4566", &format!("127.0.0.1:{}", proxy.port));
    let q = SqsQueue::open(hung.sqs(), &proxy.endpoint(), &url, short()).await.unwrap();
    let store = hung.store(&s.names.bucket);
    // A real receipt to complete while frozen.
    let held = q.receive(1, Duration::from_secs(2)).await.unwrap().pop().expect("the message sent above");
    proxy.freeze();
    bounded("GetQueueAttributes", q.depth()).await;
    bounded("ReceiveMessage", q.receive(10, Duration::from_secs(1))).await;
    bounded("ChangeMessageVisibilityBatch", q.extend(&[(held.receipt(), Duration::ZERO)])).await;
    bounded("DeleteMessageBatch", async { held.delete(&q).await.map_err(|(e, _)| e) }).await;
    bounded("SendMessageBatch", q.send(vec!["y".into()])).await;
    bounded("GetObject", fleet_io::blob::BlobStore::get(store.as_ref(), "k")).await;
    bounded("PutObject", fleet_io::blob::BlobStore::put(store.as_ref(), "k", bytes::Bytes::from_static(b"v"), "text/plain")).await;
    bounded("ListObjectsV2", fleet_io::blob::BlobStore::list(store.as_ref(), "jobs/", 10)).await;
    bounded("HeadBucket", store.check()).await;
    let hung_open = hung.queue(&s.names.work_queue);
    bounded("GetQueueUrl", async { hung_open.await.map(|_| ()) }).await;
    proxy.thaw();
    // (The requests held in the proxy reach LocalStack now, so the counts may have moved.)
    let d = q.depth().await.expect("the same client works once the service answers again");
    assert!(d.visible + d.in_flight >= 1, "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_whose_store_hangs_still_stops_in_time() {
    let Some(s) = crate::support::stack(QueueSettings::default()).await else { return };
    let proxy = Proxy::start(0, "127.0.0.1:4566").await;
    let hung = Aws::local(&proxy.endpoint()).await.with_policy(short());
    let store = hung.store(&s.names.bucket);
    let stop = tokio_util::sync::CancellationToken::new();
    let deps = controller::Deps {
        results: s.results.clone(),
        work_dlq: s.work_dlq.clone(),
        results_dlq: s.results_dlq.clone(),
        store,
        work: Some(s.work.clone()),
        triggers: None,
        publish: None,
    };
    let settings = controller::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 2, settle_secs: 3, ..Default::default() };
    let handle = tokio::spawn(controller::run(settings, deps, stop.clone()));
    // It reads the results queue once it owns its partition (written to the store); then the store hangs.
    let t = Instant::now();
    while s.store.get(fleet_domain::layout::PARTITIONS_KEY).await.unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(20), "the controller never took its partition");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.freeze();
    let body = serde_json::to_string(&fleet_domain::model::ResultMessage::Sealed { v: 1, job_id: "hung-store".into(), total_chunks: 3 }).unwrap();
    s.results.send(vec![body]).await.unwrap();
    // Received and being applied (its checkpoint read hangs).
    let t = Instant::now();
    while s.results.depth().await.unwrap().in_flight == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "the controller never received the message");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let t = Instant::now();
    stop.cancel();
    let r = tokio::time::timeout(Duration::from_secs(30), handle).await.expect("the controller stopped instead of hanging on S3");
    r.unwrap().unwrap();
    let took = t.elapsed();
    eprintln!("controller with a hung store stopped {:.1} s after the signal", took.as_secs_f64());
    assert!(took < Duration::from_secs(15), "drain 2 s + a call deadline of 3 s per pending call: {took:?}");
    proxy.thaw();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_frozen_for_three_minutes_under_the_controller_the_job_completes_exact() {
    if !crate::support::stack_running() {
        return;
    }
    // Default redrive (5 receives) on a short visibility timeout (20 s): 5 x 20 s < 3 min, so results
    // received again and again would reach the results dead-letter queue while S3 is frozen.
    let Some(s) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(20) }).await else { return };
    let proxy = Proxy::start(0, "127.0.0.1:4566").await;
    let frozen_aws = Aws::local(&proxy.endpoint()).await.with_policy(CallPolicy {
        attempt_timeout: Duration::from_secs(2),
        deadline: Duration::from_secs(5),
        ..CallPolicy::default()
    });
    let stop = tokio_util::sync::CancellationToken::new();
    let keys = [s.results.name(), s.work_dlq.name(), s.results_dlq.name()].map(fleet_io::trigger::work_key).to_vec();
    let deps = controller::Deps {
        results: s.results.clone(),
        work_dlq: s.work_dlq.clone(),
        results_dlq: s.results_dlq.clone(),
        store: frozen_aws.store(&s.names.bucket),
        work: Some(s.work.clone()),
        triggers: s.names.subscribe(keys, &stop),
        publish: s.names.trigger_bus(),
    };
    let settings = controller::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 10, settle_secs: 3, ..Default::default() };
    let controller = tokio::spawn(controller::run(settings, deps, stop.clone()));
    let agent = s.start_agent();
    let processor = s.start_processor(fast_processor());
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "frozen.csv", 60_000, 500, 11)];
    // Small chunks, so that the job is still under way when the controller has saved a first part of
    // it (it applies a batch's results concurrently, so a few large chunks finish at once).
    let job = s.submit(&files, 500).await;
    // Mid-job: some chunks accounted for, then S3 freezes under the controller.
    let t = Instant::now();
    loop {
        let p = initiator::follow::progress(s.store.as_ref(), &job.job_id).await;
        if p.as_ref().is_ok_and(|p| p.accounted_chunks > 0 && p.accounted_chunks < job.total_chunks) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the job did not start: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.freeze();
    let frozen_at = Instant::now();
    let mut stranded = 0;
    while frozen_at.elapsed() < Duration::from_secs(180) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let d = s.results_dlq.depth().await.unwrap();
        stranded = stranded.max(d.visible + d.in_flight);
    }
    proxy.thaw();
    eprintln!("S3 frozen 180 s; up to {stranded} results in the results dead-letter queue meanwhile");
    // The controller's listeners pause while S3's breaker is open: results wait on their queue with
    // their receive count unspent instead of passing maxReceiveCount.
    assert_eq!(stranded, 0, "results passed maxReceiveCount while S3 was frozen");
    let report = s.wait_report(&job, Duration::from_secs(180)).await;
    eprintln!("report {:.1} s after the thaw", frozen_at.elapsed().as_secs_f64() - 180.0);
    assert_consistent(&report);
    assert_eq!(report.status, fleet_domain::model::JobStatus::Complete, "{:?}", report.failed_chunks);
    assert_eq!(report_accounts(&report), expected_accounts(&files), "exact totals after the freeze");
    let d = s.results_dlq.depth().await.unwrap();
    assert_eq!(d.visible + d.in_flight, 0, "nothing left stranded");
    stop.cancel();
    controller.await.unwrap().unwrap();
    processor.stop().await;
    agent.stop().await;
}
