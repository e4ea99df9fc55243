//! The IAM policies in `deploy/k8s/iam/` evaluated against every call the real binaries make, as IAM
//! would (LocalStack does not enforce IAM: without this a policy that denies a needed call fails only on
//! AWS).
//!
//! Jobs run through the four binaries (initiator `submit`, processor, controller, scaling agent) on a
//! fleet of two work shards and two results partitions, until a job has gone through each partition;
//! the submitter follows them (`--wait`, `wait`, `status`, `report`); unreadable dead letters on every
//! dead-letter queue are taken by the controller; then an operator runs every command of theirs as the `initiator` binary
//! (`provision`, `status`, `report`, `wait`, `jobs`, `warehouse backfill`, `abandon` of a second job
//! left unfinished, `dlq list`, `dlq show`, `dlq redrive` of both dead-letter queues and the
//! quarantine). With `FLEET_CALLS_FILE` set each process writes the distinct calls it made: operation,
//! resource (queue; bucket; bucket and key) and the request's condition keys (`fleet_io::call`). The
//! test's per-run names are mapped onto the policies' (`billing-fleet`, `billing-work-1-dlq`, ...) and
//! each call becomes the requests IAM authorises ([`requests`]: the action, the resource's ARN, the
//! condition keys; a GetObject also needs `s3:ListBucket`, without which a missing key is a 403 that the
//! store reads as a failure, not as absent; a message move task needs what SQS does on the caller's
//! behalf). Each is evaluated against its role's policy ([`Policy::allows`]: action, resource with IAM's
//! wildcards `*` and `?`, and the statement's `Condition`, failing loudly on an operator this evaluator
//! does not know). The test fails when a request no statement allows, and when a statement's action
//! and resource pattern no request used, unless it is listed in [`RARE`] with the reason (and a RARE
//! entry that is used, or no longer in the policy, fails too): a call or a policy changed alone fails
//! it. The unit tests at the end show the evaluator denying what it must, and that no role but the
//! controller's may write the controller's state.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use fleet_io::auth::Role;
use fleet_io::blob::BlobStore;
use fleet_io::config::FleetArgs;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::{Message, Outgoing, Queue};
use serde_json::Value;

use crate::support::*;

const SQS_ARN: &str = "arn:aws:sqs:us-east-1:123456789012:";
const S3_ARN: &str = "arn:aws:s3:::";

/// Grants a policy holds but this test's run does not use: (role, action or `*` for every action,
/// the grant's resource pattern, matched as a wildcard pattern itself, why).
const RARE: &[(&str, &str, &str, &str)] = &[
    ("initiator", "*", "*.fifo", FIFO),
    ("initiator", "*", "*-??", WIDE),
    ("initiator", "*", "*-??-dlq", WIDE),
    ("initiator", "s3:GetObject", "*/tariff.json", "a tariff write (If-None-Match) whose answer was lost is read back to see it holds our bytes"),
    ("processor", "*", "*.fifo", FIFO),
    ("processor", "*", "*-??", WIDE),
    ("processor", "*", "*-??-dlq", WIDE),
    ("processor", "sqs:ChangeMessageVisibility", "*", "the heartbeat extends work items held past half the visibility timeout; a failed item's back-off"),
    ("processor", "sqs:SendMessage", "*-dlq", "a work item whose deadline passed in the processor's buffer is dead-lettered as expired"),
    ("processor", "s3:PutObject", "*", "results too large for a message go to S3 as a blob"),
    ("controller", "*", "*.fifo", FIFO),
    ("controller", "*", "*-??", WIDE),
    ("controller", "*", "*-??-dlq", WIDE),
    ("controller", "sqs:ChangeMessageVisibility", "*", "results held through a store outage, or handed back to another controller's job"),
    ("controller", "sqs:SendMessage", "*", "a dead-lettered work item forwarded to its job's results partition; a stray forwarded to its partition"),
    (
        "controller",
        "s3:DeleteObject",
        "*/checkpoints/*",
        "checkpoint parts, replaced by a later checkpoint or left at a finish: only jobs large enough to keep their rows in parts (this run's are small)",
    ),
    ("controller", "*", "*/purge/*", "purge markers of the release before `purge-due/`: read, then deleted or set aside"),
    ("controller", "s3:PutObject", "*/purge-unreadable/*", "an unreadable purge marker set aside for a look by hand"),
    ("scaling-agent", "*", "*.fifo", FIFO),
    ("scaling-agent", "*", "*-??", WIDE),
    ("scaling-agent", "*", "*-??-dlq", WIDE),
    ("operator", "*", "*.fifo", FIFO),
    ("operator", "*", "*-??", WIDE),
];

