//! The `initiator` binary as a user runs it: exit codes, refusals that enqueue nothing, `--wait --json`,
//! `status` and `report`, and an unreachable stack.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use shared::provision::QueueSettings;
use shared::queue::Queue;

fn initiator(st: &Stack, args: &[&str]) -> Output {
    let n = &st.names;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_initiator"));
    cmd.args(args)
        .env("FLEET_BUCKET", &n.bucket)
        .env("FLEET_WORK_QUEUE", &n.work_queue)
        .env("FLEET_WORK_DLQ", n.work_dlq())
        .env("FLEET_RESULTS_QUEUE", &n.results_queue)
        .env("FLEET_TRIGGER_EXCHANGE", &n.trigger_exchange)
        .env("AMQP_URL", &n.amqp_url);
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        cmd.env("AWS_ENDPOINT_URL", LOCALSTACK).env("AWS_ACCESS_KEY_ID", "test").env("AWS_SECRET_ACCESS_KEY", "test").env("AWS_REGION", "us-east-1");
    }
    cmd.output().expect("run initiator")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submit_wait_json_status_report_and_refusals() {
    let st = stack(QueueSettings::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let good = generated(dir.path(), "good.csv", 4_000, 25, 9);
    let bad_header = write(dir.path(), "nocurrency.csv", "txn_id,account_id,amount,timestamp\nt1,a,1.00,2026-11-21T10:00:00Z\n");
    let one_bad_row =
        write(dir.path(), "onebad.csv", "txn_id,account_id,amount,currency,timestamp\nt1,a,1.00,EUR,2026-11-21T10:00:00Z\nt2,a,0,EUR,2026-11-21T10:00:00Z\n");

    // A file missing a column refuses the submission: exit 1, file and column named, nothing enqueued.
    let out = initiator(&st, &["submit", good.to_str().unwrap(), bad_header.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("nocurrency.csv") && err.contains("\"currency\""), "{err}");
    // --strict with a rejected row: exit 1, the row listed, nothing enqueued.
    let out = initiator(&st, &["submit", "--strict", one_bad_row.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("onebad.csv:3: amount: is zero"), "{}", text(&out.stderr));
    // --group-by on a standard work queue: exit 1, the flag and the queue named, nothing enqueued.
    let out = initiator(&st, &["submit", "--group-by", "account", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(&format!(
            "--group-by account needs a FIFO work queue (a name ending in .fifo, e.g. --work-queue billing-work.fifo); {} is a standard queue",
            st.names.work_queue
        )),
        "{}",
        text(&out.stderr)
    );
    // --groups 0 is refused by name.
    let out = initiator(&st, &["submit", "--group-by", "account", "--groups", "0", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("'0' for '--groups"), "{}", text(&out.stderr));
    // --groups without --group-by is a usage error (clap: exit 2).
    let out = initiator(&st, &["submit", "--groups", "4", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--group-by"), "{}", text(&out.stderr));
    let d = st.work.depth().await.unwrap();
    assert_eq!((d.visible, d.in_flight), (0, 0), "nothing enqueued by refused submissions");

    let p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let out = initiator(&st, &["submit", good.to_str().unwrap(), one_bad_row.to_str().unwrap(), "--chunk-size", "700", "--wait", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report JSON on stdout");
    assert_eq!(report["status"], "complete");
    assert_eq!(report["transactions"]["submitted"], 4_002);
    assert_eq!(report["transactions"]["accepted"], 4_001);
    assert_eq!(report["transactions"]["processed"], 4_001);
    assert_eq!(report["rejected"][0]["line"], 3);
    assert!(report["totals"][0]["gross"].as_str().unwrap().split('.').nth(1).unwrap().len() == 2);
    let job = report["job_id"].as_str().unwrap().to_string();

    let out = initiator(&st, &["status", &job]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("complete, 6/6 chunks"), "{}", text(&out.stdout));
    let out = initiator(&st, &["report", &job]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("4001 processed"), "{}", text(&out.stdout));
    let out = initiator(&st, &["report", "no-such-job"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no job no-such-job"), "{}", text(&out.stderr));
    p.stop().await;
    c.stop().await;
}

#[test]
fn unreachable_stack_exits_3_naming_the_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "in.csv", "txn_id,account_id,amount,currency,timestamp\nt1,a,1.00,EUR,2026-11-21T10:00:00Z\n");
    let out = Command::new(env!("CARGO_BIN_EXE_initiator"))
        .args(["submit", f.to_str().unwrap()])
        .env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_MAX_ATTEMPTS", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("cannot reach SQS at http://127.0.0.1:9"), "{err}");
    assert!(!err.contains("test"), "no credentials in messages: {err}");
}

#[test]
fn generate_is_deterministic() {
    let run =
        |seed: &str| Command::new(env!("CARGO_BIN_EXE_initiator")).args(["generate", "--rows", "100", "--accounts", "5", "--seed", seed]).output().unwrap();
    let (a, b, c) = (run("1"), run("1"), run("2"));
    assert_eq!(a.stdout, b.stdout);
    assert_ne!(a.stdout, c.stdout);
    assert_eq!(text(&a.stdout).lines().count(), 101);
    let _ = Duration::ZERO;
}
