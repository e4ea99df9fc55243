//! RabbitMQ unreachable: listeners do not park (nothing could wake them) but poll at their back-off cap, a
//! job submitted meanwhile completes with exact totals, and once the broker is back they park again.
//! The broker is cut by a TCP proxy between the fleet and the RabbitMQ that deploy/test.sh starts
//! (existing connections dropped, new ones refused), so the host's broker is left alone.

use crate::support::Fleet as _;
use std::time::{Duration, Instant};

use crate::support::proxy::Proxy;

use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;
use fleet_io::trigger::work_key;
use tokio_util::sync::CancellationToken;

fn amqp_via(proxy: &Proxy) -> String {
    format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port)
}

async fn until(timeout: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_broker_down_listeners_poll_and_the_job_completes() {
    if !crate::support::stack_running() {
        return;
    }
    let Some(mut s) = crate::support::stack(QueueSettings::default()).await else { return };
    let proxy = Proxy::start(0, "127.0.0.1:5672").await;
    s.names.amqp_url = amqp_via(&proxy);
    let stop = CancellationToken::new();
    let deps = processor::Deps {
        work: s.work.clone(),
        work_dlq: Some(s.work_dlq.clone()),
        results: s.results.clone(),
        store: s.store.clone(),
        triggers: s.names.subscribe(vec![work_key(s.work.name())], &stop),
        publish: s.names.trigger_bus(),
        signing_key: Some(crate::support::role_keys().key(fleet_io::auth::Role::Processor)),
    };
    let engine = processor::start(&crate::support::fast_processor(), deps, &stop).await.unwrap().remove(0);
    let controller = s.start_controller();
    assert!(until(Duration::from_secs(15), async || engine.triggers_live() && engine.state().consumers_parked == 1).await, "parked while the bus is up");

    proxy.cut();
    assert!(until(Duration::from_secs(5), async || !engine.triggers_live()).await, "the listener noticed the broker is gone");
    let cut_at = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "during-outage.csv", 50_000, 300, 4)];
    let job = s.submit(&files, 5_000).await;
    // Sample the listener while the job runs: never parked.
    let sampling = {
        let engine = engine.clone();
        tokio::spawn(async move {
            let mut parked = 0;
            for _ in 0..100 {
                parked += engine.state().consumers_parked;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            parked
        })
    };
    let report = s.wait_report(&job, Duration::from_secs(60)).await;
    let took = cut_at.elapsed();
    crate::support::assert_consistent(&report);
    assert_eq!(crate::support::report_accounts(&report), crate::support::expected_accounts(&files), "exact totals with the broker down");
    assert_eq!(sampling.await.unwrap(), 0, "a listener parked while no trigger could reach it");
    let receives_idle = {
        let a = engine.stats().receives.load(std::sync::atomic::Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(5)).await;
        engine.stats().receives.load(std::sync::atomic::Ordering::Relaxed) - a
    };
    assert!(receives_idle >= 2, "still polling while the broker is down: {receives_idle} receives in 5 s");

    // The broker is back (same port): subscribed again, parked again, no requests.
    let _proxy = Proxy::start(proxy.port, "127.0.0.1:5672").await;
    assert!(
        // The subscription's reconnect back-off (up to 30 s), then the grace for publishers to reconnect (30 s).
        until(Duration::from_secs(90), async || engine.triggers_live() && engine.state().consumers_parked == 1).await,
        "parked again once the broker was back"
    );
    let n = engine.stats().receives.load(std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(engine.stats().receives.load(std::sync::atomic::Ordering::Relaxed), n, "zero requests once parked again");
    eprintln!("job with the broker down: report {:.1} s after the cut; {receives_idle} receives per 5 s idle meanwhile", took.as_secs_f64());
    stop.cancel();
    engine.shutdown(Duration::from_secs(5)).await;
    controller.stop().await;
}
