//! The IAM policies in `deploy/k8s/iam/` against what the services really call: a job through the four
//! real binaries (initiator `submit --wait`, processor, controller, scaling agent) on LocalStack, each
//! writing the operations it called (`FLEET_CALLS_FILE`). A service that calls an action its policy
//! does not allow fails the test (it would fail on AWS: LocalStack does not enforce IAM), and so does a
//! policy that allows an action its service never calls, unless it is listed here as a rare path with
//! the reason.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::*;
use fleet_io::provision::QueueSettings;

/// Allowed, but not called by a small job, and why.
const RARE: &[(&str, &str, &str)] = &[
    ("processor", "sqs:ChangeMessageVisibility", "the heartbeat extends work items held past half the visibility timeout; a failed item's back-off"),
    ("processor", "s3:PutObject", "results too large for a message go to S3 as a blob"),
    ("processor", "s3:ListBucket", "HeadBucket, the S3 breaker's probe during an outage"),
    ("controller", "sqs:ChangeMessageVisibility", "results held through a store outage, or handed back to another controller's job"),
    ("controller", "sqs:SendMessage", "a dead-lettered work item forwarded to its job's results partition"),
];

/// The IAM action an SDK operation needs.
fn action(op: &str) -> Option<&'static str> {
    Some(match op {
        "sqs.ReceiveMessage" => "sqs:ReceiveMessage",
        "sqs.SendMessageBatch" => "sqs:SendMessage",
        "sqs.DeleteMessageBatch" => "sqs:DeleteMessage",
        "sqs.ChangeMessageVisibilityBatch" => "sqs:ChangeMessageVisibility",
        "sqs.GetQueueAttributes" => "sqs:GetQueueAttributes",
        "sqs.GetQueueUrl" => "sqs:GetQueueUrl",
        "s3.GetObject" | "s3.HeadObject" => "s3:GetObject",
        "s3.PutObject" => "s3:PutObject",
        "s3.DeleteObject" => "s3:DeleteObject",
        "s3.ListObjectsV2" | "s3.HeadBucket" => "s3:ListBucket",
        o if o.starts_with("amqp.") => return None,
        o => panic!("no IAM action known for {o}: add it to the map (and to the policies)"),
    })
}

fn allowed(service: &str) -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../k8s/iam/{service}.json"));
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap();
    assert_eq!(doc["Version"], "2012-10-17");
    let mut out = BTreeSet::new();
    for st in doc["Statement"].as_array().unwrap() {
        assert_eq!(st["Effect"], "Allow", "{service}: only Allow statements");
        let list = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) => a.iter().map(|x| x.as_str().unwrap().to_string()).collect(),
            other => panic!("{service}: {other}"),
        };
        for r in list(&st["Resource"]) {
            assert!(r != "*" && !r.ends_with(":*"), "{service}: a wildcard resource {r}");
        }
        for a in list(&st["Action"]) {
            assert!(!a.contains('*'), "{service}: a wildcard action {a}");
            out.insert(a);
        }
    }
    out
}

fn service(st: &Stack, bin: &str, calls: &Path, envs: &[(&str, &str)]) -> Child {
    let mut cmd = fleet_command(st, bin);
    cmd.env("FLEET_CALLS_FILE", calls)
        .env("LISTENER_RECEIVE_WAIT_SECS", "1")
        .env("LISTENER_MAX_IDLE_MS", "1000")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .envs(envs.iter().copied());
    cmd.spawn().unwrap_or_else(|e| panic!("start {bin}: {e}"))
}

fn stop(mut c: Child) {
    let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
    let t = std::time::Instant::now();
    while c.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(40), "did not stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_calls_only_what_its_policy_allows() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let calls = |s: &str| dir.path().join(format!("{s}.calls"));
    let processor = service(&st, "processor", &calls("processor"), &[]);
    let controller = service(&st, "controller", &calls("controller"), &[("CONTROLLER_ID", "iam-test")]);
    let agent = service(&st, "scaling-agent", &calls("scaling-agent"), &[("AGENT_BACKEND", "none"), ("AGENT_INTERVAL_SECS", "1")]);
    let file = generated(dir.path(), "in.csv", 3000, 40, 5);
    let mut cmd = fleet_command(&st, "initiator");
    cmd.args(["submit", file.to_str().unwrap(), "--chunk-size", "500", "--wait", "--json"]).env("FLEET_CALLS_FILE", calls("initiator"));
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    assert!(out.status.success(), "initiator: {}", String::from_utf8_lossy(&out.stderr));
    // Past the controller's purge of the finished job's blobs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for c in [processor, controller, agent] {
        stop(c);
    }
    let mut failures = Vec::new();
    for svc in ["initiator", "processor", "controller", "scaling-agent"] {
        let text = std::fs::read_to_string(calls(svc)).unwrap_or_else(|e| panic!("{svc} wrote no calls file: {e}"));
        let called: BTreeSet<String> = text.lines().filter_map(action).map(String::from).collect();
        let allowed = allowed(svc);
        println!("[iam] {svc}: calls {called:?}");
        for a in called.difference(&allowed) {
            failures.push(format!("{svc} calls {a}, which its policy does not allow"));
        }
        for a in allowed.difference(&called) {
            if !RARE.iter().any(|(s, r, _)| *s == svc && r == a) {
                failures.push(format!("{svc}'s policy allows {a}, which it never called (least privilege: remove it, or list it as a rare path)"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
