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
    let work = spawn_subscription(amqp_url(), exchange.clone(), vec![work_key("billing-work")], None, Default::default(), stop.clone());
    let results = spawn_subscription(
        amqp_url(),
        exchange.clone(),
        vec![work_key("billing-results"), work_key("billing-work-dlq")],
        None,
        Default::default(),
        stop.clone(),
    );
    let agent = spawn_subscription(amqp_url(), exchange.clone(), vec![ALL_WORK.into(), ALL_REPORTS.into()], None, Default::default(), stop.clone());
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

/// `amqps://` against the project's own broker with TLS (deploy/rabbitmq.sh: its listener on 5671 and
/// a certificate signed by a CA it made): a subscription and a confirmed publication that trust that
/// CA work; trusting the system's roots only, the connection fails on the certificate, and the error
/// does not show the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_carries_triggers_with_the_brokers_ca_and_refuses_an_unknown_certificate() {
    if !crate::support::stack_running() {
        return;
    }
    let (Ok(url), Ok(ca_file)) = (std::env::var("FLEET_AMQPS_URL"), std::env::var("FLEET_AMQPS_CA")) else {
        assert!(std::env::var_os("FLEET_REQUIRE_STACK").is_none(), "FLEET_AMQPS_URL and FLEET_AMQPS_CA are not set (deploy/test.sh sets them)");
        return;
    };
    assert!(url.starts_with("amqps://"), "{url}");
    let ca = fleet_io::trigger::AmqpCa::from_file(&ca_file).unwrap();
    let exchange = format!("test.fleet.tls.{}", uuid::Uuid::now_v7().simple());
    let stop = CancellationToken::new();
    let sub = spawn_subscription(url.clone(), exchange.clone(), vec![work_key("billing-work")], Some(ca.clone()), Default::default(), stop.clone());
    let mut events = sub.events.subscribe();
    live(&sub).await;
    let bus = RabbitTriggers::new(&url, &exchange, Default::default()).with_ca(Some(ca));
    let ev = WorkDetected { queue: "billing-work".into(), messages: 7, source: "test".into() };
    bus.publish(&ev).await.expect("a confirmed publication over TLS");
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), events.recv()).await.expect("delivered over TLS").unwrap(), ev);

    // The system's roots only: the broker's certificate is not trusted.
    let stranger = RabbitTriggers::new(&url, &exchange, Default::default());
    let err = tokio::time::timeout(Duration::from_secs(15), stranger.publish(&ev)).await.expect("fails, not hangs").unwrap_err().to_string();
    let password = url.split("://").nth(1).and_then(|r| r.split('@').next()).and_then(|ui| ui.split(':').nth(1)).unwrap_or("");
    assert!(err.to_lowercase().contains("certificate") || err.contains("UnknownIssuer"), "{err}");
    assert!(password.is_empty() || !err.contains(&format!(":{password}@")), "the error shows the password: {err}");
    stop.cancel();
}
