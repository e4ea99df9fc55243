//! The processor binary on SIGTERM: it stops receiving (its parked long poll is cut short), drains and
//! exits 0 well within the grace period. Needs the LocalStack that deploy/test.sh starts.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shared::config::{Aws, FleetArgs};
use shared::provision::{ensure_fleet, QueueSettings};

#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    let aws = Aws::local_or_env("http://127.0.0.1:4566").await;
    let suffix = uuid::Uuid::now_v7().simple().to_string();
    let names = FleetArgs::defaults().with_suffix(&suffix[suffix.len() - 12..]);
    ensure_fleet(&aws, &names, QueueSettings::default()).await.expect("LocalStack reachable (start it with deploy/test.sh)");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_processor"));
    cmd.env("FLEET_BUCKET", &names.bucket)
        .env("FLEET_WORK_QUEUE", &names.work_queue)
        .env("FLEET_RESULTS_QUEUE", &names.results_queue)
        .env("FLEET_WORK_DLQ", names.work_dlq())
        .env("AMQP_URL", "")
        .env("LISTENER_RECEIVE_WAIT_SECS", "20")
        .stderr(Stdio::piped());
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        cmd.env("AWS_ENDPOINT_URL", "http://127.0.0.1:4566")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", "us-east-1");
    }
    let child = cmd.spawn().unwrap();
    // Let it start and park in a 20 s long poll.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = Instant::now();
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
    let took = sent.elapsed();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(took < Duration::from_secs(5), "the long poll was not cut short: {took:?}");
    assert!(log.contains("SIGTERM") && log.contains("processor stopped"), "{log}");
}
