//! Work-detected triggers over the real RabbitMQ broker: a published event reaches a subscriber, and a
//! processor parked after an empty receive is woken by it.

use std::time::Duration;

use crate::support::amqp_url;
use fleet_io::trigger::{spawn_subscription, work_key, InstanceReport, RabbitTriggers, Subscription, TriggerBus, WorkDetected, ALL_REPORTS, ALL_WORK};
use tokio_util::sync::CancellationToken;

async fn live(sub: &Subscription) {
    let mut live = sub.live.clone();
    tokio::time::timeout(Duration::from_secs(20), live.wait_for(|l| *l)).await.expect("subscribed within 20 s").unwrap();
}

/// Routing by queue: a listener gets the triggers of its queue only; the agent's bindings get every
/// trigger and the reports. Publications are confirmed by the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triggers_are_routed_by_queue_and_reports_reach_the_agent() {
    if !crate::support::stack_running() {
        return;
    }
    let exchange = format!("test.fleet.{}", uuid::Uuid::now_v7().simple());
    let stop = CancellationToken::new();
    let work = spawn_subscription(amqp_url(), exchange.clone(), vec![work_key("billing-work")], Default::default(), stop.clone());
    let results =
        spawn_subscription(amqp_url(), exchange.clone(), vec![work_key("billing-results"), work_key("billing-work-dlq")], Default::default(), stop.clone());
    let agent = spawn_subscription(amqp_url(), exchange.clone(), vec![ALL_WORK.into(), ALL_REPORTS.into()], Default::default(), stop.clone());
    let (mut w, mut r, mut a, mut ar) = (work.events.subscribe(), results.events.subscribe(), agent.events.subscribe(), agent.reports.subscribe());
    let mut wr = work.reports.subscribe();
    for s in [&work, &results, &agent] {
        live(s).await;
    }
    let bus = RabbitTriggers::new(&amqp_url(), &exchange, Default::default());
    let ev = |q: &str| WorkDetected { queue: q.into(), messages: 3, source: "test".into() };
    bus.publish(&ev("billing-work")).await.expect("confirmed publication");
    bus.publish(&ev("billing-results")).await.unwrap();
    bus.publish(&ev("billing-work.fifo")).await.unwrap();
    let report = InstanceReport {
        instance: "p-1".into(),
        queue: "billing-work".into(),
        processed: 7,
        rate: 3.5,
        in_hand: 2,
        consumers: 1,
        saturated: false,
        leaving: false,
        paused_for: Vec::new(),
    };
    bus.report(&report).await.unwrap();
    let got_w = tokio::time::timeout(Duration::from_secs(5), w.recv()).await.expect("delivered").unwrap();
    assert_eq!(got_w, ev("billing-work"));
    let got_r = tokio::time::timeout(Duration::from_secs(5), r.recv()).await.expect("delivered").unwrap();
    assert_eq!(got_r, ev("billing-results"));
    let mut all = Vec::new();
    for _ in 0..3 {
        all.push(tokio::time::timeout(Duration::from_secs(5), a.recv()).await.expect("delivered").unwrap().queue);
    }
    assert_eq!(all, ["billing-work", "billing-results", "billing-work.fifo"]);
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), ar.recv()).await.expect("delivered").unwrap(), report);
    // Nothing else arrives where it was not bound (a later publication is the fence).
    bus.publish(&ev("billing-work")).await.unwrap();
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), w.recv()).await.expect("delivered").unwrap(), ev("billing-work"));
    assert!(w.try_recv().is_err(), "the work listener got another queue's trigger");
    assert!(r.try_recv().is_err(), "the results listener got another queue's trigger");
    assert!(wr.try_recv().is_err(), "reports go to the agent's binding only");
    stop.cancel();
}

#[tokio::test]
async fn unreachable_broker_is_an_error_not_a_hang() {
    if !crate::support::stack_running() {
        return;
    }
    let bus = RabbitTriggers::new("amqp://guest:guest@127.0.0.1:9/%2f", "x", Default::default());
    let ev = WorkDetected { queue: "q".into(), messages: 1, source: "test".into() };
    let err = tokio::time::timeout(Duration::from_secs(10), bus.publish(&ev)).await.expect("fails fast").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("RabbitMQ") && msg.contains("127.0.0.1:9") && !msg.contains("guest:guest"), "{msg}");
    // Within the reconnect back-off the next publication fails at once, without a connection attempt.
    let t = std::time::Instant::now();
    let err = bus.publish(&ev).await.unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_millis(50) && err.contains("next attempt"), "{err} after {:?}", t.elapsed());
    tokio::time::sleep(Duration::from_millis(250)).await;
    let err = bus.publish(&ev).await.unwrap_err().to_string();
    assert!(!err.contains("next attempt"), "after the back-off it tries again: {err}");
}
