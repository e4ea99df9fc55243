//! Why one file: how long a call may take, how often it is tried, and what each attempt is billed are
//! decided in one loop; split, the billing would have to guess how many attempts the loop made. (The
//! tests at the end are half of it.)
//!
//! One bound on every call to SQS, S3 and RabbitMQ: each attempt has a timeout, the whole call an
//! overall deadline, and retryable failures are tried again after a jittered exponential back-off
//! ("full jitter": a uniform wait between zero and the doubling cap). Every client takes its
//! [`CallPolicy`] from the same flags, so a service that hangs (answers nothing, keeps the connection
//! open) can hold a consumer, a completion slot or a shutdown for at most the deadline.
//!
//! The AWS SDK's own retries are switched off where the clients are built (`config::Aws`): this policy is
//! the only place that decides how often and how long a call is tried.
//!
//! Being that one place, it is also where calls are observed, by their typed [`Op`]: the process's
//! call metrics (`crate::metrics`: a latency histogram, retries, errors and calls given up by their
//! caller, by service and operation), and, with `FLEET_CALLS_FILE` set only, what a process calls and
//! on what ([`called`]): each call's operation, the resource it names ([`On`]: the SQS queue, the S3
//! bucket, the bucket and key) and the request's IAM condition keys (a conditional PutObject's
//! `s3:if-none-match` / `s3:if-match`, a listing's `s3:prefix`), one line per distinct call, at most
//! [`MAX_CALLED`] lines. Every call passes its [`On`] to [`CallPolicy::run`] / [`CallPolicy::once`]
//! (provisioning, which calls the SDK without the policy, to [`record`]), so none is left out. A binary
//! writes the lines to that file when it exits ([`write_called`]): the IAM test
//! (`deploy/e2e/tests/it/iam.rs`) evaluates each against its service's policy in `deploy/k8s/iam/`,
//! action, resource and condition, as IAM would.
//!
//! A client counts the requests the services bill in its [`CallCounter`] (an attempt each, by
//! [`Billed`]); [`counted`] runs a future with a counter of its own that sees the same counts, which is
//! how a work item's requests are a snapshot of the counter rather than a second count kept by hand.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::metrics::Watch;
pub use crate::op::{Billed, Op};
pub use fleet_domain::requests::RequestCounts;

static CALLED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Most distinct calls kept (a long-lived process names many keys); past it, new ones are dropped and
/// the calls file ends with a line saying so ([`TRUNCATED`]).
pub const MAX_CALLED: usize = 10_000;

/// The last line of a calls file whose calls were more than [`MAX_CALLED`].
pub const TRUNCATED: &str = "# truncated";

static DROPPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Recording is on only when `FLEET_CALLS_FILE` is set (read once): otherwise a call takes no lock
/// and formats nothing.
fn recording() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FLEET_CALLS_FILE").is_some())
}

/// What a call acts on, as IAM names its resource (and the request's condition keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On<'a> {
    /// No resource IAM knows of (RabbitMQ's calls).
    Unnamed,
    /// An SQS queue, by name.
    Queue(&'a str),
    /// A message move task from the queue `from` to the queue `to` (by name): IAM checks the task on
    /// `from` and what SQS does on the caller's behalf (receive and delete there, send to `to`).
    Move { from: &'a str, to: &'a str },
    /// An S3 bucket (HeadBucket, CreateBucket, ...); a ListObjectsV2 with its prefix (`s3:prefix`).
    Bucket { bucket: &'a str, prefix: Option<&'a str> },
    /// An object; a PutObject with its precondition, if any.
    Object { bucket: &'a str, key: &'a str, cond: Option<Precondition> },
}

/// A conditional write's precondition: IAM's `s3:if-none-match` / `s3:if-match` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    /// `If-None-Match: *` (created only if absent).
    IfNoneMatch,
    /// `If-Match: <etag>` (replaced only if unchanged; the etag itself is not recorded).
    IfMatch,
}

impl On<'_> {
    /// An object `key` of `bucket`, written unconditionally or read.
    pub fn object<'a>(bucket: &'a str, key: &'a str) -> On<'a> {
        On::Object { bucket, key, cond: None }
    }

    /// A bucket without a prefix.
    pub fn bucket(bucket: &str) -> On<'_> {
        On::Bucket { bucket, prefix: None }
    }
}

