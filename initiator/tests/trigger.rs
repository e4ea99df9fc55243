//! Work-detected triggers over the real RabbitMQ broker: a published event reaches a subscriber, and a
//! processor parked after an empty receive is woken by it.

mod common;

use std::time::Duration;

use common::amqp_url;
use shared::trigger::{spawn_subscriber, RabbitTriggers, TriggerBus, WorkDetected};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_trigger_reaches_subscribers() {
    let exchange = format!("test.triggers.{}", uuid::Uuid::now_v7().simple());
    let stop = CancellationToken::new();
    let (tx, mut rx) = tokio::sync::broadcast::channel(8);
    let (tx2, mut rx2) = tokio::sync::broadcast::channel(8);
    spawn_subscriber(amqp_url(), exchange.clone(), tx, stop.clone());
    spawn_subscriber(amqp_url(), exchange.clone(), tx2, stop.clone());
    let bus = RabbitTriggers::new(&amqp_url(), &exchange);
    let ev = WorkDetected { queue: "billing-work".into(), messages: 3, source: "test".into() };
    // Subscriptions bind asynchronously: publish until both have seen one (fanout is not durable, so
    // one that binds later misses the earlier publications).
    let (mut a, mut b) = (None, None);
    tokio::time::timeout(Duration::from_secs(20), async {
        while a.is_none() || b.is_none() {
            bus.publish(&ev).await.expect("publish to RabbitMQ");
            let pause = tokio::time::sleep(Duration::from_millis(100));
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    r = rx.recv() => a = Some(r.unwrap()),
                    r = rx2.recv() => b = Some(r.unwrap()),
                    _ = &mut pause => break,
                }
            }
        }
    })
    .await
    .expect("trigger delivered to both subscribers within 20 s");
    assert_eq!(a, Some(ev.clone()));
    assert_eq!(b, Some(ev));
    stop.cancel();
}

#[tokio::test]
async fn unreachable_broker_is_an_error_not_a_hang() {
    let bus = RabbitTriggers::new("amqp://guest:guest@127.0.0.1:9/%2f", "x");
    let ev = WorkDetected { queue: "q".into(), messages: 1, source: "test".into() };
    let err = tokio::time::timeout(Duration::from_secs(10), bus.publish(&ev)).await.expect("fails fast").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("RabbitMQ") && msg.contains("127.0.0.1:9") && !msg.contains("guest:guest"), "{msg}");
}
