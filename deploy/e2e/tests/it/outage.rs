//! Outages longer than maxReceiveCount x (back-off + call deadline), mid-job, on the real LocalStack and
//! RabbitMQ through TCP proxies the test freezes (connections open, no byte flows: SQS, S3) or cuts
//! (connections dropped, new ones refused: RabbitMQ): the fleet pauses for the dependency and resumes
//! when it answers. Each job completes with exact totals, no work item and no result reaches a
//! dead-letter queue (the processors hold their work items, the controller its results, visibility
//! kept), and no service stops. Processor, controller and agent run as one process would: one `Aws`
//! (its breakers shared) through the proxies.
//!
//! `FLEET_OUTAGE_SECS` sets the long S3 outage's length (600 s, ten minutes, by default).

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

/// What goes down, and for how long.
struct Outage {
    name: &'static str,
    s3: bool,
    sqs: bool,
    rabbitmq: bool,
    length: Duration,
    /// The queues' maxReceiveCount: small, so that spending receive counts on an outage shows.
    max_receive_count: u32,
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

/// Messages in the work and results dead-letter queues (read directly, not through the proxies).
async fn dead_letters(s: &Stack) -> (u64, u64) {
    let (w, r) = (s.work_dlq.depth().await.unwrap(), s.results_dlq.depth().await.unwrap());
    (w.visible + w.in_flight, r.visible + r.in_flight)
}

/// Results the controller holds through an outage now (its state endpoint: `held` of each listener).
async fn controller_held(addr: std::net::SocketAddr) -> u64 {
    let Some(state) = get_state(&addr.to_string()).await else { return 0 };
    state.as_array().map_or(0, |listeners| listeners.iter().filter_map(|l| l["held"].as_u64()).sum())
}

async fn run(o: Outage) {
    if !crate::support::stack_running() {
        return;
    }
    test_log();
    let settings = QueueSettings { max_receive_count: o.max_receive_count, visibility_timeout: Duration::from_secs(10) };
    let Some(mut s) = crate::support::stack(settings).await else { return };
    let aws_proxy = Proxy::start(0, "127.0.0.1:4566").await;
    let amqp_proxy = Proxy::start(0, "127.0.0.1:5672").await;
    s.names.amqp_url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", amqp_proxy.port);
    // Short calls, so that maxReceiveCount x (back-off + deadline) is far shorter than the outage.
    let calls = CallPolicy { attempt_timeout: Duration::from_secs(3), deadline: Duration::from_secs(8), ..CallPolicy::default() };
    let via = Aws::local(&aws_proxy.endpoint()).await.with_policy(calls);
    let direct = Aws::local(LOCALSTACK).await.with_policy(calls);
    let (sqs, s3) = (if o.sqs { &via } else { &direct }, if o.s3 { &via } else { &direct });
    let n = s.names.clone();
    let (work, work_dlq, results, results_dlq) = (
        sqs.queue(&n.work_queue).await.unwrap(),
        sqs.queue(&n.work_dlq()).await.unwrap(),
        sqs.queue(&n.results_queue).await.unwrap(),
        sqs.queue(&n.results_dlq()).await.unwrap(),
    );
    let store = s3.store(&n.bucket);
    let stop = tokio_util::sync::CancellationToken::new();
    let queues = Queues { work: work.clone(), work_dlq, results, results_dlq, store };
    // One work item at a time: the job takes seconds, so the outage starts while it is under way (at
    // full width the fleet billed its 120 chunks between two looks at its progress once).
    let narrow = processor::Settings {
        listener: fleet_engine::args::ListenerArgs { max_concurrency: 1, max_consumers: 1, ..fleet_engine::args::ListenerArgs::quick() },
        ..fast_processor()
    };
    let (processor, controller, controller_http) = start_processor_and_controller(&n, &queues, &stop, narrow);
    let agent = s.start_agent();
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), &format!("{}.csv", o.name), 60_000, 500, 21)];
    let job = s.submit(&files, 500).await;
    mid_job(&s, &job).await;

    if o.s3 || o.sqs {
        aws_proxy.freeze();
    }
    if o.rabbitmq {
        amqp_proxy.cut();
    }
    let down_at = Instant::now();
    let (mut s3_opened, mut sqs_opened, mut held) = (false, false, 0);
    while down_at.elapsed() < o.length {
        tokio::time::sleep(Duration::from_secs(2)).await;
        s3_opened |= via.breakers.s3.is_open();
        sqs_opened |= via.breakers.sqs.is_open();
        assert_eq!(dead_letters(&s).await, (0, 0), "[{}] work items or results dead-lettered during the outage, at {:?}", o.name, down_at.elapsed());
        held = held.max(controller_held(controller_http).await);
        assert!(!processor.is_finished() && !controller.is_finished() && !agent.handle.is_finished(), "[{}] a service stopped during the outage", o.name);
    }
    let probes = (via.breakers.s3.state().probes, via.breakers.sqs.state().probes);
    aws_proxy.thaw();
    let thawed = Instant::now();
    let _amqp_back = if o.rabbitmq { Some(Proxy::start(amqp_proxy.port, "127.0.0.1:5672").await) } else { None };
    assert_eq!((s3_opened, sqs_opened), (o.s3, o.sqs), "[{}] the breakers that opened (S3, SQS)", o.name);

    let report = s.wait_report(&job, Duration::from_secs(180)).await;
    eprintln!(
        "[{}] down {} s (S3 {}, SQS {}, RabbitMQ {}); breaker probes (S3, SQS) {probes:?}; report {:.1} s after it came back; the controller held up to {held} results",
        o.name,
        o.length.as_secs(),
        o.s3,
        o.sqs,
        o.rabbitmq,
        thawed.elapsed().as_secs_f64()
    );
    // Calls stuck in the frozen connections may still time out after the thaw and open a breaker
    // once more; the next probe closes it.
    let t = Instant::now();
    while via.breakers.s3.is_open() || via.breakers.sqs.is_open() {
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "[{}] the breakers did not close again: {:?}",
            o.name,
            (via.breakers.s3.state(), via.breakers.sqs.state())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_consistent(&report);
    assert_eq!(report.status, fleet_domain::model::JobStatus::Complete, "[{}] {:?}", o.name, report.failed_chunks);
    assert_eq!(report_accounts(&report), expected_accounts(&files), "[{}] exact totals after the outage", o.name);
    assert_eq!(dead_letters(&s).await, (0, 0), "[{}] no work item and no result dead-lettered", o.name);
    // The controller's typed events reached its metrics (OpenMetrics): the job, its latency.
    let m = crate::support::get(&controller_http.to_string(), "/metrics").await.expect("the controller's /metrics");
    assert!(m.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{m}");
    assert!(m.contains("controller_jobs_finished_total{status=\"complete\"}") && m.contains("controller_job_latency_seconds_count"), "{m}");
    assert!(m.contains("listener_handling_seconds_bucket") && m.contains("fleet_build_info"), "{m}");
    // The hung service's calls failed as outages (after their retries), by operation, in the call
    // metrics every call passes through; and the calls were timed.
    let sum = |prefix: &str, with: &str| -> f64 {
        m.lines().filter(|l| l.starts_with(prefix) && l.contains(with)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
    };
    for (down, service) in [(o.s3, "s3"), (o.sqs, "sqs")] {
        let errors = sum(&format!("fleet_call_errors_total{{dependency=\"{service}\","), "outage=\"true\"");
        if down {
            assert!(errors > 0.0, "[{}] no {service} call counted as failed for the outage:\n{m}", o.name);
        }
        eprintln!("[{}] {service} calls failed for an outage: {errors}", o.name);
    }
    assert!(sum("fleet_call_seconds_count{dependency=\"sqs\",operation=\"ReceiveMessage\"", "") > 0.0, "{m}");
    stop.cancel();
    processor.await.unwrap().unwrap();
    controller.await.unwrap().unwrap();
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_hung_for_ten_minutes_mid_job_pauses_and_the_job_completes_exact() {
    let length = Duration::from_secs(outage_secs());
    run(Outage { name: "s3-hung", s3: true, sqs: false, rabbitmq: false, length, max_receive_count: 2 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqs_hung_for_three_minutes_mid_job_pauses_and_the_job_completes_exact() {
    run(Outage { name: "sqs-hung", s3: false, sqs: true, rabbitmq: false, length: Duration::from_secs(180), max_receive_count: 3 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_and_s3_down_together_mid_job_the_job_completes_exact() {
    run(Outage { name: "rabbitmq-and-s3", s3: true, sqs: false, rabbitmq: true, length: Duration::from_secs(180), max_receive_count: 2 }).await;
}