/// One call as a line of the calls file: the operation, then tab-separated the resource (a queue's
/// name, `bucket` or `bucket/key`) and the condition keys the request carries, each `key=value`:
/// `s3.PutObject\tbilling-fleet/jobs/J/manifest.json\ts3:if-none-match=*`,
/// `sqs.ReceiveMessage\tbilling-results-1`, `s3.ListObjectsV2\tbilling-fleet\ts3:prefix=open/`
/// (a move task's `destination=` is no condition key: the queue its messages are sent to).
pub fn call_line(op: Op, on: On<'_>) -> String {
    match on {
        On::Unnamed => op.to_string(),
        On::Queue(name) => format!("{op}\t{name}"),
        On::Move { from, to } => format!("{op}\t{from}\tdestination={to}"),
        On::Bucket { bucket, prefix: None } => format!("{op}\t{bucket}"),
        On::Bucket { bucket, prefix: Some(p) } => format!("{op}\t{bucket}\ts3:prefix={p}"),
        On::Object { bucket, key, cond: None } => format!("{op}\t{bucket}/{key}"),
        On::Object { bucket, key, cond: Some(Precondition::IfNoneMatch) } => format!("{op}\t{bucket}/{key}\ts3:if-none-match=*"),
        On::Object { bucket, key, cond: Some(Precondition::IfMatch) } => format!("{op}\t{bucket}/{key}\ts3:if-match=<etag>"),
    }
}

/// Records a call of `op` on `on` (with `FLEET_CALLS_FILE` set only): [`CallPolicy::run`] and
/// [`CallPolicy::once`] do it for every call they bound; a call made outside them records itself.
pub fn record(op: Op, on: On<'_>) {
    if recording() {
        record_line(call_line(op, on));
    }
}

