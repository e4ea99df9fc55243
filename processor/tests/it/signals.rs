//! The processor binary on SIGTERM: it stops receiving, lets its long poll end (SQS would still hand
//! messages to a poll cut on the client side, to come back only after their visibility timeout), returns
//! what that poll brings at once, drains and exits 0 within the grace period. Needs the LocalStack that
//! deploy/test.sh starts.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fleet_io::config::{Aws, FleetArgs};
use fleet_io::provision::{ensure_fleet, QueueSettings};
use fleet_io::queue::Queue;

#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    if !fleet_test_support::stack_running() {
        return;
    }
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
    let work = aws.queue(&names.work_queue).await.unwrap();
    let mut child = cmd.spawn().unwrap();
    // Its log, line by line, as it comes.
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut log = String::new();
    let mut wait_for = async |what: &str, log: &mut String| {
        let t = Instant::now();
        while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(60).saturating_sub(t.elapsed()), lines.recv()).await {
            log.push_str(&line);
            log.push('\n');
            if line.contains(what) {
                return;
            }
        }
        panic!("no {what:?} in the processor's log:\n{log}");
    };
    // Started: its consumer waits in a 20 s long poll (consumers are spawned before this line).
    wait_for("listener started", &mut log).await;
    let sent = Instant::now();
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    // A work item arriving during the stop goes to the poll still under way.
    wait_for("SIGTERM", &mut log).await;
    work.send(vec!["arrived during the stop".into()]).await.unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait()).await.unwrap().unwrap();
    let took = sent.elapsed();
    while let Some(line) = lines.recv().await {
        log.push_str(&line);
        log.push('\n');
    }
    assert_eq!(status.code(), Some(0), "{log}");
    // Less than two long polls: the stop waits for the one under way only.
    assert!(took < Duration::from_secs(35), "the stop outlasted the long poll: {took:?}");
    assert!(log.contains("SIGTERM") && log.contains("processor stopped"), "{log}");
    assert!(log.contains("returning what the last poll brought"), "the poll under way did not get the message:\n{log}");
    // Visible again at once, not after the 30 s visibility timeout.
    let back = work.receive(10, Duration::from_secs(2)).await.unwrap();
    assert_eq!(back.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), ["arrived during the stop"], "{log}");
    assert!(back[0].receive_count >= 2, "it had been received by the stopping processor");
}
