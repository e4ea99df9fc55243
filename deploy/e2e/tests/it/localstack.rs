//! The listener engine and the processor on LocalStack: a burst raises consumers to max and idleness
//! brings them back to min; a slow message is kept invisible by the heartbeat and processed once; a
//! processor killed with SIGKILL mid-job loses nothing. Needs the stack that deploy/test.sh starts.

use crate::support::Fleet as _;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::get_state;
use async_trait::async_trait;
use fleet_domain::model::JobStatus;
use fleet_engine::backoff::IdleBackoff;
use fleet_engine::dynamic_consumers::{ScalingPolicy, WorkRules};
use fleet_engine::throttle::ThrottleLimits;
use fleet_engine::{Completions, Engine, EngineConfig, Handler, Outcome};
use fleet_io::provision::QueueSettings;
use fleet_io::queue::{Delivery, Queue};

struct Recorder {
    work: Duration,
    slow: Option<(String, Duration)>,
    seen: Mutex<Vec<String>>,
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, msgs: Vec<Delivery>, _done: &Completions) -> Vec<(Delivery, Outcome)> {
        for m in &msgs {
            self.seen.lock().unwrap().push(m.body.clone());
            let extra = self.slow.as_ref().filter(|(b, _)| *b == m.body).map_or(Duration::ZERO, |(_, d)| *d);
            tokio::time::sleep(self.work + extra).await;
        }
        msgs.into_iter().map(|m| (m, Outcome::Done)).collect()
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
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
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
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(2) }).await else { return };
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

/// One handling: start, end, body, instance, succeeded.
type Handled = (Duration, Duration, String, usize, bool);

/// Records when each message was handled and by which instance; fails chosen bodies once.
struct Timed {
    instance: usize,
    epoch: Instant,
    fail_once: Arc<Mutex<Vec<String>>>,
    log: Arc<Mutex<Vec<Handled>>>,
}

#[async_trait]
impl Handler for Timed {
    async fn handle(&self, msgs: Vec<Delivery>, _done: &Completions) -> Vec<(Delivery, Outcome)> {
        let mut out = Vec::new();
        for m in msgs {
            let start = self.epoch.elapsed();
            tokio::time::sleep(Duration::from_millis(30)).await;
            let fail = {
                let mut f = self.fail_once.lock().unwrap();
                let hit = f.iter().position(|b| *b == m.body);
                hit.map(|i| f.remove(i)).is_some()
            };
            self.log.lock().unwrap().push((start, self.epoch.elapsed(), m.body.clone(), self.instance, !fail));
            out.push((m, if fail { Outcome::Failed("injected".into()) } else { Outcome::Done }));
        }
        out
    }
}