fn record_line(line: String) {
    let mut called = crate::lock(&CALLED);
    if called.len() < MAX_CALLED || called.contains(&line) {
        called.insert(line);
    } else {
        DROPPED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The distinct calls this process has made so far, as [`call_line`]s, sorted (recorded only with
/// `FLEET_CALLS_FILE` set).
pub fn called() -> Vec<String> {
    crate::lock(&CALLED).iter().cloned().collect()
}

/// Writes [`called`], one a line, to the file `FLEET_CALLS_FILE` names (when set); then [`TRUNCATED`]
/// if calls were dropped past [`MAX_CALLED`].
pub fn write_called() {
    if let Some(path) = std::env::var_os("FLEET_CALLS_FILE") {
        let mut text: String = called().into_iter().map(|c| c + "\n").collect();
        if DROPPED.load(std::sync::atomic::Ordering::Relaxed) {
            text.push_str(&format!("{TRUNCATED} at {MAX_CALLED} distinct calls\n"));
        }
        if let Err(e) = std::fs::write(&path, text) {
            tracing::warn!(path = %std::path::Path::new(&path).display(), error = %e, "could not write the calls file");
        }
    }
}

/// How every external call is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallPolicy {
    /// Longest wait for one attempt's answer (a long poll adds its wait time to this).
    pub attempt_timeout: Duration,
    /// Longest time for the call, attempts and back-off included: no attempt starts after it.
    pub deadline: Duration,
    /// Back-off cap before the first retry; it doubles per retry up to `max_backoff`.
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for CallPolicy {
    fn default() -> Self {
        CallPolicy {
            attempt_timeout: Duration::from_secs(10),
            deadline: Duration::from_secs(30),
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// Flags of the call policy (flattened into every binary's fleet flags).
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct CallArgs {
    /// Longest wait for one attempt of an SQS, S3 or RabbitMQ call, seconds (a long poll adds its wait).
    #[arg(long, global = true, env = "FLEET_CALL_ATTEMPT_TIMEOUT", default_value_t = 10.0, value_parser = positive_secs)]
    pub call_attempt_timeout: f64,
    /// Longest time for one SQS, S3 or RabbitMQ call with its retries, seconds.
    #[arg(long, global = true, env = "FLEET_CALL_DEADLINE", default_value_t = 30.0, value_parser = positive_secs)]
    pub call_deadline: f64,
}

impl Default for CallArgs {
    fn default() -> Self {
        let p = CallPolicy::default();
        CallArgs { call_attempt_timeout: p.attempt_timeout.as_secs_f64(), call_deadline: p.deadline.as_secs_f64() }
    }
}

impl CallArgs {
    pub fn policy(&self) -> CallPolicy {
        CallPolicy {
            attempt_timeout: Duration::from_secs_f64(self.call_attempt_timeout),
            deadline: Duration::from_secs_f64(self.call_deadline.max(self.call_attempt_timeout)),
            ..CallPolicy::default()
        }
    }
}

/// A number of seconds in (0, 1 day].
fn positive_secs(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if v.is_finite() && v > 0.0 && v <= 86_400.0 {
        Ok(v)
    } else {
        Err(format!("{s} s is out of range: expected more than 0 and at most 86400"))
    }
}

impl CallPolicy {
    /// Runs `attempt` until it succeeds, fails with a non-retryable error, or the deadline has passed
    /// (then the last error, or a timeout, is returned: retryable, so the caller leaves its messages for
    /// redelivery). `extra` lengthens each attempt's timeout (a long poll's wait).
    pub async fn run<T, F, Fut>(&self, op: Op, on: On<'_>, extra: Duration, attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        record(op, on);
        let watch = Watch::new(op);
        let (r, attempts) = self.attempts(op, extra, attempt).await;
        watch.ended(attempts, &r);
        r
    }

    /// The attempts of [`CallPolicy::run`], and how many were made.
    async fn attempts<T, F, Fut>(&self, op: Op, extra: Duration, mut attempt: F) -> (Result<T>, u32)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let (service, operation) = (op.service(), op.name());
        let start = Instant::now();
        let end = start + self.deadline + extra;
        let mut cap = self.first_backoff;
        for n in 1u32.. {
            let per_attempt = (self.attempt_timeout + extra).min(end.saturating_duration_since(Instant::now()));
            let err = match tokio::time::timeout(per_attempt, attempt()).await {
                Ok(Ok(v)) => return (Ok(v), n),
                Ok(Err(e)) if !e.is_retryable() => return (Err(e), n),
                Ok(Err(e)) => e,
                Err(_) => Error::Timeout { service, operation, after: per_attempt, attempts: n },
            };
            let wait = jitter(cap);
            cap = (cap * 2).min(self.max_backoff);
            if Instant::now() + wait >= end {
                tracing::warn!(%service, operation, attempts = n, elapsed_ms = start.elapsed().as_millis() as u64, error = %err, "call failed; deadline reached");
                let err = match err {
                    Error::Timeout { after, .. } => Error::Timeout { service, operation, after, attempts: n },
                    other => other,
                };
                return (Err(err), n);
            }
            tracing::debug!(%service, operation, attempt = n, wait_ms = wait.as_millis() as u64, error = %err, "call failed; retrying");
            tokio::time::sleep(wait).await;
        }
        unreachable!("the attempt loop returns")
    }

    /// One attempt under the attempt timeout (plus `extra`), no retry: for calls whose caller retries on
    /// its own terms (a listener's receive, a trigger publication).
    pub async fn once<T>(&self, op: Op, on: On<'_>, extra: Duration, fut: impl Future<Output = Result<T>>) -> Result<T> {
        record(op, on);
        let watch = Watch::new(op);
        let limit = self.attempt_timeout + extra;
        let r = match tokio::time::timeout(limit, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout { service: op.service(), operation: op.name(), after: limit, attempts: 1 }),
        };
        watch.ended(1, &r);
        r
    }
}

/// A client's calls: bounded by the policy, each attempt counted as billed into the client's counter
/// (a FIFO queue's apart: SQS bills them at its FIFO price), and each result reported to its
/// dependency's breaker (when it has one), so that every caller of the process sees an outage at once.
#[derive(Clone)]
pub struct Guarded {
    pub policy: CallPolicy,
    pub breaker: Option<std::sync::Arc<crate::breaker::Breaker>>,
    /// The client's billed requests: one per attempt of every call made here.
    pub calls: CallCounter,
    /// The client is a FIFO queue's.
    pub fifo: bool,
}

impl Guarded {
    pub fn new(policy: CallPolicy) -> Guarded {
        Guarded { policy, breaker: None, calls: CallCounter::default(), fifo: false }
    }

    fn record<T>(&self, r: Result<T>) -> Result<T> {
        if let Some(b) = &self.breaker {
            b.record(&r);
        }
        r
    }

    /// One attempt of `op`, billed.
    fn bill(&self, op: Op) {
        self.calls.add(Billed::Call { op, fifo: self.fifo }, 1);
    }

    /// [`CallPolicy::run`], each attempt billed, reported to the breaker.
    pub async fn run<T, F, Fut>(&self, op: Op, on: On<'_>, extra: Duration, mut attempt: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let r = self
            .policy
            .run(op, on, extra, || {
                self.bill(op);
                attempt()
            })
            .await;
        self.record(r)
    }

    /// [`CallPolicy::once`], billed, reported to the breaker.
    pub async fn once<T>(&self, op: Op, on: On<'_>, extra: Duration, fut: impl Future<Output = Result<T>>) -> Result<T> {
        let r = self
            .policy
            .once(op, on, extra, async {
                self.bill(op);
                fut.await
            })
            .await;
        self.record(r)
    }
}

/// A uniform wait in [0, cap].
fn jitter(cap: Duration) -> Duration {
    if cap.is_zero() {
        return cap;
    }
    Duration::from_nanos(crate::jitter::u64_in(0..cap.as_nanos() as u64 + 1))
}

/// The requests a client made, by what is billed: cheap to bump from many tasks. A clone counts into
/// the same totals (the shards of a sharded queue share one).
#[derive(Debug, Default, Clone)]
pub struct CallCounter {
    calls: std::sync::Arc<Mutex<RequestCounts>>,
    /// A [`counted`] scope's enclosing scope, which sees what this one sees.
    outer: Option<Box<CallCounter>>,
}

tokio::task_local! {
    /// The counter of the [`counted`] scope the current task runs in.
    static SCOPE: CallCounter;
}

/// Runs `fut`, and gives back with its output the requests that every client counted while it ran,
/// within this task: what `fut` itself made (a job's share of work), read off the same counts as the
/// clients' own (nothing counted twice by hand). Scopes nest: a scope's counts are also its enclosing
/// scope's.
pub async fn counted<F: Future>(fut: F) -> (F::Output, RequestCounts) {
    let outer = SCOPE.try_with(|outer| Box::new(outer.clone())).ok();
    let scope = CallCounter { outer, ..CallCounter::default() };
    let out = SCOPE.scope(scope.clone(), fut).await;
    (out, scope.snapshot())
}

impl CallCounter {
    /// One call of `op` (on a standard queue, or a service without FIFO queues).
    pub fn bump(&self, op: Op) {
        self.add(Billed::call(op), 1);
    }

    /// Counts `n` more of `what` (none for 0), here and in the [`counted`] scope the task runs in.
    pub fn add(&self, what: Billed, n: u64) {
        if n > 0 {
            self.add_here(what, n);
            let _ = SCOPE.try_with(|scope| scope.add_here(what, n));
        }
    }

    fn add_here(&self, what: Billed, n: u64) {
        crate::lock(&self.calls).add(what, n);
        if let Some(outer) = &self.outer {
            outer.add_here(what, n);
        }
    }

    /// Calls so far, by what is billed.
    pub fn snapshot(&self) -> RequestCounts {
        crate::lock(&self.calls).clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::error::Service;

    fn policy() -> CallPolicy {
        CallPolicy { attempt_timeout: Duration::from_secs(2), deadline: Duration::from_secs(7), ..CallPolicy::default() }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_never_answers_ends_at_the_deadline() {
        let tries = AtomicU32::new(0);
        let start = Instant::now();
        let r: Result<()> = policy()
            .run(Op::S3GetObject, On::Unnamed, Duration::ZERO, || {
                tries.fetch_add(1, Ordering::Relaxed);
                std::future::pending()
            })
            .await;
        let took = start.elapsed();
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Timeout { service: Service::S3, operation: "GetObject", .. }), "{e}");
        assert!(e.is_retryable());
        assert!(took <= Duration::from_secs(7), "took {took:?}");
        assert!(took >= Duration::from_secs(5), "gave up early: {took:?}");
        let n = tries.load(Ordering::Relaxed);
        assert!((3..=4).contains(&n), "{n} attempts of 2 s in 7 s");
    }

    #[tokio::test(start_paused = true)]
    async fn retryable_errors_are_retried_with_back_off_and_success_returns() {
        let tries = AtomicU32::new(0);
        let start = Instant::now();
        let r = policy()
            .run(Op::SqsDeleteMessageBatch, On::Unnamed, Duration::ZERO, || async {
                if tries.fetch_add(1, Ordering::Relaxed) < 3 {
                    Err(Error::Service { service: Service::Sqs, operation: "DeleteMessageBatch", detail: "503".into(), retryable: true, source: None })
                } else {
                    Ok(7)
                }
            })
            .await;
        assert_eq!(r.unwrap(), 7);
        assert_eq!(tries.load(Ordering::Relaxed), 4);
        // Full jitter: at most 100 + 200 + 400 ms of back-off.
        assert!(start.elapsed() <= Duration::from_millis(700), "{:?}", start.elapsed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_error_is_returned_at_once() {
        let tries = AtomicU32::new(0);
        let r: Result<()> = policy()
            .run(Op::S3GetObject, On::Unnamed, Duration::ZERO, || async {
                tries.fetch_add(1, Ordering::Relaxed);
                Err(Error::Corrupt("bad".into()))
            })
            .await;
        assert!(matches!(r, Err(Error::Corrupt(_))));
        assert_eq!(tries.load(Ordering::Relaxed), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_poll_gets_its_wait_on_top_of_the_attempt_timeout() {
        let r = policy()
            .run(Op::SqsReceiveMessage, On::Unnamed, Duration::from_secs(20), || async {
                tokio::time::sleep(Duration::from_secs(21)).await;
                Ok(())
            })
            .await;
        assert!(r.is_ok(), "a 21 s long poll fits 20 s + 2 s");
    }

    /// A call's line names its resource and the condition keys the request carries: what the IAM test
    /// evaluates.
    #[test]
    fn a_calls_line_names_its_resource_and_condition_keys() {
        let b = "billing-fleet";
        assert_eq!(call_line(Op::SqsReceiveMessage, On::Queue("billing-results-1")), "sqs.ReceiveMessage\tbilling-results-1");
        assert_eq!(call_line(Op::S3HeadBucket, On::bucket(b)), "s3.HeadBucket\tbilling-fleet");
        assert_eq!(call_line(Op::S3ListObjectsV2, On::Bucket { bucket: b, prefix: Some("open/") }), "s3.ListObjectsV2\tbilling-fleet\ts3:prefix=open/");
        assert_eq!(call_line(Op::S3GetObject, On::object(b, "jobs/j/manifest.json")), "s3.GetObject\tbilling-fleet/jobs/j/manifest.json");
        let put = |cond| call_line(Op::S3PutObject, On::Object { bucket: b, key: "jobs/j/manifest.json", cond });
        assert_eq!(put(Some(Precondition::IfNoneMatch)), "s3.PutObject\tbilling-fleet/jobs/j/manifest.json\ts3:if-none-match=*");
        assert_eq!(put(Some(Precondition::IfMatch)), "s3.PutObject\tbilling-fleet/jobs/j/manifest.json\ts3:if-match=<etag>");
        assert_eq!(call_line(Op::SqsStartMessageMoveTask, On::Move { from: "q-dlq", to: "q" }), "sqs.StartMessageMoveTask\tq-dlq\tdestination=q");
        assert_eq!(call_line(Op::AmqpPublish, On::Unnamed), "amqp.basic.publish");
    }

    #[test]
    fn jitter_stays_within_the_cap() {
        for _ in 0..1000 {
            assert!(jitter(Duration::from_millis(300)) <= Duration::from_millis(300));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn flags_reject_absurd_values() {
        assert!(positive_secs("0").is_err());
        assert!(positive_secs("-1").is_err());
        assert!(positive_secs("NaN").is_err());
        assert!(positive_secs("1e300").is_err());
        assert_eq!(positive_secs("2.5"), Ok(2.5));
        let p = CallArgs { call_attempt_timeout: 5.0, call_deadline: 1.0 }.policy();
        assert_eq!(p.deadline, Duration::from_secs(5), "the deadline is never shorter than one attempt");
    }

    /// The call metrics: one histogram observation per call (not per attempt), its retries, and its
    /// error under `outage` = whether the dependency failed.
    #[tokio::test(start_paused = true)]
    async fn calls_are_observed_by_operation_with_their_retries_and_errors() {
        let op = Op::SqsChangeMessageVisibilityBatch; // called by no other test of this process
        let tries = AtomicU32::new(0);
        let ok = policy()
            .run(op, On::Unnamed, Duration::ZERO, || async {
                if tries.fetch_add(1, Ordering::Relaxed) < 2 {
                    Err(Error::Service { service: Service::Sqs, operation: op.name(), detail: "503".into(), retryable: true, source: None })
                } else {
                    Ok(())
                }
            })
            .await;
        assert!(ok.is_ok());
        let bad: Result<()> = policy().once(op, On::Unnamed, Duration::ZERO, async { Err(Error::Corrupt("x".into())) }).await;
        assert!(bad.is_err());
        let mut reg = prometheus_client::registry::Registry::default();
        crate::metrics::register_calls(&mut reg);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        let series =
            |name: &str| -> Option<String> { text.lines().find(|l| l.starts_with(name)).map(|l| l.rsplit(' ').next().unwrap_or_default().to_string()) };
        let l = r#"{dependency="sqs",operation="ChangeMessageVisibilityBatch""#;
        assert_eq!(series(&format!("fleet_call_seconds_count{l}}}")).as_deref(), Some("2"), "{text}");
        assert_eq!(series(&format!("fleet_call_retries_total{l}}}")).as_deref(), Some("2"), "{text}");
        assert_eq!(series(&format!(r#"fleet_call_errors_total{l},outage="false"}}"#)).as_deref(), Some("1"), "{text}");
        assert_eq!(series(&format!(r#"fleet_call_errors_total{l},outage="true"}}"#)).as_deref(), Some("0"), "{text}");
        assert_eq!(series(&format!("fleet_call_cancelled_total{l}}}")).as_deref(), Some("0"), "{text}");
        // A call its caller gives up (a timeout around it) is observed too, as cancelled.
        let cut = tokio::time::timeout(Duration::from_secs(1), policy().once(op, On::Unnamed, Duration::ZERO, std::future::pending::<Result<()>>())).await;
        assert!(cut.is_err());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        let series =
            |name: &str| -> Option<String> { text.lines().find(|l| l.starts_with(name)).map(|l| l.rsplit(' ').next().unwrap_or_default().to_string()) };
        assert_eq!(series(&format!("fleet_call_cancelled_total{l}}}")).as_deref(), Some("1"), "{text}");
        assert_eq!(series(&format!("fleet_call_seconds_count{l}}}")).as_deref(), Some("3"), "{text}");
    }

    /// A `counted` scope sees what the clients count within it (and only that), nested scopes
    /// included; the clients' own counters everything.
    #[tokio::test]
    async fn a_counted_scope_sees_the_clients_counts_made_within_it() {
        let client = CallCounter::default();
        client.bump(Op::S3GetObject);
        let (inner, scope) = counted(async {
            client.bump(Op::S3GetObject);
            client.add(Billed::Extra64KiB { fifo: false }, 2);
            tokio::task::yield_now().await;
            let ((), inner) = counted(async { client.bump(Op::S3PutObject) }).await;
            inner
        })
        .await;
        assert_eq!(inner.total(), 1, "a nested scope sees its own");
        client.bump(Op::S3PutObject);
        let want: RequestCounts =
            [(Billed::call(Op::S3GetObject), 1), (Billed::call(Op::S3PutObject), 1), (Billed::Extra64KiB { fifo: false }, 2)].into_iter().collect();
        assert_eq!(scope, want);
        let all = client.snapshot();
        assert_eq!((all.calls(Op::S3GetObject), all.calls(Op::S3PutObject)), (2, 2));
    }

    /// A client's calls are billed where they are bounded: one per attempt, a FIFO queue's apart.
    #[tokio::test(start_paused = true)]
    async fn every_attempt_of_a_guarded_call_is_billed() {
        let fifo = Guarded { fifo: true, ..Guarded::new(policy()) };
        let tries = AtomicU32::new(0);
        let r = fifo
            .run(Op::SqsDeleteMessageBatch, On::Unnamed, Duration::ZERO, || async {
                if tries.fetch_add(1, Ordering::Relaxed) < 2 {
                    Err(Error::Service { service: Service::Sqs, operation: "DeleteMessageBatch", detail: "503".into(), retryable: true, source: None })
                } else {
                    Ok(())
                }
            })
            .await;
        assert!(r.is_ok());
        let _ = fifo.once(Op::SqsReceiveMessage, On::Unnamed, Duration::ZERO, async { Ok(()) }).await;
        let want: RequestCounts =
            [(Billed::Call { op: Op::SqsDeleteMessageBatch, fifo: true }, 3), (Billed::Call { op: Op::SqsReceiveMessage, fifo: true }, 1)]
                .into_iter()
                .collect();
        assert_eq!(fifo.calls.snapshot(), want);
    }
}