/// Why the FIFO queues' grants go unused here.
const FIFO: &str = "a FIFO work queue (`--group-by` needs one): this run's fleet is standard";
/// Why the grants of shards and partitions 10-99 go unused here.
const WIDE: &str = "shards and partitions 10 to 99: this run's fleet has two of each";

/// A request IAM authorises: an action on a resource ARN, with the request's condition keys (lower
/// case).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Request {
    action: String,
    arn: String,
    context: BTreeMap<String, String>,
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {}", self.action, self.arn)?;
        for (k, v) in &self.context {
            write!(f, " [{k}={v}]")?;
        }
        Ok(())
    }
}

/// The requests IAM authorises for one line of a calls file (`fleet_io::call::call_line`), its names
/// mapped by `prod` onto the policies'. A RabbitMQ call is none of IAM's.
fn requests(line: &str, prod: &dyn Fn(&str) -> String) -> Vec<Request> {
    assert!(!line.starts_with(fleet_io::call::TRUNCATED), "a calls file was truncated ({line}): calls were not recorded");
    let mut parts = line.split('\t');
    let op = parts.next().unwrap_or_default();
    if op.starts_with("amqp.") {
        return Vec::new();
    }
    let resource = prod(parts.next().unwrap_or_else(|| panic!("no resource in the call {line:?}")));
    let mut context = BTreeMap::new();
    let mut destination = None;
    for kv in parts {
        let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{line:?}: {kv:?} is not key=value"));
        match k {
            "destination" => destination = Some(prod(v)),
            _ => {
                context.insert(k.to_ascii_lowercase(), v.to_string());
            }
        }
    }
    let queue = || format!("{SQS_ARN}{resource}");
    let bucket = || format!("{S3_ARN}{}", resource.split('/').next().unwrap_or_default());
    let object = || {
        assert!(resource.contains('/'), "{line:?}: an object call without a key");
        format!("{S3_ARN}{resource}")
    };
    let req = |action: &str, arn: String| Request { action: action.to_string(), arn, context: context.clone() };
    match op {
        "sqs.GetQueueUrl" => vec![req("sqs:GetQueueUrl", queue())],
        "sqs.GetQueueAttributes" => vec![req("sqs:GetQueueAttributes", queue())],
        "sqs.SendMessageBatch" => vec![req("sqs:SendMessage", queue())],
        "sqs.ReceiveMessage" => vec![req("sqs:ReceiveMessage", queue())],
        "sqs.DeleteMessageBatch" => vec![req("sqs:DeleteMessage", queue())],
        "sqs.ChangeMessageVisibilityBatch" => vec![req("sqs:ChangeMessageVisibility", queue())],
        "sqs.CreateQueue" => vec![req("sqs:CreateQueue", queue())],
        "sqs.SetQueueAttributes" => vec![req("sqs:SetQueueAttributes", queue())],
        "sqs.ListMessageMoveTasks" => vec![req("sqs:ListMessageMoveTasks", queue())],
        // The task, and what SQS does with the caller's permissions: reads and deletes at the source,
        // sends to the destination.
        "sqs.StartMessageMoveTask" => {
            let to = destination.unwrap_or_else(|| panic!("{line:?}: a move task without its destination"));
            vec![
                req("sqs:StartMessageMoveTask", queue()),
                req("sqs:ReceiveMessage", queue()),
                req("sqs:DeleteMessage", queue()),
                req("sqs:GetQueueAttributes", queue()),
                Request { action: "sqs:SendMessage".into(), arn: format!("{SQS_ARN}{to}"), context: BTreeMap::new() },
            ]
        }
        // Without s3:ListBucket a missing key answers 403, which the store reads as a failure, not as
        // the absence every reader of a maybe-missing key relies on.
        "s3.GetObject" | "s3.HeadObject" => {
            vec![req("s3:GetObject", object()), Request { action: "s3:ListBucket".into(), arn: bucket(), context: BTreeMap::new() }]
        }
        "s3.PutObject" => vec![req("s3:PutObject", object())],
        "s3.DeleteObject" => vec![req("s3:DeleteObject", object())],
        "s3.ListObjectsV2" | "s3.HeadBucket" => vec![req("s3:ListBucket", bucket())],
        "s3.CreateBucket" => vec![req("s3:CreateBucket", bucket())],
        "s3.PutBucketLifecycleConfiguration" => vec![req("s3:PutLifecycleConfiguration", bucket())],
        o => panic!("no IAM action known for {o}: add it to `requests` (and to the policies)"),
    }
}

