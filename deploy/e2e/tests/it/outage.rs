//! Outages longer than maxReceiveCount x (back-off + call deadline), mid-job, on the real LocalStack
//! through a TCP proxy the test freezes (connections open, no byte flows): the fleet pauses for the
//! dependency and resumes when it answers. Each job completes with exact totals, no work item reaches
//! the dead-letter queue and no service stops.
//!
//! `FLEET_OUTAGE_SECS` sets the S3 outage's length (600 s, the ten minutes, by default).

use crate::support::Fleet as _;
use std::time::{Duration, Instant};

use crate::support::proxy::Proxy;
use crate::support::*;
use fleet_io::call::CallPolicy;
use fleet_io::config::Aws;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;

fn outage_secs() -> u64 {
    std::env::var("FLEET_OUTAGE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(600)
}

/// Short calls, so that maxReceiveCount x (back-off + deadline) is far shorter than the outage.
fn short_calls() -> CallPolicy {
    CallPolicy { attempt_timeout: Duration::from_secs(3), deadline: Duration::from_secs(8), ..CallPolicy::default() }
}

/// Waits until the job has some chunks accounted for and not all.
async fn mid_job(s: &Stack, job: &initiator::submit::Submitted) {
    let t = Instant::now();
    loop {
        let p = initiator::follow::progress(s.store.as_ref(), &job.job_id).await;
        if p.as_ref().is_ok_and(|p| p.accounted_chunks > 0 && p.accounted_chunks < job.total_chunks) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the job did not start: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn dead_letters(s: &Stack) -> (u64, u64) {
    let (w, r) = (s.work_dlq.depth().await.unwrap(), s.results_dlq.depth().await.unwrap());
    (w.visible + w.in_flight, r.visible + r.in_flight)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_hung_under_every_service_mid_job_pauses_and_the_job_completes_exact() {
    if !crate::support::stack_running() {
        return;
    }
    let outage = Duration::from_secs(outage_secs());
    // Two receives allowed: before the breakers, a work item that met the outage twice was failed.
    let Some(s) = crate::support::stack(QueueSettings { max_receive_count: 2, visibility_timeout: Duration::from_secs(10) }).await else { return };
    let proxy = Proxy::start(0, "127.0.0.1:4566").await;
    // One process's S3 (its breaker shared by processor and controller); the queues direct.
    let via = Aws::local(&proxy.endpoint()).await.with_policy(short_calls());
    let store = via.store(&s.names.bucket);
    let stop = tokio_util::sync::CancellationToken::new();
    let n = &s.names;
    let processor = tokio::spawn(processor::run(
        fast_processor(),
        processor::Deps {
            work: s.work.clone(),
            work_dlq: Some(s.work_dlq.clone()),
            results: s.results.clone(),
            store: store.clone(),
            triggers: n.subscribe(vec![fleet_io::trigger::work_key(s.work.name())], &stop),
            publish: n.trigger_bus(),
        },
        stop.clone(),
    ));
    let controller = tokio::spawn(controller::run(
        controller::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 10, ..Default::default() },
        controller::Deps {
            results: s.results.clone(),
            work_dlq: s.work_dlq.clone(),
            results_dlq: s.results_dlq.clone(),
            store: store.clone(),
            triggers: n.subscribe([s.results.name(), s.work_dlq.name(), s.results_dlq.name()].map(fleet_io::trigger::work_key).to_vec(), &stop),
            publish: n.trigger_bus(),
        },
        stop.clone(),
    ));
    let agent = s.start_agent();
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "s3-outage.csv", 60_000, 500, 21)];
    let job = s.submit(&files, 500).await;
    mid_job(&s, &job).await;

    proxy.freeze();
    let frozen_at = Instant::now();
    let mut opened_after = None;
    while frozen_at.elapsed() < outage {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if opened_after.is_none() && via.breakers.s3.is_open() {
            opened_after = Some(frozen_at.elapsed());
        }
        assert_eq!(dead_letters(&s).await, (0, 0), "dead letters during the outage at {:?}", frozen_at.elapsed());
        assert!(!processor.is_finished() && !controller.is_finished(), "a service stopped during the outage");
    }
    let state = via.breakers.s3.state();
    proxy.thaw();
    let opened_after = opened_after.expect("S3's breaker never opened");
    eprintln!("S3 hung {} s; breaker open after {:.1} s, {} probes", outage.as_secs(), opened_after.as_secs_f64(), state.probes);
    assert!(state.open, "{state:?}");

    let report = s.wait_report(&job, Duration::from_secs(180)).await;
    eprintln!("report {:.1} s after the thaw", frozen_at.elapsed().as_secs_f64() - outage.as_secs_f64());
    assert!(!via.breakers.s3.is_open(), "the breaker closed again");
    assert_consistent(&report);
    assert_eq!(report.status, fleet_domain::model::JobStatus::Complete, "{:?}", report.failed_chunks);
    assert_eq!(report_accounts(&report), expected_accounts(&files), "exact totals after the outage");
    assert_eq!(dead_letters(&s).await, (0, 0), "nothing dead-lettered");
    stop.cancel();
    processor.await.unwrap().unwrap();
    controller.await.unwrap().unwrap();
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqs_hung_for_three_minutes_mid_job_pauses_and_the_job_completes_exact() {
    if !crate::support::stack_running() {
        return;
    }
    let Some(s) = crate::support::stack(QueueSettings { max_receive_count: 3, visibility_timeout: Duration::from_secs(10) }).await else { return };
    let proxy = Proxy::start(0, "127.0.0.1:4566").await;
    // The services' queues through the proxy; S3 direct.
    let via = Aws::local(&proxy.endpoint()).await.with_policy(short_calls());
    let n = &s.names;
    let (work, work_dlq, results, results_dlq) =
        (via.queue(&n.work_queue).await.unwrap(), via.queue(&n.work_dlq()).await.unwrap(), via.queue(&n.results_queue).await.unwrap(), via.queue(&n.results_dlq()).await.unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let processor = tokio::spawn(processor::run(
        fast_processor(),
        processor::Deps {
            work: work.clone(),
            work_dlq: Some(work_dlq.clone()),
            results: results.clone(),
            store: s.store.clone(),
            triggers: n.subscribe(vec![fleet_io::trigger::work_key(work.name())], &stop),
            publish: n.trigger_bus(),
        },
        stop.clone(),
    ));
    let controller = tokio::spawn(controller::run(
        controller::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 10, ..Default::default() },
        controller::Deps {
            results: results.clone(),
            work_dlq: work_dlq.clone(),
            results_dlq: results_dlq.clone(),
            store: s.store.clone(),
            triggers: n.subscribe([results.name(), work_dlq.name(), results_dlq.name()].map(fleet_io::trigger::work_key).to_vec(), &stop),
            publish: n.trigger_bus(),
        },
        stop.clone(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "sqs-outage.csv", 60_000, 500, 22)];
    let job = s.submit(&files, 500).await;
    mid_job(&s, &job).await;

    proxy.freeze();
    let frozen_at = Instant::now();
    let mut opened = false;
    while frozen_at.elapsed() < Duration::from_secs(180) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        opened |= via.breakers.sqs.is_open();
        assert!(!processor.is_finished() && !controller.is_finished(), "a service stopped during the outage");
    }
    proxy.thaw();
    assert!(opened, "SQS's breaker never opened");
    let report = s.wait_report(&job, Duration::from_secs(180)).await;
    eprintln!("SQS hung 180 s; report {:.1} s after the thaw", frozen_at.elapsed().as_secs_f64() - 180.0);
    assert_consistent(&report);
    assert_eq!(report.status, fleet_domain::model::JobStatus::Complete, "{:?}", report.failed_chunks);
    assert_eq!(report_accounts(&report), expected_accounts(&files), "exact totals after the outage");
    assert_eq!(dead_letters(&s).await.0, 0, "no work item dead-lettered");
    stop.cancel();
    processor.await.unwrap().unwrap();
    controller.await.unwrap().unwrap();
}