/// Seed 003's per-partition order on a real SQS FIFO queue, across two listener instances: each
/// group's messages are handled one at a time, in order, also around a failed message's retry, and
/// different groups in parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_groups_keep_their_order_across_instances_and_retries() {
    let Some(st) = crate::support::fifo_stack(QueueSettings::default()).await else { return };
    let mut out = Vec::new();
    for i in 1..=8 {
        for g in ["a", "b", "c"] {
            out.push(fleet_io::queue::Outgoing {
                body: format!("{g}{i}"),
                attrs: fleet_io::queue::Attrs { group: Some(g.into()), ..Default::default() },
                dedup: None,
            });
        }
    }
    st.work.send_messages(&out).await.unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let epoch = Instant::now();
    let cfg = EngineConfig { retry: fleet_engine::backoff::RetryBackoff { base: Duration::from_secs(2), max: Duration::from_secs(4) }, ..engine_cfg() };
    let fail_once = Arc::new(Mutex::new(vec!["b3".to_string()]));
    let engines = futures::future::join_all((0..2).map(|instance| {
        let h = Arc::new(Timed { instance, epoch, fail_once: fail_once.clone(), log: log.clone() });
        Engine::start(st.work.clone(), None, h, cfg.clone())
    }))
    .await;
    let start = Instant::now();
    while log.lock().unwrap().iter().filter(|x| x.4).count() < 24 {
        assert!(start.elapsed() < Duration::from_secs(60), "not all handled: {:?}", log.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for e in engines {
        e.unwrap().shutdown(Duration::from_secs(5)).await;
    }
    st.wait_depth(st.work.as_ref(), 0, Duration::from_secs(10)).await;
    let log = log.lock().unwrap().clone();
    for g in ["a", "b", "c"] {
        let mine: Vec<_> = log.iter().filter(|x| x.2.starts_with(g)).collect();
        let done: Vec<&str> = mine.iter().filter(|x| x.4).map(|x| x.2.as_str()).collect();
        assert_eq!(done, (1..=8).map(|i| format!("{g}{i}")).collect::<Vec<_>>(), "group {g}: {mine:?}");
        assert!(mine.windows(2).all(|w| w[1].0 >= w[0].1), "group {g} overlapped: {mine:?}");
    }
    let b3: Vec<_> = log.iter().filter(|x| x.2 == "b3").collect();
    assert_eq!(b3.iter().map(|x| x.4).collect::<Vec<_>>(), [false, true], "one failure, retried in place: {log:?}");
    assert!(b3[1].0 - b3[0].1 >= Duration::from_millis(1900), "retried after its 2 s back-off: {b3:?}");
    let overlapping = log.iter().any(|x| log.iter().any(|y| x.2 < y.2 && x.0 < y.1 && y.0 < x.1));
    assert!(overlapping, "different groups ran in parallel: {log:?}");
}

/// A poison message at the head of a group on a real SQS FIFO queue with a real redrive policy
/// (maxReceiveCount 3): retried in place and dead-lettered by the listener, it goes to the
/// dead-letter queue alone; its group's later messages follow in order, each received once. (Given
/// back with every retry, as before, they spent a receive each time and SQS dead-lettered them too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_on_a_fifo_queue_is_dead_lettered_alone() {
    let Some(st) = crate::support::fifo_stack(QueueSettings { max_receive_count: 3, ..QueueSettings::default() }).await else { return };
    let mut out = Vec::new();
    for i in 1..=4 {
        for g in ["p", "q"] {
            out.push(fleet_io::queue::Outgoing {
                body: format!("{g}{i}"),
                attrs: fleet_io::queue::Attrs { group: Some(g.into()), ..Default::default() },
                dedup: None,
            });
        }
    }
    st.work.send_messages(&out).await.unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let cfg = EngineConfig { retry: fleet_engine::backoff::RetryBackoff { base: Duration::from_secs(1), max: Duration::from_secs(2) }, ..engine_cfg() };
    let fail = Arc::new(Mutex::new(vec!["p1".to_string(); 3]));
    let h = Arc::new(Timed { instance: 0, epoch: Instant::now(), fail_once: fail.clone(), log: log.clone() });
    let engine = Engine::start(st.work.clone(), Some(st.work_dlq.clone()), h, cfg).await.unwrap();
    let start = Instant::now();
    while log.lock().unwrap().iter().filter(|x| x.4).count() < 7 {
        assert!(start.elapsed() < Duration::from_secs(60), "not all handled: {:?}", log.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.shutdown(Duration::from_secs(5)).await;
    st.wait_depth(st.work.as_ref(), 0, Duration::from_secs(10)).await;
    let log = log.lock().unwrap().clone();
    let done: Vec<&str> = log.iter().filter(|x| x.4 && x.2.starts_with('p')).map(|x| x.2.as_str()).collect();
    assert_eq!(done, ["p2", "p3", "p4"], "{log:?}");
    assert_eq!(log.iter().filter(|x| x.2 == "p1").count(), 3, "p1 tried as often as the redrive allows: {log:?}");
    assert!(fail.lock().unwrap().is_empty());
    let dead = st.work_dlq.receive(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(dead.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), ["p1"], "only the poison message is dead-lettered");
    assert!(st.work_dlq.receive(10, Duration::from_secs(1)).await.unwrap().is_empty(), "nothing else in the dead-letter queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_with_sigkill_mid_job_loses_nothing() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(3) }).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = crate::support::generated(dir.path(), "a.csv", 100_000, 300, 11);
    // A port free now (one derived from the pid could be taken by another test's listener, and the
    // processor would exit at start: CI saw "no progress" once).
    let addr = crate::support::free_addr().to_string();
    let mut cmd = Command::new(crate::support::bin("processor"));
    cmd.env("FLEET_BUCKET", &st.names.bucket)
        .env("FLEET_WORK_QUEUE", &st.names.work_queue)
        .env("FLEET_WORK_DLQ", st.names.work_dlq())
        .env("FLEET_RESULTS_QUEUE", &st.names.results_queue)
        .env("AMQP_URL", "")
        .env("LISTENER_RECEIVE_WAIT_SECS", "1")
        .env("LISTENER_MAX_CONCURRENCY", "1")
        .env("LISTENER_BUFFER", "10")
        .env("LISTENER_HTTP_ADDR", &addr)
        .env("FLEET_SIGNING_KEY_FILE", crate::support::role_keys().file(fleet_io::auth::Role::Processor))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        cmd.env("AWS_ENDPOINT_URL", crate::support::LOCALSTACK)
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
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
    // The killed processor's work items come back after the visibility timeout, unannounced: the
    // scaling agent sees them and wakes the (by then parked) processor.
    let agent = st.start_agent();
    let p = st.start_processor(crate::support::fast_processor());
    let report = st.wait_report(&submitted, Duration::from_secs(120)).await;
    assert_eq!(report.status, JobStatus::Complete);
    assert_eq!(report.transactions.processed, 100_000);
    assert_eq!(crate::support::report_accounts(&report), crate::support::expected_accounts(&[file]));
    p.stop().await;
    controller.stop().await;
    agent.stop().await;
}