/// IAM's wildcard match: `*` any run of characters (`/` included), `?` exactly one.
fn matches(pattern: &str, s: &str) -> bool {
    let (p, s): (Vec<char>, Vec<char>) = (pattern.chars().collect(), s.chars().collect());
    // ok[j]: the pattern so far matches s[..j].
    let mut ok = vec![false; s.len() + 1];
    ok[0] = true;
    for &c in &p {
        let mut next = vec![false; s.len() + 1];
        match c {
            '*' => {
                let mut any = false;
                for j in 0..=s.len() {
                    any |= ok[j];
                    next[j] = any;
                }
            }
            _ => {
                for j in 1..=s.len() {
                    next[j] = ok[j - 1] && (c == '?' || c == s[j - 1]);
                }
            }
        }
        ok = next;
    }
    ok[s.len()]
}

#[derive(Debug)]
struct Condition {
    operator: String,
    key: String,
    values: Vec<String>,
}

impl Condition {
    /// Whether the request's `context` satisfies it; an operator unknown here fails the test.
    fn holds(&self, context: &BTreeMap<String, String>) -> bool {
        let value = context.get(&self.key);
        match self.operator.as_str() {
            // "true": the key is absent; "false": present.
            "Null" => self.values.iter().any(|v| match v.as_str() {
                "true" => value.is_none(),
                "false" => value.is_some(),
                other => panic!("Null takes \"true\" or \"false\", not {other:?}"),
            }),
            "StringEquals" => value.is_some_and(|v| self.values.iter().any(|w| w == v)),
            "StringLike" => value.is_some_and(|v| self.values.iter().any(|w| matches(w, v))),
            other => panic!("the condition operator {other} is unknown to this evaluator: teach it `Condition::holds` before a policy uses it"),
        }
    }
}

#[derive(Debug)]
struct Statement {
    sid: String,
    actions: Vec<String>,
    resources: Vec<String>,
    conditions: Vec<Condition>,
}

impl Statement {
    /// The resource patterns of this statement that allow `r` (none: it does not).
    fn allowing<'a>(&'a self, r: &Request) -> Vec<&'a str> {
        if !self.actions.iter().any(|a| a.eq_ignore_ascii_case(&r.action)) || !self.conditions.iter().all(|c| c.holds(&r.context)) {
            return Vec::new();
        }
        self.resources.iter().filter(|p| matches(p, &r.arn)).map(String::as_str).collect()
    }
}

#[derive(Debug)]
struct Policy {
    role: String,
    statements: Vec<Statement>,
}

impl Policy {
    fn parse(role: &str, doc: &Value) -> Policy {
        assert_eq!(doc["Version"], "2012-10-17", "{role}");
        let list = |v: &Value| -> Vec<String> {
            match v {
                Value::String(s) => vec![s.clone()],
                Value::Array(a) => a.iter().map(|x| x.as_str().unwrap_or_else(|| panic!("{role}: {x}")).to_string()).collect(),
                other => panic!("{role}: {other}"),
            }
        };
        let mut statements = Vec::new();
        for st in doc["Statement"].as_array().unwrap_or_else(|| panic!("{role}: no Statement list")) {
            let sid = st["Sid"].as_str().unwrap_or_else(|| panic!("{role}: a statement without a Sid")).to_string();
            assert_eq!(st["Effect"], "Allow", "{role}/{sid}: only Allow statements");
            for k in st.as_object().unwrap().keys() {
                assert!(["Sid", "Effect", "Action", "Resource", "Condition"].contains(&k.as_str()), "{role}/{sid}: {k} is unknown to this evaluator");
            }
            let resources = list(&st["Resource"]);
            for r in &resources {
                assert!(r != "*" && !r.ends_with(":*"), "{role}/{sid}: a wildcard resource {r}");
                assert!(r.starts_with(SQS_ARN) || r.starts_with(S3_ARN), "{role}/{sid}: {r} is not the fleet's account and region");
            }
            let actions = list(&st["Action"]);
            for a in &actions {
                assert!(!a.contains('*') && !a.contains('?'), "{role}/{sid}: a wildcard action {a}");
            }
            let mut conditions = Vec::new();
            if let Some(c) = st.get("Condition") {
                for (operator, keys) in c.as_object().unwrap_or_else(|| panic!("{role}/{sid}: Condition")) {
                    for (key, values) in keys.as_object().unwrap_or_else(|| panic!("{role}/{sid}: {operator}")) {
                        conditions.push(Condition { operator: operator.clone(), key: key.to_ascii_lowercase(), values: list(values) });
                    }
                }
            }
            statements.push(Statement { sid, actions, resources, conditions });
        }
        Policy { role: role.to_string(), statements }
    }

