//! The scaling agent with its `process` backend on the real stack (LocalStack, RabbitMQ): a burst scales
//! processor processes 1 -> N by the SLA policy, an instance stopped mid-job is replaced, the totals are
//! exact, the fleet goes back to the minimum after the stabilization window, and stopping the agent
//! stops (drains) its processors. Needs what deploy/test.sh starts.

use crate::support::Fleet as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;
use fleet_io::trigger::{instance_report_key, ALL_WORK};
use scaling_agent::backend::{Backend, ProcessBackend, ProcessSpec};
use tokio_util::sync::CancellationToken;

fn spec(s: &crate::support::Stack) -> ProcessSpec {
    let n = &s.names;
    let args = [
        ("--bucket", n.bucket.clone()),
        ("--work-queue", n.work_queue.clone()),
        ("--work-dlq", n.work_dlq()),
        ("--results-queue", n.results_queue.clone()),
        ("--trigger-exchange", n.trigger_exchange.clone()),
        // Slow instances (one work item at a time), so that the burst needs more than one.
        ("--max-consumers", "1".into()),
        ("--max-concurrency", "1".into()),
        ("--buffer", "0".into()),
        ("--receive-wait-secs", "1".into()),
        ("--drain-secs", "10".into()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let mut envs = vec![
        ("AMQP_URL".to_string(), n.amqp_url.clone()),
        ("RUST_LOG".to_string(), "warn".to_string()),
        ("FLEET_SIGNING_KEY_FILE".to_string(), crate::support::role_keys().file(fleet_io::auth::Role::Processor).display().to_string()),
    ];
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        for (k, v) in
            [("AWS_ENDPOINT_URL", crate::support::LOCALSTACK), ("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")]
        {
            envs.push((k.into(), v.into()));
        }
    }
    ProcessSpec { program: crate::support::bin("processor"), args, envs, http_base: None, log_dir: None, drain: Duration::from_secs(15) }
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.split_whitespace().nth(2) == Some("Z"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_scales_processes_up_and_back_to_the_minimum_with_exact_totals() {
    let Some(s) = crate::support::stack(QueueSettings::default()).await else { return };
    let controller = s.start_controller();
    let backend = Arc::new(ProcessBackend::new(spec(&s)));
    let stop = CancellationToken::new();
    let settings = scaling_agent::Settings {
        interval_secs: 1,
        idle_interval_secs: 4,
        min_instances: 1,
        max_instances: 3,
        sla_secs: 5,
        instance_throughput: 2.0,
        target_per_instance: None,
        step_up: 4,
        stabilization_secs: 10,
        http_addr: None,
    };
    let deps = scaling_agent::Deps {
        watched: scaling_agent::Watched { work: s.work.clone(), work_dlq: s.work_dlq.clone(), results: s.results.clone(), results_dlq: s.results_dlq.clone() },
        publish: s.names.trigger_bus(),
        subscription: s.names.subscribe(vec![ALL_WORK.into(), instance_report_key(s.work.name())], &stop),
        backend: backend.clone(),
    };
    let state = scaling_agent::new_state(&settings, "process");
    let agent = tokio::spawn(scaling_agent::run_with_state(settings, deps, state.clone(), stop.clone()));
    let t0 = Instant::now();
    while backend.actual().await.unwrap() != 1 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the minimum instance did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = backend.children().await[0].pid;
    // Let the first processor subscribe (it parks after its first empty 1 s poll).
    tokio::time::sleep(Duration::from_secs(3)).await;

    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "burst.csv", 200_000, 500, 9)];
    let submitted = Instant::now();
    // 1,000 work items: enough that work still waits when the stopped instance is gone (with fewer, a
    // fast run could finish the backlog first, and then the policy rightly needs no replacement).
    let job = s.submit(&files, 200).await;
    assert_eq!(job.total_chunks, 1_000);
    // Scaled up while the work is there.
    let mut reached = None;
    while reached.is_none() {
        let n = backend.actual().await.unwrap();
        if n == 3 {
            reached = Some(submitted.elapsed());
        }
        assert!(submitted.elapsed() < Duration::from_secs(30), "never reached 3 instances; state: {:?}", state.lock().unwrap().last_decision);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let depth = s.work.depth().await.unwrap();
    assert!(depth.visible > 0, "scaled up while work was waiting: {depth:?}");
    // All three work: each reports.
    let t = Instant::now();
    while state.lock().unwrap().instances.len() < 3 {
        assert!(t.elapsed() < Duration::from_secs(15), "not every instance reported: {:?}", state.lock().unwrap().instances);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // One instance stops mid-job (SIGTERM: it drains); the agent replaces it.
    let victim = backend.children().await.iter().find(|c| c.pid != first).unwrap().pid;
    assert!(std::process::Command::new("kill").args(["-TERM", &victim.to_string()]).status().unwrap().success());
    let t = Instant::now();
    while alive(victim) || backend.actual().await.unwrap() < 3 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the stopped instance was not replaced (alive: {}, instances: {}, work queue: {:?}, last decision: {:?})",
            alive(victim),
            backend.actual().await.unwrap(),
            s.work.depth().await.ok(),
            state.lock().unwrap().last_decision
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = s.wait_report(&job, Duration::from_secs(120)).await;
    let took = submitted.elapsed();
    crate::support::assert_consistent(&report);
    assert_eq!(report.transactions.processed, 200_000);
    assert_eq!(crate::support::report_accounts(&report), crate::support::expected_accounts(&files), "exact totals");
    // Back to the minimum after the stabilization window.
    let done = Instant::now();
    while backend.actual().await.unwrap() != 1 || backend.stopping().await != 0 {
        assert!(done.elapsed() < Duration::from_secs(40), "not back to 1: {:?}", state.lock().unwrap().last_decision);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let back = done.elapsed();
    let st = state.lock().unwrap().clone();
    assert!(st.scale_ups >= 1 && st.scale_downs >= 1, "{st:?}");
    eprintln!(
        "burst of {} work items: 3 instances {:.1} s after submit; report after {:.1} s; back to 1 instance {:.1} s later",
        job.total_chunks,
        reached.unwrap().as_secs_f64(),
        took.as_secs_f64(),
        back.as_secs_f64()
    );
    // Stopping the agent stops its processors.
    let pids: Vec<u32> = backend.children().await.iter().map(|c| c.pid).collect();
    stop.cancel();
    agent.await.unwrap().unwrap();
    assert!(pids.iter().all(|p| !alive(*p)), "processors outlived the agent");
    controller.stop().await;
}
