//! The agent loop on in-memory queues and bus, under paused time.

use std::sync::Arc;
use std::time::Duration;

use fleet_io::memory::MemoryQueue;
use fleet_io::queue::Queue;
use fleet_io::trigger::{InstanceReport, MemoryTriggers, TriggerBus, WorkDetected};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::backend::NoneBackend;

struct Fixture {
    work: Arc<MemoryQueue>,
    dlq: Arc<MemoryQueue>,
    bus: Arc<MemoryTriggers>,
    backend: Arc<NoneBackend>,
    state: SharedState,
    stop: CancellationToken,
    agent: tokio::task::JoinHandle<fleet_io::Result<()>>,
}

fn start(settings: Settings) -> Fixture {
    let work = MemoryQueue::new("billing-work", Duration::from_secs(30));
    let dlq = MemoryQueue::new("dlq", Duration::from_secs(30));
    let results = MemoryQueue::new("results", Duration::from_secs(30));
    let bus = MemoryTriggers::new();
    let backend = Arc::new(NoneBackend::new(settings.min_instances));
    let deps = Deps {
        watched: Watched { work: work.clone(), work_dlq: dlq.clone(), results, results_dlq: MemoryQueue::new("results-dlq", Duration::from_secs(30)) },
        publish: Some(bus.clone() as Arc<dyn TriggerBus>),
        subscription: Some(bus.subscription()),
        backend: backend.clone(),
    };
    let state = new_state(&settings, "none");
    let stop = CancellationToken::new();
    let agent = tokio::spawn(run_with_state(settings, deps, state.clone(), stop.clone()));
    Fixture { work, dlq, bus, backend, state, stop, agent }
}

impl Fixture {
    async fn stop(self) {
        self.stop.cancel();
        self.agent.await.unwrap().unwrap();
    }

    async fn actual(&self) -> u32 {
        self.backend.actual().await.unwrap()
    }

    fn requests(&self) -> u64 {
        lock(&self.state).requests
    }
}

fn bodies(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("m{i}")).collect()
}

