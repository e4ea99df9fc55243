//! Wake-up latency on the real stack: a listener parked on an empty LocalStack queue (its safety poll
//! 10 minutes away) gets one work item and a work-detected trigger over RabbitMQ, 100 times; the time
//! from publishing the trigger to the handler receiving the item is printed (p50, p90, p99, max). A
//! parked listener that missed a trigger would wait for its safety poll: the test fails if any wake-up
//! takes over 2 s.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use fleet_engine::backoff::IdleBackoff;
use fleet_engine::dynamic_consumers::{ScalingPolicy, WorkRules};
use fleet_engine::{Completions, Engine, EngineConfig, Handler, Outcome};
use fleet_io::provision::QueueSettings;
use fleet_io::queue::{Delivery, Queue};
use fleet_io::trigger::{announce, work_key, WorkDetected};
use tokio_util::sync::CancellationToken;

/// When each body arrived.
#[derive(Default)]
struct Arrivals(Mutex<Vec<(String, Instant)>>);

#[async_trait]
impl Handler for Arrivals {
    async fn handle(&self, msgs: Vec<Delivery>, _done: &Completions) -> Vec<(Delivery, Outcome)> {
        let now = Instant::now();
        self.0.lock().unwrap().extend(msgs.iter().map(|m| (m.body.clone(), now)));
        msgs.into_iter().map(|m| (m, Outcome::Done)).collect()
    }
}

/// Triggers measured (`FLEET_WAKES`, 40 by default: each waits about a second for the listener to park
/// again).
fn wakes() -> usize {
    std::env::var("FLEET_WAKES").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(40)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_listener_wakes_on_a_trigger_within_milliseconds() {
    let Some(s) = crate::support::stack(QueueSettings::default()).await else { return };
    let stop = CancellationToken::new();
    let cfg = EngineConfig {
        scaling: ScalingPolicy { min_consumers: 1, max_consumers: 2, sample_rate: 1, idle_threshold: 3, busy_threshold: 1 },
        backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_millis(200) },
        receive_wait: Duration::from_secs(1),
        work_rules: WorkRules::parse("*:1").unwrap(),
        triggers: true,
        park_poll: Some(Duration::from_secs(600)),
        ..EngineConfig::default()
    };
    let h = Arc::new(Arrivals::default());
    let e = Engine::start(s.work.clone(), None, h.clone(), cfg).await.unwrap();
    let sub = s.names.subscribe(vec![work_key(s.work.name())], &stop).unwrap();
    e.follow_triggers(&sub, stop.clone());
    let bus = s.names.trigger_bus().unwrap();

    let wakes = wakes();
    let mut latencies = Vec::with_capacity(wakes);
    for i in 0..wakes {
        let t = Instant::now();
        loop {
            let st = e.state();
            if st.consumers_parked >= 1 && st.consumers_active == 0 && e.triggers_live() {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "wake {i}: the listener did not park: {st:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let body = format!("w{i}");
        s.work.send(vec![body.clone()]).await.unwrap();
        let t0 = Instant::now();
        announce(bus.as_ref(), &WorkDetected { queue: s.work.name().to_string(), messages: 1, source: "test".into() }).await;
        let arrived = loop {
            if let Some((_, at)) = h.0.lock().unwrap().iter().find(|(b, _)| *b == body) {
                break *at;
            }
            assert!(t0.elapsed() < Duration::from_secs(2), "wake {i}: the item was not received within 2 s of the trigger");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        latencies.push(arrived.duration_since(t0));
    }
    latencies.sort();
    let ms = |q: f64| latencies[((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1].as_secs_f64() * 1e3;
    eprintln!(
        "wake-up latency over {wakes} triggers (published -> received by a parked listener): p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(0.5),
        ms(0.9),
        ms(0.99),
        ms(1.0)
    );
    let st = e.state();
    assert_eq!(st.processed, wakes as u64);
    stop.cancel();
    e.shutdown(Duration::from_secs(5)).await;
}
