//! The listener engine and the processor on LocalStack: a burst raises consumers to max and idleness
//! brings them back to min; a slow message is kept invisible by the heartbeat and processed once; a
//! processor killed with SIGKILL mid-job loses nothing. Needs the stack that deploy/test.sh starts.

#[path = "../../initiator/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shared::listener::backoff::IdleBackoff;
use shared::listener::dynamic_consumers::{ScalingPolicy, WorkRules};
use shared::listener::throttle::ThrottleLimits;
use shared::listener::{Completions, Engine, EngineConfig, Handler, Outcome};
use shared::model::JobStatus;
use shared::provision::QueueSettings;
use shared::queue::{Message, Queue};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Recorder {
    work: Duration,
    slow: Option<(String, Duration)>,
    seen: Mutex<Vec<String>>,
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, msgs: &[Message], _done: &Completions) -> Vec<Outcome> {
        for m in msgs {
            self.seen.lock().unwrap().push(m.body.clone());
            let extra = self.slow.as_ref().filter(|(b, _)| *b == m.body).map_or(Duration::ZERO, |(_, d)| *d);
            tokio::time::sleep(self.work + extra).await;
        }
        vec![Outcome::Done; msgs.len()]
    }
}

fn recorder(work: Duration, slow: Option<(&str, Duration)>) -> Arc<Recorder> {
    Arc::new(Recorder { work, slow: slow.map(|(b, d)| (b.to_string(), d)), seen: Mutex::default() })
}

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        scaling: ScalingPolicy { min_consumers: 1, max_consumers: 4, sample_rate: 1, idle_threshold: 3, busy_threshold: 1 },
        backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_millis(500) },
        receive_wait: Duration::from_secs(1),
        work_rules: WorkRules::parse("*:1").unwrap(),
        throttle: ThrottleLimits { max_concurrency: 64, buffer: 64, ttl: None },
        ..EngineConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_raises_consumers_to_max_and_idleness_brings_them_back_to_min() {
    let st = common::stack(QueueSettings::default()).await;
    let bodies: Vec<String> = (0..1500).map(|i| format!("m{i}")).collect();
    st.work.send(bodies).await.unwrap();
    let h = recorder(Duration::from_millis(2), None);
    let e = Engine::start(st.work.clone(), None, h.clone(), engine_cfg()).await.unwrap();
    let start = Instant::now();
    let mut peak = 0;
    while h.seen.lock().unwrap().len() < 1500 {
        peak = peak.max(e.active_consumers());
        assert!(start.elapsed() < Duration::from_secs(60), "burst not processed: {} seen", h.seen.lock().unwrap().len());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    peak = peak.max(e.active_consumers());
    assert_eq!(peak, 4, "timeline {:?}", e.timeline());
    let idle = Instant::now();
    while e.active_consumers() > 1 {
        assert!(idle.elapsed() < Duration::from_secs(60), "still {} consumers; timeline {:?}", e.active_consumers(), e.timeline());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    e.shutdown(Duration::from_secs(5)).await;
    st.wait_depth(st.work.as_ref(), 0, Duration::from_secs(10)).await;
    let mut seen = h.seen.lock().unwrap().clone();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 1500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_message_is_kept_invisible_by_the_heartbeat_and_processed_once() {
    let st = common::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(2) }).await;
    st.work.send(vec!["slow".to_string()]).await.unwrap();
    let slow = recorder(Duration::ZERO, Some(("slow", Duration::from_secs(7))));
    let a = Engine::start(st.work.clone(), None, slow.clone(), engine_cfg()).await.unwrap();
    // Wait until the first instance holds it, then start a second instance polling the same queue.
    let start = Instant::now();
    while slow.seen.lock().unwrap().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let other = recorder(Duration::ZERO, None);
    let b = Engine::start(st.work.clone(), None, other.clone(), engine_cfg()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert_eq!(slow.seen.lock().unwrap().clone(), vec!["slow"]);
    assert!(other.seen.lock().unwrap().is_empty(), "redelivered to the other instance: the heartbeat failed");
    assert!(a.stats().extended.load(std::sync::atomic::Ordering::Relaxed) >= 5, "extended every second");
    a.shutdown(Duration::from_secs(5)).await;
    b.shutdown(Duration::from_secs(5)).await;
    st.wait_depth(st.work.as_ref(), 0, Duration::from_secs(5)).await;
}

/// GET on the processor's state endpoint.
async fn get_state(addr: &str) -> Option<serde_json::Value> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /state?depth=false HTTP/1.0\r\nHost: x\r\n\r\n").await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf);
    serde_json::from_str(text.split("\r\n\r\n").nth(1)?).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_with_sigkill_mid_job_loses_nothing() {
    let st = common::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(3) }).await;
    let dir = tempfile::tempdir().unwrap();
    let file = common::generated(dir.path(), "a.csv", 100_000, 300, 11);
    let port = 20_000 + (std::process::id() % 20_000);
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_processor"));
    cmd.env("FLEET_BUCKET", &st.names.bucket)
        .env("FLEET_WORK_QUEUE", &st.names.work_queue)
        .env("FLEET_WORK_DLQ", &st.names.work_dlq)
        .env("FLEET_RESULTS_QUEUE", &st.names.results_queue)
        .env("AMQP_URL", "")
        .env("LISTENER_RECEIVE_WAIT_SECS", "1")
        .env("LISTENER_MAX_CONCURRENCY", "1")
        .env("LISTENER_BUFFER", "10")
        .env("LISTENER_HTTP_ADDR", &addr)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        cmd.env("AWS_ENDPOINT_URL", common::LOCALSTACK).env("AWS_ACCESS_KEY_ID", "test").env("AWS_SECRET_ACCESS_KEY", "test").env("AWS_REGION", "us-east-1");
    }
    let mut child = cmd.spawn().unwrap();
    let controller = st.start_controller();
    let submitted = st.submit(std::slice::from_ref(&file), 500).await;
    assert_eq!(submitted.total_chunks, 200);
    // Kill it once it has processed some chunks and holds more.
    let start = Instant::now();
    let processed = loop {
        if let Some(s) = get_state(&addr).await {
            let p = s[0]["processed"].as_u64().unwrap_or(0);
            if p >= 10 && s[0]["in_hand"].as_u64().unwrap_or(0) > 0 {
                break p;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(60), "processor made no progress");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(processed < 200, "killed after the job was done ({processed} processed); not a mid-job kill");
    let p = st.start_processor(common::fast_processor());
    let report = st.wait_report(&submitted, Duration::from_secs(120)).await;
    assert_eq!(report.status, JobStatus::Complete);
    assert_eq!(report.transactions.processed, 100_000);
    assert_eq!(common::report_accounts(&report), common::expected_accounts(&[file]));
    p.stop().await;
    controller.stop().await;
}