    fn load(role: &str) -> Policy {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../k8s/iam/{role}.json"));
        let doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Policy::parse(role, &doc)
    }

    fn allows(&self, r: &Request) -> bool {
        self.statements.iter().any(|s| !s.allowing(r).is_empty())
    }

    /// Every (statement, action, resource pattern) of the policy.
    fn grants(&self) -> BTreeSet<(String, String, String)> {
        let mut out = BTreeSet::new();
        for s in &self.statements {
            for a in &s.actions {
                for p in &s.resources {
                    out.insert((s.sid.clone(), a.clone(), p.clone()));
                }
            }
        }
        out
    }

    /// The grants that allowed any of `requests`.
    fn used(&self, requests: &BTreeSet<Request>) -> BTreeSet<(String, String, String)> {
        let mut out = BTreeSet::new();
        for r in requests {
            for s in &self.statements {
                for p in s.allowing(r) {
                    let a = s.actions.iter().find(|a| a.eq_ignore_ascii_case(&r.action)).unwrap();
                    out.insert((s.sid.clone(), a.clone(), p.to_string()));
                }
            }
        }
        out
    }
}

/// Evaluates a role's requests against its policy: what is denied, what is granted but unused (and not
/// in [`RARE`]), and RARE entries that are used or no longer granted.
fn evaluate(policy: &Policy, requests: &BTreeSet<Request>) -> Vec<String> {
    let role = policy.role.as_str();
    let mut failures = Vec::new();
    for r in requests {
        if !policy.allows(r) {
            failures.push(format!("{role}: {r} is denied by {role}.json"));
        }
    }
    let used = policy.used(requests);
    let rare = |a: &str, p: &str| RARE.iter().any(|(s, ra, rp, _)| *s == role && (*ra == "*" || *ra == a) && matches(rp, p));
    for (sid, a, p) in policy.grants().difference(&used) {
        if !rare(a, p) {
            failures.push(format!("{role}: {sid} allows {a} on {p}, which no call used (least privilege: narrow it, or list it in RARE with the reason)"));
        }
    }
    let grants = policy.grants();
    for (s, ra, rp, _) in RARE.iter().filter(|(s, ..)| *s == role) {
        let granted: Vec<_> = grants.iter().filter(|(_, a, p)| (*ra == "*" || ra == a) && matches(rp, p)).collect();
        if granted.is_empty() {
            failures.push(format!("{s}: RARE lists {ra} on {rp}, which {s}.json does not grant: remove it from RARE"));
        }
        for g in granted.into_iter().filter(|g| used.contains(*g)) {
            failures.push(format!("{s}: RARE lists {} on {} ({rp}), which this run used: remove it from RARE", g.1, g.2));
        }
    }
    failures
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

/// SIGTERM, and wait for the exit (which writes the calls file).
fn stop(c: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
    let t = std::time::Instant::now();
    while c.try_wait().unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(40), "did not stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The calls files of a run: one per process, named by role and step.
struct Calls {
    dir: PathBuf,
}

impl Calls {
    fn file(&self, role: &str, step: &str) -> PathBuf {
        self.dir.join(format!("{role}.{step}.calls"))
    }

    /// Every line the processes of `role` wrote.
    fn of(&self, role: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut files = 0;
        for e in std::fs::read_dir(&self.dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with(&format!("{role}.")) && name.ends_with(".calls") {
                files += 1;
                out.extend(std::fs::read_to_string(&p).unwrap().lines().map(str::to_string));
            }
        }
        assert!(files > 0, "{role} wrote no calls file");
        out
    }
}

/// The `initiator` binary as `role` (its signing key), with `args`, recording into `calls`; killed
/// after `within`.
fn cli(st: &Stack, role: Role, calls: &Path, args: &[&str], within: Duration) -> Output {
    let mut cmd = fleet_command(st, "initiator");
    cmd.args(args)
        .env("FLEET_CALLS_FILE", calls)
        .env("FLEET_SIGNING_KEY_FILE", role_keys().file(role))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap_or_else(|e| panic!("start the initiator: {e}"));
    let pid = child.id();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if t.elapsed() > within {
                    let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let out = tokio::task::block_in_place(|| child.wait_with_output()).unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = watchdog.join();
    println!("[iam] initiator {} ({role}): {}", args.join(" "), out.status);
    out
}

/// `out` ended with `code`, or the test fails with its stderr.
fn ok(out: &Output, code: i32, what: &str) -> Value {
    assert_eq!(out.status.code(), Some(code), "{what}: {}\n{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_of_every_binary_is_allowed_by_its_roles_policy_and_every_grant_is_used() {
    let Some(st) = stack_of(FleetArgs::defaults().sharded(2).partitioned(2), QueueSettings::default()).await else { return };
    // The run's names are the policies' with `-{suffix}` after the base name.
    let suffix = st.names.bucket.strip_prefix("billing-fleet-").expect("a test bucket is billing-fleet-{suffix}").to_string();
    let prod = move |name: &str| name.replace(&format!("-{suffix}"), "");
    let dir = tempfile::tempdir().unwrap();
    let calls = Calls { dir: dir.path().to_path_buf() };
    // A job to end partial, for `retry` below: submitted before any processor runs, its chunk 0
    // taken away (so that chunk fails at once; put back before the retry). Begun first, so that
    // the controller's settle time (3 min) passes while the other commands run.
    let partial = generated(dir.path(), "partial.csv", 3000, 40, 6);
    let s3 = st.submit(std::slice::from_ref(&partial), 1500).await;
    let job3 = s3.job_id.clone();
    let chunk0 = fleet_domain::layout::chunk_key(&job3, 0);
    let blob0 = st.store.get(&chunk0).await.unwrap().expect("chunk 0 stored");
    st.store.delete(&chunk0).await.unwrap();
    let mut procs = Procs(vec![
        service(&st, "processor", &calls.file("processor", "run"), &[]),
        service(&st, "controller", &calls.file("controller", "run"), &[("CONTROLLER_ID", "iam-test")]),
        service(&st, "scaling-agent", &calls.file("scaling-agent", "run"), &[("AGENT_BACKEND", "none"), ("AGENT_INTERVAL_SECS", "1")]),
    ]);
    let minute = Duration::from_secs(60);

    // The submitter: a job through, then followed; then more, until a job has gone through each results
    // partition (a job's partition is a hash of its id).
    let file = generated(dir.path(), "in.csv", 3000, 40, 5);
    let f = file.to_str().unwrap();
    let mut partitions = BTreeSet::new();
    let mut job = String::new();
    for n in 0..12 {
        let args = if n == 0 { vec!["submit", f, "--chunk-size", "500", "--wait", "--json"] } else { vec!["submit", f, "--chunk-size", "1500", "--json"] };
        let out = ok(&cli(&st, Role::Submitter, &calls.file("initiator", &format!("submit-{n}")), &args, 3 * minute), 0, "submit");
        let id = out["job_id"].as_str().expect("the submission names its job").to_string();
        let manifest = st.store.get(&fleet_domain::layout::manifest_key(&id)).await.unwrap().expect("a manifest");
        partitions.insert(serde_json::from_slice::<Value>(&manifest).unwrap()["partition"].as_u64().expect("its partition"));
        if n == 0 {
            job = id;
        } else {
            ok(&cli(&st, Role::Submitter, &calls.file("initiator", &format!("wait-{n}")), &["wait", &id, "--json"], 3 * minute), 0, "wait");
        }
        if partitions.len() == 2 {
            break;
        }
    }
    assert_eq!(partitions.len(), 2, "12 jobs on one partition");
    ok(&cli(&st, Role::Submitter, &calls.file("initiator", "status"), &["status", &job, "--json"], minute), 0, "status");
    ok(&cli(&st, Role::Submitter, &calls.file("initiator", "report"), &["report", &job, "--json"], minute), 0, "report");

    // Unreadable dead letters on every dead-letter queue, for the controller to take.
    let letter = |body: &str| Outgoing::plain(body.to_string());
    for (_, dlq) in st.shards.iter().chain(&st.partitions) {
        dlq.send_messages(&[letter("not json: a dead letter of the IAM test")]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The operator's commands.
    let op = |step: &str, args: &[&str]| cli(&st, Role::Operator, &calls.file("operator", step), args, 3 * minute);
    ok(&op("provision", &["provision", "--json"]), 0, "provision");
    ok(&op("status", &["status", &job, "--json"]), 0, "operator status");
    ok(&op("report", &["report", &job, "--json"]), 0, "operator report");
    ok(&op("wait", &["wait", &job, "--json"]), 0, "operator wait");
    ok(&op("jobs", &["jobs", "--json"]), 0, "jobs");
    // The job as if it had finished before `checkpoints/`: its checkpoint where an earlier release
    // kept it (never moved: a finished job is not saved again). Submitter and operator see it ended.
    {
        use fleet_domain::layout::{checkpoint_key, legacy_checkpoint_key};
        let (new, old) = (checkpoint_key(&job), legacy_checkpoint_key(&job));
        let (body, meta) = (st.store.get(&new).await.unwrap().expect("its checkpoint"), st.store.head(&new).await.unwrap().expect("its checkpoint"));
        st.store.put_if(&old, body, "application/zstd", &meta, &fleet_io::blob::Cond::Any).await.unwrap();
        st.store.delete(&new).await.unwrap();
        let s = ok(&cli(&st, Role::Submitter, &calls.file("initiator", "status-legacy"), &["status", &job, "--json"], minute), 0, "status (legacy)");
        assert_eq!(s["status"], "complete", "{s}");
        let s = ok(&op("status-legacy", &["status", &job, "--json"]), 0, "operator status (legacy)");
        assert_eq!(s["status"], "complete", "{s}");
        ok(&op("wait-legacy", &["wait", &job, "--json"]), 0, "operator wait (legacy)");
    }
    // The job's table objects gone (as for a job finished before the tables), for the backfill to write.
    let tables: Vec<String> = st.store.list("tables/", 1000).await.unwrap().into_iter().filter(|k| k.contains(&job)).collect();
    assert_eq!(tables.len(), 2, "the job's two table objects: {tables:?}");
    for k in &tables {
        st.store.delete(k).await.unwrap();
    }
    let backfill = ok(&op("backfill", &["warehouse", "backfill", "--json"]), 0, "warehouse backfill");
    println!("[iam] backfill: {backfill}");

    // The partial job begun first, finished by the submitter's `retry` (its chunk 0 put back: the
    // cause fixed); then its kept chunk given up by the operator.
    ok(&cli(&st, Role::Submitter, &calls.file("initiator", "wait-partial"), &["wait", &job3, "--json"], 4 * minute), 2, "wait (partial)");
    st.store.put(&chunk0, blob0, "application/zstd").await.unwrap();
    let retried = ok(&cli(&st, Role::Submitter, &calls.file("initiator", "retry"), &["retry", &job3, "--json"], 3 * minute), 0, "retry");
    assert_eq!(retried["completes"], job3.as_str(), "{retried}");
    ok(&op("give-up", &["retry", &job3, "--give-up"]), 0, "retry --give-up");

    // A second job, left unfinished (no processor), abandoned by the operator.
    stop(&mut procs.0[0]);
    let sub = ok(
        &cli(&st, Role::Submitter, &calls.file("initiator", "submit-unfinished"), &["submit", f, "--chunk-size", "500", "--json"], minute),
        0,
        "second submit",
    );
    let job2 = sub["job_id"].as_str().expect("the submission names its job").to_string();
    let abandoned = ok(&op("abandon", &["abandon", &job2, "--json"]), 2, "abandon");
    assert_eq!(abandoned["status"], "abandoned", "{abandoned}");

    // With the fleet stopped: dead letters on a shard's and a partition's dead-letter queue, and a
    // quarantined message, for the operator's commands.
    for c in &mut procs.0[1..] {
        stop(c);
    }
    for (_, dlq) in st.shards.iter().chain(&st.partitions) {
        dlq.send_messages(&[letter("not json: a dead letter of the IAM test")]).await.unwrap();
    }
    let m = Message { id: "iam-test-1".into(), body: "not json: quarantined by the IAM test".into(), receive_count: 1, ..Message::default() };
    let qkey = fleet_io::quarantine::put(st.store.as_ref(), st.partitions[0].0.name(), &m, "unreadable (the IAM test)").await.unwrap();
    let listed = ok(&op("dlq-list", &["dlq", "list", "--json"]), 0, "dlq list");
    let entries = listed.as_array().expect("a list of entries");
    let id = entries.iter().find(|e| e["place"] != "quarantine").and_then(|e| e["id"].as_str()).expect("a dead letter listed").to_string();
    ok(&op("dlq-show", &["dlq", "show", &id]), 0, "dlq show");
    ok(&op("dlq-show-quarantined", &["dlq", "show", &qkey]), 0, "dlq show (quarantine)");
    // Everything back: each dead-letter queue by a move task (standard queues), the quarantine.
    let moved = ok(&op("redrive", &["dlq", "redrive", "--json"]), 0, "dlq redrive");
    println!("[iam] redrive: {moved}");
    assert_eq!((moved["work_dlq"].as_u64(), moved["results_dlq"].as_u64()), (Some(2), Some(2)), "{moved}");

    let mut failures = Vec::new();
    for role in ["initiator", "processor", "controller", "scaling-agent", "operator"] {
        let lines = calls.of(role);
        let reqs: BTreeSet<Request> = lines.iter().flat_map(|l| requests(l, &prod)).collect();
        let actions: BTreeSet<&str> = reqs.iter().map(|r| r.action.as_str()).collect();
        println!("[iam] {role}: {} distinct calls, {} distinct requests, actions {actions:?}", lines.len(), reqs.len());
        for l in &lines {
            println!("[iam]   {}", prod(l).replace('\t', " "));
        }
        failures.extend(evaluate(&Policy::load(role), &reqs));
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

fn req(action: &str, arn: &str, context: &[(&str, &str)]) -> Request {
    Request { action: action.into(), arn: arn.into(), context: context.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() }
}

/// The evaluator denies what IAM would: a queue or key outside the patterns, a manifest written
/// without If-None-Match; `?` is one character, `*` any run (`/` included).
#[test]
fn the_evaluator_denies_what_iam_would() {
    assert!(matches("billing-work-?", "billing-work-1"));
    assert!(!matches("billing-work-?", "billing-work-12"), "? is exactly one character");
    assert!(!matches("billing-work-?", "billing-work-"));
    assert!(matches("jobs/*/chunks/*", "jobs/j/chunks/a/b"), "* spans /");
    assert!(!matches("jobs/*/chunks/*", "jobs/j/manifest.json"));
    let initiator = Policy::load("initiator");
    let q = |name: &str| format!("{SQS_ARN}{name}");
    assert!(initiator.allows(&req("sqs:SendMessage", &q("billing-work-7"), &[])));
    assert!(!initiator.allows(&req("sqs:SendMessage", &q("billing-work-100"), &[])), "three digits: no such shard");
    assert!(!initiator.allows(&req("sqs:SendMessage", &q("billing-work-dlq"), &[])), "a dead-letter queue");
    assert!(!initiator.allows(&req("sqs:SendMessage", &q("billing-other"), &[])));
    assert!(!initiator.allows(&req("sqs:SendMessage", "arn:aws:sqs:us-east-1:999999999999:billing-work", &[])), "another account");
    let manifest = format!("{S3_ARN}billing-fleet/jobs/j/manifest.json");
    assert!(!initiator.allows(&req("s3:PutObject", &manifest, &[])), "a manifest written unconditionally");
    assert!(!initiator.allows(&req("s3:PutObject", &manifest, &[("s3:if-match", "<etag>")])), "a manifest replaced");
    assert!(initiator.allows(&req("s3:PutObject", &manifest, &[("s3:if-none-match", "*")])));
    assert!(!initiator.allows(&req("s3:PutObject", &format!("{S3_ARN}billing-fleet/jobs/j/checkpoint.json.zst"), &[("s3:if-none-match", "*")])));
    assert!(!initiator.allows(&req("s3:PutObject", &format!("{S3_ARN}billing-fleet/checkpoints/j/checkpoint.json.zst"), &[("s3:if-none-match", "*")])));
    // The controller writes nothing a submitter or processor writes: its state has a prefix of its own.
    let controller = Policy::load("controller");
    for key in ["jobs/j/manifest.json", "jobs/j/chunks/000000.csv.zst", "jobs/j/results/000000.json.zst", "jobs/j/checkpoint.json.zst"] {
        let arn = format!("{S3_ARN}billing-fleet/{key}");
        for context in [&[][..], &[("s3:if-none-match", "*")][..], &[("s3:if-match", "<etag>")][..]] {
            assert!(!controller.allows(&req("s3:PutObject", &arn, context)), "controller.json allows PutObject on {key} ({context:?})");
        }
    }
    assert!(!initiator.allows(&req("s3:PutObject", &format!("{S3_ARN}other-bucket/jobs/j/chunks/000000.csv.zst"), &[])), "another bucket");
    // A policy and a run that disagree fail: a grant nobody used, a call nobody allowed.
    let used: BTreeSet<Request> = [req("s3:PutObject", &manifest, &[])].into();
    let failures = evaluate(&initiator, &used);
    assert!(failures.iter().any(|f| f.contains("is denied")), "{failures:?}");
    assert!(failures.iter().any(|f| f.contains("no call used")), "{failures:?}");
}

#[test]
#[should_panic(expected = "unknown to this evaluator")]
fn a_condition_operator_the_evaluator_does_not_know_fails_loudly() {
    let doc = serde_json::json!({"Version": "2012-10-17", "Statement": [{
        "Sid": "X", "Effect": "Allow", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::billing-fleet/x/*",
        "Condition": {"NumericLessThan": {"s3:max-keys": "10"}}
    }]});
    Policy::parse("test", &doc).allows(&req("s3:PutObject", "arn:aws:s3:::billing-fleet/x/y", &[]));
}

/// The controller's state (checkpoints and their parts, a quarantined job's state, leases, partition
/// ownership, open markers, the quarantine, purge markers, the claims of billed transactions) is written by the controller's role only.
#[test]
fn only_the_controllers_policy_may_write_the_controllers_state() {
    let keys = [
        "checkpoints/j/checkpoint.json.zst",
        "checkpoints/j/parts/0190a0000000700080000000000000001.csv.zst",
        "checkpoints/j/quarantined.json.zst",
        // Where releases before `checkpoints/` kept them (read when a job has none under it).
        "jobs/j/checkpoint.json.zst",
        "jobs/j/checkpoint/000001.json.zst",
        "jobs/j/quarantined/checkpoint.json.zst",
        "leases/j.json",
        "partitions/owners.json",
        "open/j",
        "quarantine/billing-results/m.json",
        "purge/j",
        "purge-unreadable/j",
        "purge-due/00000000001/j",
        // The claims of billed transactions (docs/claims.md).
        "claims/2026-12-01/0a/000000.bin",
        // A finished job's failed chunks kept for a retry: a list a submitter wrote could keep
        // another job's chunks, or name chunks to read.
        "jobs/j/kept.json",
    ];
    // The operator's `dlq redrive --from quarantine` deletes what it sent back, and `retry --give-up`
    // the kept list it gives up (neither writes there).
    let excepted = |role: &str, action: &str, key: &str| {
        role == "operator" && action == "s3:DeleteObject" && (key.starts_with("quarantine/") || key == "jobs/j/kept.json")
    };
    let controller = Policy::load("controller");
    for key in keys {
        let arn = format!("{S3_ARN}billing-fleet/{key}");
        let writes = ["s3:PutObject", "s3:DeleteObject"].map(|a| controller.allows(&req(a, &arn, &[("s3:if-none-match", "*")])));
        assert!(writes.contains(&true), "the controller may not write {key}");
        for action in ["s3:PutObject", "s3:DeleteObject"] {
            for role in ["initiator", "processor", "scaling-agent", "operator"] {
                if excepted(role, action, key) {
                    continue;
                }
                let p = Policy::load(role);
                for context in [&[][..], &[("s3:if-none-match", "*")][..], &[("s3:if-match", "<etag>")][..]] {
                    assert!(!p.allows(&req(action, &arn, context)), "{role}.json allows {action} on {key} ({context:?}): the controller's state");
                }
            }
        }
    }
}