#[tokio::test(start_paused = true)]
async fn triggers_once_when_work_appears() {
    let f = start(Settings { idle_interval_secs: 1, ..Settings::quick() });
    let mut rx = f.bus.tx.subscribe();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(rx.try_recv().is_err(), "no trigger while the queue is empty");
    f.work.send(bodies(2)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ev = rx.try_recv().expect("a trigger when work appears");
    assert_eq!((ev.queue.as_str(), ev.messages, ev.source.as_str()), ("billing-work", 2, SOURCE));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(rx.try_recv().is_err(), "one look with nobody taking the work is not yet a lost trigger");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ev = rx.try_recv().expect("work waiting with none in flight at two looks in a row: announced again");
    assert_eq!(ev.queue.as_str(), "billing-work");
    // Taken (in flight): nothing more to announce.
    let taken = f.work.receive(10, Duration::ZERO).await.unwrap();
    assert_eq!(taken.len(), 2);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(rx.try_recv().is_err(), "work in flight is being taken: no trigger");
    assert_eq!(lock(&f.state).announced, 2);
    // A dead letter nobody announced wakes the controller's dead-letter listener.
    f.dlq.send(bodies(1)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ev = rx.try_recv().expect("a trigger for the dead-letter queue");
    assert_eq!((ev.queue.as_str(), ev.messages), ("dlq", 1));
    assert!(rx.try_recv().is_err());
    f.stop().await;
}

/// Idle, the agent reads the work queue alone, at the SLA less two busy intervals by default, and
/// still sees work that arrives with no trigger within that bound; busy again, it reads every queue.
#[tokio::test(start_paused = true)]
async fn idle_looks_read_the_work_queue_alone_within_the_sla() {
    let settings = Settings { interval_secs: 5, idle_interval_secs: 0, sla_secs: 60, ..Settings::quick() };
    assert_eq!(settings.cadence().idle_cap, Duration::from_secs(50));
    assert!(settings.idle_sla_warning().is_none());
    assert!(Settings { idle_interval_secs: 120, ..settings.clone() }.idle_sla_warning().unwrap().contains("past the 60 s SLA"));
    let f = start(settings);
    // Looks at 0 (every queue), then, idle, at 10, 30, 70 and every 50 s (the cap): 120, 170, 220, 270.
    tokio::time::sleep(Duration::from_secs(301)).await;
    let idle = f.requests();
    assert_eq!(idle, 4 + 7, "the first look reads all four queues, the idle ones the work queue alone");
    let mut rx = f.bus.tx.subscribe();
    // Work with no trigger: seen at the next idle look, at most 50 s later.
    f.work.send(bodies(1)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(50)).await;
    let ev = rx.try_recv().expect("seen within the idle interval");
    assert_eq!(ev.queue.as_str(), "billing-work");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(f.requests() >= idle + 1 + 4, "busy again: every queue is read");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn scales_to_the_backlog_then_back_to_min_after_the_window() {
    // 10 msg/s per instance x 10 s SLA: 100 messages per instance.
    let settings =
        Settings { min_instances: 1, max_instances: 8, sla_secs: 10, stabilization_secs: 30, interval_secs: 1, idle_interval_secs: 1, ..Settings::quick() };
    let f = start(settings);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(f.actual().await, 1);
    f.work.send(bodies(450)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(f.actual().await, 5, "one step: 1 + 4");
    let d = lock(&f.state).last_decision.unwrap();
    assert_eq!((d.recommended, d.desired, d.reason), (5, 5, Reason::ScaleUp));
    assert_eq!(d.signals.backlog, 450);
    // The work is done (received and deleted).
    loop {
        let got = f.work.receive(10, Duration::ZERO).await.unwrap();
        if got.is_empty() {
            break;
        }
        f.work.delete(got).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(f.actual().await, 5, "held within the stabilization window");
    assert_eq!(lock(&f.state).last_decision.unwrap().reason, Reason::HoldStabilizing);
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(f.actual().await, 1, "down to min after the window");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn idle_polling_slows_down_and_a_trigger_brings_the_agent_back_at_once() {
    let f = start(Settings { min_instances: 0, interval_secs: 5, idle_interval_secs: 120, ..Settings::quick() });
    // Let the interval reach its cap, then count an hour of idle looks.
    tokio::time::sleep(Duration::from_secs(300)).await;
    let before = f.requests();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let per_min = (f.requests() - before) as f64 / 60.0;
    assert_eq!(f.requests() - before, 30, "an idle look every two minutes, of the work queue alone: {per_min} a minute");
    assert_eq!(f.actual().await, 0);
    // Work and its trigger: a look and a decision from zero within the same instant.
    f.work.send(bodies(3)).await.unwrap();
    f.bus.publish(&WorkDetected { queue: "billing-work".into(), messages: 3, source: "initiator".into() }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(f.actual().await, 1, "from zero at once on a trigger");
    let d = lock(&f.state).last_decision.unwrap();
    assert_eq!(d.reason, Reason::FromZero);
    assert!(d.signals.work_detected);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn instance_reports_feed_throughput_and_the_in_flight_floor() {
    let f = start(Settings { min_instances: 0, max_instances: 20, sla_secs: 10, interval_secs: 1, ..Settings::quick() });
    f.work.send(bodies(400)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Default 10 msg/s: 400 / 100 = 4 instances.
    assert_eq!(lock(&f.state).last_decision.unwrap().recommended, 4);
    // Saturated instances report 40 msg/s each: one is enough for the backlog.
    for i in 0..4 {
        let r = InstanceReport {
            instance: format!("p{i}"),
            queue: "billing-work".into(),
            processed: 100,
            rate: 40.0,
            in_hand: 16,
            consumers: 4,
            saturated: true,
            leaving: false,
            paused_for: Vec::new(),
        };
        f.bus.report(&r).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let s = lock(&f.state).clone();
    let d = s.last_decision.unwrap();
    assert_eq!(d.throughput, 40.0);
    assert_eq!(s.observed.busy_instances, 4);
    assert_eq!(d.recommended, 4, "never below the instances holding work");
    assert_eq!(s.instances.len(), 4);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_fleet_paused_for_an_outage_gets_no_more_instances_until_it_answers() {
    let f = start(Settings { min_instances: 1, max_instances: 20, sla_secs: 10, interval_secs: 1, ..Settings::quick() });
    let paused = |paused_for: Vec<String>| InstanceReport {
        instance: "p0".into(),
        queue: "billing-work".into(),
        processed: 10,
        rate: 0.0,
        in_hand: 16,
        consumers: 0,
        saturated: true,
        leaving: false,
        paused_for,
    };
    // The agent subscribes as its task starts.
    tokio::time::sleep(Duration::from_millis(10)).await;
    f.bus.report(&paused(vec!["S3".into()])).await.unwrap();
    f.work.send(bodies(2000)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let s = lock(&f.state).clone();
    assert_eq!(s.paused_for, vec!["S3"]);
    let d = s.last_decision.unwrap();
    assert!(d.recommended > 1, "{d:?}");
    assert_eq!((d.desired, d.reason), (1, policy::Reason::HoldPaused));
    assert_eq!(f.actual().await, 1, "an instance was added while the fleet was paused");
    // The dependency answers: the next report says so, and the backlog gets its instances.
    f.bus.report(&paused(Vec::new())).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(lock(&f.state).paused_for.is_empty());
    assert!(f.actual().await > 1, "not scaled after the outage");
    f.stop().await;
}

/// Ready once a look read the queues and the bus is live; not live when the loop stops looking.
#[tokio::test(start_paused = true)]
async fn health_follows_the_looks_and_the_bus() {
    let f = start(Settings { idle_interval_secs: 1, ..Settings::quick() });
    let before = lock(&f.state).health(tokio::time::Instant::now());
    assert!(before.live && !before.ready, "live but not ready before the first look: {before:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let h = lock(&f.state).health(tokio::time::Instant::now());
    assert!(h.ready && h.live, "{h:?}");
    let later = tokio::time::Instant::now() + Duration::from_secs(1) + LOOK_SLACK + Duration::from_secs(5);
    let stuck = lock(&f.state).health(later);
    assert!(!stuck.live && stuck.reasons.iter().any(|r| r.contains("no look")), "{stuck:?}");
    lock(&f.state).paused_for = vec!["SQS".into()];
    assert!(!lock(&f.state).health(tokio::time::Instant::now()).ready);
    f.stop().await;
}

#[derive(clap::Parser)]
struct SettingsCli {
    #[command(flatten)]
    settings: Settings,
}

fn parse(args: &[&str]) -> Result<Settings, clap::Error> {
    use clap::Parser;
    SettingsCli::try_parse_from(std::iter::once("scaling-agent").chain(args.iter().copied())).map(|c| c.settings)
}

/// Kubernetes gives the agent and KEDA's queue-length fallback one figure, the target per instance:
/// the agent's starting throughput is that target over the SLA, and the two ways of saying it cannot
/// both be given.
#[test]
fn a_target_per_instance_sets_the_starting_throughput() {
    let s = parse(&["--sla-secs", "60", "--target-per-instance", "600"]).unwrap();
    assert_eq!(s.starting_throughput(), 10.0);
    assert_eq!(s.policy().per_instance_within_sla(), 600.0);
    let s = parse(&["--sla-secs", "30", "--instance-throughput", "4"]).unwrap();
    assert_eq!(s.starting_throughput(), 4.0);
    assert_eq!(s.policy().per_instance_within_sla(), 120.0);
    let both = parse(&["--target-per-instance", "600", "--instance-throughput", "4"]).expect_err("both accepted");
    assert!(both.to_string().contains("cannot be used with"), "{both}");
    for bad in ["0", "-5", "lots"] {
        let e = parse(&[&format!("--target-per-instance={bad}")]).err().unwrap_or_else(|| panic!("{bad} accepted"));
        assert!(e.to_string().contains("not a positive number"), "{e}");
    }
}

/// `/metrics` in OpenMetrics: build info, and series whose value is not known yet (no decision, no
/// waiting item) left out rather than set to -1; once a decision is made they appear. Both clean
/// under `promtool check metrics` (when promtool is on PATH).
#[tokio::test(start_paused = true)]
async fn metrics_leave_unknown_series_out_and_carry_build_info() {
    let settings = Settings { min_instances: 1, interval_secs: 1, ..Settings::quick() };
    let state = new_state(&settings, "none");
    let m = crate::http::render_metrics(&lock(&state));
    assert!(m.contains("# TYPE fleet_build_info gauge") && m.contains("fleet_build_info{service="), "{m}");
    // The process's own figures, as every fleet service serves them.
    let rss = m.lines().find_map(|l| l.strip_prefix("process_resident_memory_bytes ")).and_then(|v| v.parse::<u64>().ok());
    assert!(rss.is_some_and(|b| b > 1 << 20), "{m}");
    assert!(m.contains("# TYPE process_cpu_seconds counter") && m.contains("process_open_fds "), "{m}");
    assert!(!m.contains("agent_desired_instances") && !m.contains("agent_oldest_age_seconds") && !m.contains(" -1"), "{m}");
    assert!(m.trim_end().ends_with("# EOF"), "{m}");
    fleet_test_support::promtool::assert_clean("the agent's /metrics before a decision", &m);
    let f = start(settings);
    f.work.send(bodies(3)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = crate::http::render_metrics(&lock(&f.state));
    assert!(m.contains("agent_desired_instances "), "{m}");
    // Every series present (a decision, an item waiting, the depths): `promtool check metrics` clean.
    let names = fleet_test_support::promtool::metric_names(&m);
    for name in ["agent_actual_instances", "agent_oldest_age_seconds", "agent_sla_seconds", "agent_queue_messages", "agent_decisions_total"] {
        assert!(names.contains(name), "{name} missing:\n{m}");
    }
    fleet_test_support::promtool::assert_clean("the agent's /metrics", &m);
    f.stop().await;
}
