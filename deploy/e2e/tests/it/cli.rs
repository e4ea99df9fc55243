//! The `initiator` binary as a user runs it: exit codes, refusals that enqueue nothing, `--wait --json`,
//! `status` and `report`, and an unreachable stack.

use crate::support::Fleet as _;
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::*;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;

fn initiator(st: &Stack, args: &[&str]) -> Output {
    initiator_env(st, args, &[])
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submit_wait_json_status_report_and_refusals() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
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
    // --groups 0 is refused by name (a usage error: exit 1, not clap's 2, which means partial here).
    let out = initiator(&st, &["submit", "--group-by", "account", "--groups", "0", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("'0' for '--groups"), "{}", text(&out.stderr));
    // --groups without --group-by is a usage error: exit 1.
    let out = initiator(&st, &["submit", "--groups", "4", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--group-by"), "{}", text(&out.stderr));
    let d = st.work.depth().await.unwrap();
    assert_eq!((d.visible, d.in_flight), (0, 0), "nothing enqueued by refused submissions");
    // --wait that gives up: exit 4, the job named and said to go on (no controller runs yet; it
    // completes once one does). Rows of its own: the same ids in two jobs are billed once.
    let late = write(dir.path(), "late.csv", "txn_id,account_id,amount,currency,timestamp\nlate1,a,1.00,EUR,2026-11-21T10:00:00Z\n");
    let out = initiator(&st, &["submit", late.to_str().unwrap(), "--wait", "--wait-timeout-secs", "1"]);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("not finished after 1 s; it goes on: follow it with `initiator wait"), "{err}");
    let timed_out = err.split("job ").filter_map(|s| s.split_once(" not finished")).map(|(id, _)| id.to_string()).next().expect("the job named");

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

    // The progress travels as the checkpoint's metadata: a follower reads it with HEAD.
    let meta = fleet_io::blob::BlobStore::head(st.store.as_ref(), &fleet_domain::layout::checkpoint_key(&job)).await.unwrap().expect("checkpoint");
    let progress = fleet_domain::model::Progress::from_meta(&meta).unwrap_or_else(|| panic!("no progress in the checkpoint's metadata: {meta:?}"));
    assert_eq!((progress.status, progress.accounted, progress.failed, progress.processed), (fleet_domain::model::JobStatus::Complete, 6, 0, 4_001));
    // The job whose --wait gave up is followed again to its end: the same exit code and report.
    let out = initiator(&st, &["wait", &timed_out, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let again: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report JSON on stdout");
    assert_eq!((again["job_id"].as_str(), again["status"].as_str()), (Some(timed_out.as_str()), Some("complete")));
    let out = initiator(&st, &["wait", "no-such-job"]);
    assert_eq!(out.status.code(), Some(1), "an unknown job is said, not waited for: {}", text(&out.stderr));
    // Both are listed among today's finished jobs (from the warehouse's jobs table), the newest first.
    let out = initiator(&st, &["jobs", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).expect("jobs JSON on stdout");
    let finished: Vec<&str> = listed["finished"].as_array().unwrap().iter().filter_map(|j| j["job_id"].as_str()).collect();
    let (at_job, at_timed_out) = (finished.iter().position(|j| *j == job), finished.iter().position(|j| *j == timed_out));
    assert!(at_job.is_some() && at_timed_out.is_some() && at_job < at_timed_out, "both finished, newest first: {listed}");
    assert!(listed["finished"].as_array().unwrap().iter().all(|j| j["status"] == "complete"), "{listed}");
    let out = initiator(&st, &["jobs"]);
    assert!(text(&out.stdout).contains(&job) && text(&out.stdout).contains(" finished ("), "{}", text(&out.stdout));
    let out = initiator(&st, &["status", &job]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("complete, 6/6 chunks"), "{}", text(&out.stdout));
    let out = initiator(&st, &["report", &job]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("4001 processed"), "{}", text(&out.stdout));
    let out = initiator(&st, &["report", "no-such-job"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no job no-such-job"), "{}", text(&out.stderr));

    // `-`: standard input, named by --stdin-name. A file there: its size chooses the chunk size as
    // the file's own name would (4,000 rows: the smallest chunks, one chunk).
    let mut cmd = fleet_command(&st, "initiator");
    // (Files of their own: rows a job billed are not billed again.)
    let one_bad_row =
        write(dir.path(), "onebad2.csv", "txn_id,account_id,amount,currency,timestamp\nu1,a,1.00,EUR,2026-11-21T10:00:00Z\nu2,a,0,EUR,2026-11-21T10:00:00Z\n");
    let good = generated(dir.path(), "good2.csv", 4_000, 25, 10);
    cmd.args(["submit", "-", "--stdin-name", "day.csv", "--wait", "--json"]).stdin(std::fs::File::open(&one_bad_row).unwrap());
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report JSON on stdout");
    assert_eq!((report["transactions"]["processed"].as_u64(), report["files"].clone()), (Some(1), serde_json::json!(["day.csv"])));
    assert_eq!((report["rejected"][0]["file"].as_str(), report["rejected"][0]["line"].as_u64()), (Some("day.csv"), Some(3)));
    // A pipe (no size): the rows as a file's; a header missing a column refused under the name given.
    let mut cmd = fleet_command(&st, "initiator");
    let mut child = cmd
        .args(["submit", "-", "--wait", "--json"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, &std::fs::read(&good).unwrap()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let piped: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report JSON on stdout");
    assert_eq!(piped["transactions"]["processed"], 4_000);
    assert_eq!(piped["files"], serde_json::json!(["stdin"]));
    let mut cmd = fleet_command(&st, "initiator");
    cmd.args(["submit", "-", "--stdin-name", "upload.csv"]).stdin(std::fs::File::open(&bad_header).unwrap());
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("upload.csv: missing required column \"currency\""), "{}", text(&out.stderr));
    p.stop().await;
    c.stop().await;
}

/// The initiator with a clean AWS environment (no profile files, no AWS_* variables) plus `env`,
/// timed.
fn bare(args: &[&str], env: &[(&str, &str)]) -> (Output, Duration) {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(crate::support::bin("initiator"));
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    cmd.args(args).env("HOME", home.path()).env("AMQP_URL", "").envs(env.iter().copied());
    let t = std::time::Instant::now();
    let out = cmd.output().unwrap();
    (out, t.elapsed())
}

const LOCAL_TEST_ENV: [(&str, &str); 4] =
    [("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")];

/// Unreachable: exit 3 within the 2 s the first call is given (not the call deadline's retries), in
/// one line naming the service and endpoint, the cause and what to set; no SDK dump, no credentials.
#[test]
fn unreachable_stack_exits_3_at_once_in_one_line_naming_what_to_set() {
    if !crate::support::stack_running() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "in.csv", "txn_id,account_id,amount,currency,timestamp\nt1,a,1.00,EUR,2026-11-21T10:00:00Z\n");
    for args in [vec!["submit", f.to_str().unwrap()], vec!["status", "job-1"], vec!["dlq", "list"]] {
        let (out, took) = bare(&args, &LOCAL_TEST_ENV);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(took < Duration::from_millis(3_500), "{args:?} took {took:?}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.contains("cannot reach") && err.contains("at http://127.0.0.1:9") && err.contains("refused"), "{args:?}: {err}");
        assert!(err.contains("Set AWS_ENDPOINT_URL to where it answers"), "{err}");
        assert!(!err.contains("DispatchFailure") && !err.contains("dispatch failure"), "no SDK dump: {err}");
        assert!(!err.contains("test"), "no credentials in messages: {err}");
    }
}

/// Everything local is checked first: a missing file, a bad flag, a bad tariff, a bad job id exit 1
/// at once with the stack unreachable (nothing contacted: no "cannot reach"); help exits 0.
#[test]
fn local_mistakes_exit_1_before_anything_is_contacted() {
    if !crate::support::stack_running() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "in.csv", "txn_id,account_id,amount,currency,timestamp\nt1,a,1.00,EUR,2026-11-21T10:00:00Z\n");
    let tariff = write(dir.path(), "tariff.json", "{ not json");
    let missing = dir.path().join("missing.csv");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["submit", missing.to_str().unwrap()], "missing.csv"),
        (vec!["submit", f.to_str().unwrap(), "--no-such-flag"], "--no-such-flag"),
        (vec!["submit", f.to_str().unwrap(), "--chunk-size", "0"], "--chunk-size"),
        (vec!["submit", f.to_str().unwrap(), "--tariff", tariff.to_str().unwrap()], "tariff.json"),
        (vec!["submit", "--group-by", "account", f.to_str().unwrap()], "needs a FIFO work queue"),
        (vec!["submit", "-", "-"], "- (standard input) can be given once"),
        (vec!["status", "../etc"], "job"),
        (vec![], "Usage"),
    ];
    for (args, says) in cases {
        let (out, took) = bare(&args, &LOCAL_TEST_ENV);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?} should name {says:?}: {err}");
        assert!(!err.contains("cannot reach"), "{args:?} contacted the stack: {err}");
        assert!(took < Duration::from_secs(1), "{args:?} took {took:?}");
    }
    let (out, _) = bare(&["--help"], &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("Exit codes: 0 complete"), "{}", text(&out.stdout));
}

/// No credentials or no region anywhere: exit 3 in one line that says what to set, without the SDK's
/// screens of instance-metadata warnings.
#[test]
fn missing_credentials_or_region_are_said_in_one_line() {
    if !crate::support::stack_running() {
        return;
    }
    let (out, took) = bare(&["status", "job-1"], &[("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_REGION", "us-east-1")]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"), "{err}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let (out, _) = bare(&["status", "job-1"], &[("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y")]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("no AWS region: set AWS_REGION"), "{err}");
}

/// Shell completions and the man page come from the same definitions as the parser.
#[test]
fn completions_and_man_page() {
    if !crate::support::stack_running() {
        return;
    }
    let (out, _) = bare(&["completions", "bash"], &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("initiator") && text(&out.stdout).contains("--wait-timeout-secs"), "bash completion");
    let (out, _) = bare(&["man"], &[]);
    assert_eq!(out.status.code(), Some(0));
    let man = text(&out.stdout);
    assert!(man.starts_with(".ie") || man.contains(".TH initiator"), "roff: {}", &man[..man.len().min(200)]);
    // A page per command: one on stdout, or all into a directory.
    let (out, _) = bare(&["man", "dlq", "redrive"], &[]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains(".TH initiator-dlq-redrive") && text(&out.stdout).contains("\\-\\-limit"), "{}", text(&out.stdout));
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = bare(&["man", "--out-dir", dir.path().to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for page in ["initiator.1", "initiator-submit.1", "initiator-wait.1", "initiator-jobs.1", "initiator-warehouse-backfill.1"] {
        assert!(dir.path().join(page).is_file(), "{page} written");
    }
    let (out, _) = bare(&["man", "nope"], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("no command `nope`"), "{}", text(&out.stderr));
}

#[test]
fn generate_is_deterministic() {
    if !crate::support::stack_running() {
        return;
    }
    let run =
        |seed: &str| Command::new(crate::support::bin("initiator")).args(["generate", "--rows", "100", "--accounts", "5", "--seed", seed]).output().unwrap();
    let (a, b, c) = (run("1"), run("1"), run("2"));
    assert_eq!(a.stdout, b.stdout);
    assert_ne!(a.stdout, c.stdout);
    assert_eq!(text(&a.stdout).lines().count(), 101);
    let _ = Duration::ZERO;
}

fn initiator_env(st: &Stack, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = fleet_command(st, "initiator");
    cmd.args(args).envs(env.iter().copied());
    cmd.output().expect("run initiator")
}

async fn until(timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f().await {
        assert!(t.elapsed() < timeout, "condition not met within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `initiator abandon` on a job whose submission died (results, no seal), unreadable messages on the
/// results queue and the work dead-letter queue quarantined (not hidden), and `initiator dlq list |
/// show | redrive` over both dead-letter queues and the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abandon_quarantine_and_dlq_commands() {
    if !crate::support::stack_running() {
        return;
    }
    use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, ResultMessage};
    use fleet_io::blob::BlobStore;
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let c = st.start_controller();
    let job = format!("unsealed-{}", &st.names.bucket[st.names.bucket.len() - 12..]);
    let acct = |a: &str, n: u64| fleet_domain::billing::AccountTotals {
        account_id: a.into(),
        currency: "EUR".into(),
        count: n,
        gross: rust_decimal::Decimal::new(100 * n as i64, 2),
        fees: rust_decimal::Decimal::new(n as i64, 2),
    };
    let result = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: job.clone(),
        chunk: 3,
        transactions: 5,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![acct("a", 2), acct("b", 3)] } },
        requests: Default::default(),
    });
    // Its chunk blob, as the initiator writes it before the work item (a result for a chunk without
    // one waits for the job's seal; the finish reads it again to claim its rows).
    let rows: String = (0..5).map(|i| format!("{job}-{i},{},1.00,EUR,2026-11-21T10:00:00Z\n", if i < 2 { "a" } else { "b" })).collect();
    let chunk = zstd::bulk::compress(format!("txn_id,account_id,amount,currency,timestamp\n{rows}").as_bytes(), 1).unwrap();
    st.store.put(&fleet_domain::layout::chunk_key(&job, 3), bytes::Bytes::from(chunk), "application/zstd").await.unwrap();
    // As a processor sends it: signed with its key, with the chunk's token its work item brought.
    let keys = crate::support::role_keys();
    let body = serde_json::to_string(&result).unwrap();
    let attrs = fleet_io::queue::Attrs {
        auth: Some(keys.key(fleet_io::auth::Role::Processor).sign(&body)),
        chunk_token: Some(keys.key(fleet_io::auth::Role::Submitter).chunk_token(&job, 3)),
        ..Default::default()
    };
    st.results.send_messages(&[fleet_io::queue::Outgoing { body, attrs, dedup: None }]).await.unwrap();
    until(Duration::from_secs(30), async || initiator::follow::progress(st.store.as_ref(), &job).await.is_ok_and(|p| p.accounted_chunks == 1)).await;
    let out = initiator(&st, &["abandon", &job, "--reason", "the submitting host died", "--json"]);
    assert_eq!(out.status.code(), Some(2), "abandoned is not complete: {}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["status"], "abandoned");
    assert_eq!(r["transactions"]["processed"], 5);
    assert!(r["note"].as_str().unwrap().contains("the submitting host died"), "{r}");
    let out = initiator(&st, &["abandon", "no-such-job"]);
    assert_eq!(out.status.code(), Some(1), "an unknown job is refused: {}", text(&out.stderr));

    // Garbage on the results queue and on the work dead-letter queue: quarantined, then deleted.
    st.results.send(vec!["garbage on results".into()]).await.unwrap();
    st.work_dlq.send(vec!["{\"v\":1,\"job_id\":\"x\"}".into()]).await.unwrap();
    until(Duration::from_secs(30), async || st.store.list("quarantine/", 10).await.unwrap().len() == 2).await;
    st.wait_depth(st.results.as_ref(), 0, Duration::from_secs(20)).await;
    st.wait_depth(st.work_dlq.as_ref(), 0, Duration::from_secs(20)).await;
    c.stop().await;

    // With the controller stopped, a dead letter waits in the results dead-letter queue.
    let sealed = serde_json::to_string(&ResultMessage::Sealed { v: 1, job_id: "stranded-job".into(), total_chunks: 1 }).unwrap();
    st.results_dlq.send(vec![sealed.clone()]).await.unwrap();
    let out = initiator(&st, &["dlq", "list", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entries = list.as_array().unwrap();
    assert_eq!(entries.len(), 3, "{list:#}");
    let stranded = entries.iter().find(|e| e["place"] == st.results_dlq.name()).expect("the results dead letter is listed");
    assert_eq!(stranded["job_id"], "stranded-job");
    let quarantined: Vec<&serde_json::Value> = entries.iter().filter(|e| e["place"] == "quarantine").collect();
    assert_eq!(quarantined.len(), 2);
    assert!(quarantined.iter().any(|e| e["reason"].as_str().unwrap().contains(&format!("from {}", st.results.name()))), "{list:#}");
    assert!(quarantined.iter().any(|e| e["job_id"] == "x" && e["reason"].as_str().unwrap().contains(&format!("from {}", st.work_dlq.name()))), "{list:#}");
    // Looking did not take anything.
    assert_eq!(st.results_dlq.depth().await.unwrap().visible + st.results_dlq.depth().await.unwrap().in_flight, 1);
    let key = quarantined.iter().find(|e| e["job_id"] == "x").unwrap()["id"].as_str().unwrap().to_string();
    let out = initiator(&st, &["dlq", "show", &key]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("\\\"job_id\\\":\\\"x\\\""), "{}", text(&out.stdout));
    let out = initiator(&st, &["dlq", "show", stranded["id"].as_str().unwrap()]);
    assert!(text(&out.stdout).contains("stranded-job"), "{}", text(&out.stdout));

    // Redrive: the results dead letter back to the results queue; the quarantined messages back to
    // the queues that read them (the work dead letter's to the work queue).
    let out = initiator(&st, &["dlq", "redrive"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("2 quarantined messages sent back"), "{}", text(&out.stderr));
    st.wait_depth(st.results_dlq.as_ref(), 0, Duration::from_secs(10)).await;
    st.wait_depth(st.results.as_ref(), 2, Duration::from_secs(10)).await;
    st.wait_depth(st.work.as_ref(), 1, Duration::from_secs(10)).await;
    assert!(st.store.list("quarantine/", 10).await.unwrap().is_empty());
    let bodies: Vec<String> = st.results.receive(10, Duration::from_secs(1)).await.unwrap().into_iter().map(|m| m.into_parts().0.body).collect();
    assert!(bodies.contains(&sealed) && bodies.contains(&"garbage on results".to_string()), "{bodies:?}");
}

/// A job whose checkpoint is corrupt on S3: the controller quarantines it at its first message
/// (report `quarantined`, the corrupt document kept aside, the message in the quarantine, nothing in
/// the results dead-letter queue), and `initiator abandon` on it prints that report instead of
/// hanging or failing on the corrupt document.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_checkpoint_is_corrupt_is_quarantined_and_abandon_reports_it() {
    if !crate::support::stack_running() {
        return;
    }
    use fleet_domain::layout::{checkpoint_key, manifest_key, quarantined_checkpoint_key};
    use fleet_io::blob::BlobStore;
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let c = st.start_controller();
    let job = format!("corrupt-{}", &st.names.bucket[st.names.bucket.len() - 12..]);
    let manifest = serde_json::json!({
        "v": 1, "job_id": job, "created_at": "2026-11-24T00:00:00Z", "files": ["in.csv"], "submitted": 4, "accepted": 4, "rejected": [],
        "total_chunks": 2, "chunk_transactions": [2, 2], "tariff": fleet_domain::billing::Tariff::default(), "requests": {}
    });
    st.store.put(&manifest_key(&job), bytes::Bytes::from(manifest.to_string()), "application/json").await.unwrap();
    st.store.put(&checkpoint_key(&job), bytes::Bytes::from_static(b"\x28\xb5\x2f\xfd not a checkpoint"), "application/zstd").await.unwrap();
    let result = serde_json::json!({"kind": "chunk", "v": 1, "job_id": job, "chunk": 0, "transactions": 0,
        "outcome": {"outcome": "failed", "reason": "x"}, "requests": {}});
    st.results.send(vec![result.to_string()]).await.unwrap();
    let out = initiator(&st, &["abandon", &job, "--reason", "operator", "--json"]);
    assert_eq!(out.status.code(), Some(2), "not complete: {}", text(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the report");
    assert_eq!(r["status"], "quarantined", "{r}");
    assert!(r["note"].as_str().unwrap().contains("checkpoint cannot be read"), "{r}");
    assert_eq!(r["transactions"]["accepted"], 4, "what the manifest says is kept: {r}");
    assert!(st.store.get(&quarantined_checkpoint_key(&job)).await.unwrap().is_some(), "the corrupt checkpoint is kept aside");
    // The result (and the abandon, when it came after the quarantine) are kept in the quarantine.
    until(Duration::from_secs(30), async || {
        let mut n = 0;
        for key in fleet_io::quarantine::list(st.store.as_ref(), 100).await.unwrap() {
            n += usize::from(fleet_io::quarantine::read(st.store.as_ref(), &key).await.unwrap().is_some_and(|q| q.body.contains(&job)));
        }
        n >= 1
    })
    .await;
    st.wait_depth(st.results.as_ref(), 0, Duration::from_secs(20)).await;
    let dead = st.results_dlq.depth().await.unwrap();
    assert_eq!(dead.visible + dead.in_flight, 0, "nothing cycles into the results dead-letter queue");
    c.stop().await;
}

/// The AMQP password never shows: not in `--help` (which shows env values), not in logs at debug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_help_and_logs() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let secret_url = "amqp://fleet:pw-s3cret-42@127.0.0.1:9/%2f";
    for args in [&["--help"][..], &["submit", "--help"], &["dlq", "list", "--help"]] {
        let out = initiator_env(&st, args, &[("AMQP_URL", secret_url)]);
        assert_eq!(out.status.code(), Some(0));
        assert!(!text(&out.stdout).contains("pw-s3cret-42"), "{args:?}: {}", text(&out.stdout));
        assert!(text(&out.stdout).contains("AMQP_URL"), "the flag is documented");
    }
    // A submission whose trigger cannot be published (the broker URL is dead) logs the failure,
    // redacted.
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "small.csv", 100, 5, 3);
    let out = initiator_env(&st, &["submit", f.to_str().unwrap()], &[("AMQP_URL", secret_url), ("RUST_LOG", "debug")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("fleet:***@127.0.0.1:9"), "the failure is logged: {err}");
    assert!(!err.contains("pw-s3cret-42"), "{err}");
}

/// `initiator provision` creates what a fleet needs on the real stack (queues with dead-letter queues
/// and redrive as asked, the bucket with its lifecycle rules), again without harm, and refuses a
/// redrive that would dead-letter every message at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provision_creates_queues_with_redrive_and_the_bucket_idempotently() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    // Fresh names, apart from the stack's own (which its set-up already made).
    let tag = &uuid::Uuid::now_v7().simple().to_string()[20..];
    let (work, results, bucket) = (format!("prov-work-{tag}"), format!("prov-results-{tag}"), format!("prov-bucket-{tag}"));
    let provision = |args: &[&str]| {
        let mut cmd = fleet_command(&st, "initiator");
        cmd.arg("provision").args(args).env("FLEET_WORK_QUEUE", &work).env("FLEET_RESULTS_QUEUE", &results).env("FLEET_BUCKET", &bucket);
        cmd.env_remove("FLEET_WORK_DLQ").output().expect("run initiator")
    };
    let out = provision(&["--max-receive-count", "0"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--max-receive-count must be at least 1"), "{}", text(&out.stderr));
    for round in 0..2 {
        let out = provision(&["--max-receive-count", "3", "--visibility-timeout", "45"]);
        assert_eq!(out.status.code(), Some(0), "round {round}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains(&format!("bucket {bucket}")), "{}", text(&out.stderr));
    }
    let sqs = st.aws.sqs();
    for (queue, dlq) in [(&work, format!("{work}-dlq")), (&results, format!("{results}-dlq"))] {
        let url = sqs.get_queue_url().queue_name(queue).send().await.unwrap_or_else(|e| panic!("{queue}: {e:?}")).queue_url.unwrap();
        let attrs = sqs.get_queue_attributes().queue_url(&url).attribute_names("All".into()).send().await.unwrap().attributes.unwrap();
        let attr = |name: &str| attrs.iter().find(|(k, _)| k.as_str() == name).map(|(_, v)| v.as_str());
        assert_eq!(attr("VisibilityTimeout"), Some("45"), "{queue}");
        let redrive: serde_json::Value = serde_json::from_str(attr("RedrivePolicy").expect("no redrive policy")).unwrap();
        assert_eq!(redrive["maxReceiveCount"].to_string().trim_matches('"'), "3", "{queue}: {redrive}");
        assert!(redrive["deadLetterTargetArn"].as_str().unwrap().ends_with(&format!(":{dlq}")), "{queue}: {redrive}");
    }
    let rules = st.aws.s3().get_bucket_lifecycle_configuration().bucket(&bucket).send().await.expect("no lifecycle on the bucket").rules.unwrap_or_default();
    let ids: Vec<&str> = rules.iter().filter_map(|r| r.id()).collect();
    assert!(
        ids.contains(&"expire-jobs") && ids.contains(&"expire-checkpoints") && ids.contains(&"expire-claims") && ids.contains(&"abort-incomplete-uploads"),
        "lifecycle rules {ids:?}"
    );
}

/// Dead letters made by SQS itself (received past maxReceiveCount) sent back by `initiator dlq redrive`:
/// on a standard queue with SQS's message move task (followed to its end); on a FIFO queue by copy,
/// each with a de-duplication id of its own, so a message dead-lettered seconds after its first send
/// is not dropped as that send's duplicate; a move task asked for a FIFO queue is refused (exit 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_redrive_moves_dead_letters_back_with_a_move_task_or_a_fifo_safe_copy() {
    let settings = QueueSettings { max_receive_count: 1, visibility_timeout: Duration::from_secs(1) };
    for fifo in [false, true] {
        let st = if fifo { fifo_stack(settings).await } else { stack(settings).await };
        let Some(st) = st else { return };
        let bodies: Vec<String> = (0..3).map(|i| format!("{{\"dead\":{i}}}")).collect();
        let out: Vec<fleet_io::queue::Outgoing> = bodies
            .iter()
            .map(|b| fleet_io::queue::Outgoing {
                body: b.clone(),
                attrs: fleet_io::queue::Attrs { group: fifo.then(|| "g".into()), ..Default::default() },
                dedup: None,
            })
            .collect();
        st.work.send_messages(&out).await.unwrap();
        // Received once and not deleted: SQS dead-letters each at its next receive.
        let t = std::time::Instant::now();
        while st.work_dlq.depth().await.unwrap().visible < 3 {
            assert!(t.elapsed() < Duration::from_secs(30), "SQS did not dead-letter the messages");
            let got = st.work.receive(10, Duration::from_secs(1)).await.unwrap();
            drop(got);
            tokio::time::sleep(Duration::from_millis(1100)).await;
        }
        if fifo {
            let out = initiator(&st, &["dlq", "redrive", "--from", "work-dlq", "--method", "move-task"]);
            assert_eq!(out.status.code(), Some(1), "a move task on a FIFO queue: {}", text(&out.stderr));
            assert!(text(&out.stderr).contains("de-duplication"), "{}", text(&out.stderr));
        }
        let out = initiator(&st, &["dlq", "redrive", "--from", "work-dlq", "--json"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let moved: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let method = if fifo { "copy" } else { "move-task" };
        assert_eq!((moved["work_dlq"].as_u64(), moved["method"]["work_dlq"].as_str()), (Some(3), Some(method)), "{moved}");
        if !fifo {
            assert!(text(&out.stderr).contains("move task completed, 3 of"), "the task's progress is shown: {}", text(&out.stderr));
        }
        st.wait_depth(st.work_dlq.as_ref(), 0, Duration::from_secs(10)).await;
        let mut back = Vec::new();
        let t = std::time::Instant::now();
        while back.len() < 3 && t.elapsed() < Duration::from_secs(20) {
            for m in st.work.receive(10, Duration::from_secs(1)).await.unwrap() {
                back.push(m.body.clone());
                m.delete(st.work.as_ref()).await.map_err(|(e, _)| e).unwrap();
            }
        }
        back.sort();
        assert_eq!(back, bodies, "fifo={fifo}: every dead letter is back on the work queue once");
    }
}

/// Ctrl-C during `submit` abandons the job at once: exit 130, a line that says so, and the controller
/// finishes it `abandoned` with what was billed, instead of showing it as being submitted until
/// `--abandon-after`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ctrl_c_during_submit_abandons_the_job() {
    use fleet_io::blob::BlobStore;
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let c = st.start_controller();
    let dir = tempfile::tempdir().unwrap();
    let big = generated(dir.path(), "big.csv", 300_000, 1_000, 3);
    let child = fleet_command(&st, "initiator")
        .args(["submit", big.to_str().unwrap(), "--chunk-size", "2000", "--upload-concurrency", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupted once its first chunk is stored (150 chunks, one at a time: far from done).
    until(Duration::from_secs(60), async || st.store.list(fleet_domain::layout::JOBS_PREFIX, 1).await.is_ok_and(|k| !k.is_empty())).await;
    let kill = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let job = err.split("interrupted: job ").nth(1).and_then(|s| s.split_once(" abandoned")).map(|(id, _)| id.to_string()).unwrap_or_else(|| panic!("{err}"));
    // The controller finishes it as abandoned (exit 2), the reason in its report.
    let out = initiator(&st, &["wait", &job, "--json", "--timeout-secs", "120"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("report JSON on stdout");
    assert_eq!(report["status"], "abandoned", "{report}");
    assert!(report.to_string().contains("Ctrl-C"), "the reason recorded: {report}");
    c.stop().await;
}
