//! Test support shared by the crates' integration tests: a uniquely named fleet (queues, DLQs,
//! bucket, trigger exchange) on the LocalStack and RabbitMQ that `deploy/test.sh` starts, generated
//! input and the expected totals computed in one process, a freezable TCP proxy, and the path of a
//! workspace binary. It depends on no service crate: the services are started by the tests that need
//! them (deploy/e2e).
//!
//! Without LocalStack or RabbitMQ, [`stack`] says so in one line (once per test binary) and returns
//! `None`, so those tests end at once; with `FLEET_REQUIRE_STACK=1` (deploy/test.sh, CI) a missing stack
//! fails them instead.

pub mod promtool;
pub mod proxy;
pub mod tls;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fleet_domain::billing::{money, Tariff, Totals};
use fleet_domain::input::{InputFile, Validator};
use fleet_domain::report::Report;
use fleet_io::blob::{BlobStore, S3Store};
use fleet_io::config::{Aws, FleetArgs};
use fleet_io::provision::{ensure_fleet, QueueSettings};
use fleet_io::queue::{Queue, SqsQueue};

pub const LOCALSTACK: &str = "http://127.0.0.1:4566";

/// The lease owner name of the controllers `Stack::start_controller` starts: one controller restarted
/// (its leases are its own again at once).
pub const TEST_CONTROLLER: &str = "test-controller";

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub struct Stack {
    pub aws: Aws,
    pub names: FleetArgs,
    pub work: Arc<SqsQueue>,
    pub work_dlq: Arc<SqsQueue>,
    pub results: Arc<SqsQueue>,
    pub results_dlq: Arc<SqsQueue>,
    pub store: Arc<S3Store>,
    /// The work queue's shards with their dead-letter queues (shard 0 is `work`, `work_dlq`).
    pub shards: Vec<(Arc<SqsQueue>, Arc<SqsQueue>)>,
    /// The results queue's partitions with their dead-letter queues (partition 0 is `results`,
    /// `results_dlq`).
    pub partitions: Vec<(Arc<SqsQueue>, Arc<SqsQueue>)>,
}

/// Creates a fresh fleet with unique names; `None` when LocalStack or RabbitMQ is not running (see the
/// crate's documentation).
pub async fn stack(settings: QueueSettings) -> Option<Stack> {
    stack_of(FleetArgs::defaults(), settings).await
}

/// The services' logs on stderr when `FLEET_TEST_LOG` is set (its value is the filter, as `RUST_LOG`),
/// for a test that fails without saying why; once per test binary (every stack turns it on).
pub fn test_log() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if let Ok(filter) = std::env::var("FLEET_TEST_LOG") {
            std::mem::forget(fleet_io::telemetry::init(false, &filter));
        }
    });
}

/// Creates a fresh fleet with unique names and its work queue in `n` shards (on FIFO queues if `fifo`).
pub async fn sharded_stack(n: u16, fifo: bool, settings: QueueSettings) -> Option<Stack> {
    let base = if fifo { FleetArgs::defaults().fifo() } else { FleetArgs::defaults() };
    stack_of(base.sharded(n), settings).await
}

/// Creates a fresh fleet with unique names and its results queue in `n` partitions.
pub async fn partitioned_stack(n: u16, settings: QueueSettings) -> Option<Stack> {
    stack_of(FleetArgs::defaults().partitioned(n), settings).await
}

/// Creates a fresh fleet with unique names on a FIFO work queue (and FIFO work dead-letter queue).
pub async fn fifo_stack(settings: QueueSettings) -> Option<Stack> {
    stack_of(FleetArgs::defaults().fifo(), settings).await
}

/// Whether LocalStack and RabbitMQ answer on their ports. When they do not: with `FLEET_REQUIRE_STACK`
/// set this panics; otherwise it says so in one line, once per test binary, and the caller skips.
pub fn stack_running() -> bool {
    static UP: OnceLock<bool> = OnceLock::new();
    let up = *UP.get_or_init(|| {
        let listening = |addr: &str| std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1)).is_ok();
        let amqp = amqp_url();
        let rabbit = amqp.rsplit('@').next().unwrap_or("127.0.0.1:5672").split('/').next().unwrap_or("127.0.0.1:5672").replace("localhost", "127.0.0.1");
        listening(LOCALSTACK.trim_start_matches("http://")) && listening(&rabbit)
    });
    if !up {
        static SAID: std::sync::Once = std::sync::Once::new();
        let why = format!(
            "tests that need LocalStack ({LOCALSTACK}) and RabbitMQ ({}) return at once (unit tests need neither); start both with deploy/test.sh (or localstack/start.sh and deploy/rabbitmq.sh)",
            fleet_io::trigger::redact_url(&amqp_url())
        );
        assert!(std::env::var_os("FLEET_REQUIRE_STACK").is_none(), "FLEET_REQUIRE_STACK is set but {why}");
        // Written past the test harness's capture, so it shows once in `cargo test`'s output.
        SAID.call_once(|| {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "note: {why}");
        });
    }
    up
}

/// Creates a fresh fleet with unique names from `base` (shards, partitions, FIFO as it says).
pub async fn stack_of(base: FleetArgs, settings: QueueSettings) -> Option<Stack> {
    if !stack_running() {
        return None;
    }
    test_log();
    let aws = Aws::local_or_env(LOCALSTACK).await;
    let suffix = uuid::Uuid::now_v7().simple().to_string();
    let mut names = base.with_suffix(&suffix[suffix.len() - 12..]);
    names.amqp_url = amqp_url();
    ensure_fleet(&aws, &names, settings)
        .await
        .unwrap_or_else(|e| panic!("cannot create test resources on {LOCALSTACK} ({e}); start the stack with deploy/test.sh"));
    let store = aws.store(&names.bucket);
    let shards = aws.work_shards(&names, aws.policy).await.unwrap();
    let partitions = aws.open_results_partitions(&names, aws.policy).await.unwrap();
    Some(Stack {
        work: shards[0].0.clone(),
        work_dlq: shards[0].1.clone(),
        shards,
        results: partitions[0].0.clone(),
        results_dlq: partitions[0].1.clone(),
        partitions,
        store,
        names,
        aws,
    })
}

impl Stack {
    /// The work queue and its dead-letter queue as the fleet's binaries open them: one queue each, or
    /// its shards as one [`fleet_io::queue::Sharded`] queue.
    pub fn work_queues(&self) -> (Arc<dyn Queue>, Arc<dyn Queue>) {
        fleet_io::queue::Sharded::pairs(&self.shards).expect("a stack has at least one shard")
    }

    /// The results queue and its dead-letter queue as the fleet's binaries open them: one queue each,
    /// or its partitions as one [`fleet_io::queue::Sharded`] queue.
    pub fn results_queues(&self) -> (Arc<dyn Queue>, Arc<dyn Queue>) {
        fleet_io::queue::Sharded::pairs(&self.partitions).expect("a stack has at least one partition")
    }

    /// Where a job stands, for a test that waited for it in vain: every queue's depth, and the job's
    /// checkpoint (status, chunks accounted, seal, finishing), lease and open marker as the store
    /// holds them.
    pub async fn diagnose(&self, job_id: &str) -> String {
        use fleet_domain::layout::{checkpoint_key, lease_key, open_key};
        let mut out = Vec::new();
        let mut queues: Vec<&SqsQueue> = self.shards.iter().flat_map(|(q, dlq)| [q.as_ref(), dlq.as_ref()]).collect();
        queues.extend([self.results.as_ref(), self.results_dlq.as_ref()]);
        for q in queues {
            out.push(format!("queue {}: {:?}", q.name(), q.depth().await));
        }
        let cp = match self.store.get(&checkpoint_key(job_id)).await {
            Ok(Some(b)) => match fleet_domain::codec::from_zstd_json::<fleet_domain::model::Checkpoint>(&b, 1 << 30) {
                Ok(c) => format!(
                    "status {:?}, sealed with {:?} chunks, {} accounted {:?}, {} failed, finishing {}, updated {}",
                    c.status,
                    c.total_chunks,
                    c.accounted.len(),
                    c.accounted,
                    c.failed_chunks.len(),
                    c.finishing,
                    c.updated_at
                ),
                Err(e) => format!("unreadable: {e}"),
            },
            other => format!("{other:?}"),
        };
        out.push(format!("checkpoint: {cp}"));
        let lease = self.store.get(&lease_key(job_id)).await.map(|b| b.map(|b| String::from_utf8_lossy(&b).into_owned()));
        out.push(format!("lease: {lease:?} (now {} ms)", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis()));
        out.push(format!("open marker: {:?}", self.store.get(&open_key(job_id)).await.map(|b| b.is_some())));
        out.join("\n")
    }

    /// Polls until the queue shows `visible` messages and nothing in flight.
    pub async fn wait_depth(&self, q: &dyn Queue, visible: u64, timeout: Duration) {
        let start = Instant::now();
        loop {
            let d = q.depth().await.unwrap();
            if d.visible == visible && d.in_flight == 0 {
                return;
            }
            assert!(start.elapsed() < timeout, "queue {} depth {d:?}, wanted {visible} visible", q.name());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

pub fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

pub fn generated(dir: &Path, name: &str, rows: u64, accounts: u64, seed: u64) -> PathBuf {
    let p = dir.join(name);
    let mut f = std::fs::File::create(&p).unwrap();
    fleet_domain::generate::write_csv(&mut f, rows, accounts, seed, false).unwrap();
    p
}

/// The expected per-account rows, computed in one process with no queues.
pub fn expected_accounts(files: &[PathBuf]) -> Vec<(String, String, u64, String, String, String)> {
    let calc = Tariff::default().calculator();
    let mut totals = Totals::new();
    let mut v = Validator::new();
    for f in files {
        v.read(&InputFile::open(f).unwrap(), |t| totals.add_txn(t, &calc), |_| {}, |_| {}).unwrap();
    }
    totals.rows().into_iter().map(|r| (r.account_id.clone(), r.currency.clone(), r.count, money(r.gross, &r.currency), money(r.fees, &r.currency), money(r.net(), &r.currency))).collect()
}

pub fn report_accounts(r: &Report) -> Vec<(String, String, u64, String, String, String)> {
    r.accounts.iter().map(|a| (a.account_id.clone(), a.currency.clone(), a.count, a.gross.clone(), a.fees.clone(), a.net.clone())).collect()
}

/// The account rows of several reports added up (what a customer is billed over those jobs), in the
/// form of [`expected_accounts`].
pub fn summed_accounts(reports: &[&Report]) -> Vec<(String, String, u64, String, String, String)> {
    let mut sums: std::collections::BTreeMap<(String, String), (u64, rust_decimal::Decimal, rust_decimal::Decimal)> = Default::default();
    for r in reports {
        for a in &r.accounts {
            let s = sums.entry((a.account_id.clone(), a.currency.clone())).or_default();
            s.0 += a.count;
            s.1 += a.gross.parse::<rust_decimal::Decimal>().unwrap();
            s.2 += a.fees.parse::<rust_decimal::Decimal>().unwrap();
        }
    }
    sums.into_iter().filter(|(_, s)| s.0 > 0).map(|((a, c), (n, g, f))| { let (g2, f2, n2) = (money(g, &c), money(f, &c), money(g - f, &c)); (a, c, n, g2, f2, n2) }).collect()
}

/// The arithmetic identities every report must satisfy.
pub fn assert_consistent(r: &Report) {
    let t = &r.transactions;
    assert_eq!(t.submitted, t.accepted + t.rejected, "submitted = accepted + rejected");
    assert_eq!(t.accepted, t.processed + t.failed + t.duplicates, "accepted = processed + failed + duplicates");
    assert_eq!(t.duplicates as usize, r.rejected.iter().filter(|x| x.reason.starts_with("txn_id: already billed by job")).count(), "each duplicate listed");
    assert_eq!(r.accounts.iter().map(|a| a.count).sum::<u64>(), t.processed);
    assert_eq!(r.totals.iter().map(|c| c.count).sum::<u64>(), t.processed);
    assert_eq!(t.failed, r.failed_chunks.iter().map(|f| f.transactions).sum::<u64>());
}

/// A work item as it came off a FIFO queue: its group, chunk number and `(account, txn_id)` rows.
pub struct Delivered {
    pub group: String,
    pub chunk: u32,
    pub rows: Vec<(String, String)>,
}

/// Receives and deletes every work item of a FIFO work queue, in delivery order, with its chunk's rows.
pub async fn drain_fifo(work: &dyn Queue, store: &dyn fleet_io::blob::BlobStore) -> Vec<Delivered> {
    let mut out = Vec::new();
    loop {
        let msgs = work.receive(10, Duration::from_secs(1)).await.unwrap();
        if msgs.is_empty() {
            return out;
        }
        for m in &msgs {
            let item: fleet_domain::model::WorkItem = serde_json::from_str(&m.body).unwrap();
            let data = store.get(&item.blob.key).await.unwrap().expect("chunk blob");
            let mut rows = Vec::new();
            fleet_domain::codec::decode_chunk(&data, &item.blob, item.transactions, 1 << 30, |t| rows.push((t.account_id.to_string(), t.txn_id.to_string())))
                .unwrap();
            out.push(Delivered { group: m.attrs.group.clone().expect("a FIFO message has a group"), chunk: item.chunk, rows });
        }
        work.delete(msgs).await.unwrap();
    }
}

/// Every account's transactions are in one message group, and that group delivers them in file order.
pub fn assert_accounts_in_order(delivered: &[Delivered], files: &[PathBuf]) {
    use std::collections::HashMap;
    let mut want: HashMap<String, Vec<String>> = HashMap::new();
    let mut v = Validator::new();
    for f in files {
        v.read(&InputFile::open(f).unwrap(), |t| want.entry(t.account_id.to_string()).or_default().push(t.txn_id.to_string()), |_| {}, |_| {}).unwrap();
    }
    let mut got: HashMap<String, Vec<String>> = HashMap::new();
    let mut group_of: HashMap<String, String> = HashMap::new();
    let mut last_chunk: HashMap<String, u32> = HashMap::new();
    for d in delivered {
        if let Some(prev) = last_chunk.insert(d.group.clone(), d.chunk) {
            assert!(prev < d.chunk, "group {} delivered chunk {} after chunk {prev}", d.group, d.chunk);
        }
        for (account, txn) in &d.rows {
            let g = group_of.entry(account.clone()).or_insert_with(|| d.group.clone());
            assert_eq!(g, &d.group, "account {account} is in two groups");
            got.entry(account.clone()).or_default().push(txn.clone());
        }
    }
    assert_eq!(got.len(), want.len(), "every account delivered");
    for (account, txns) in &want {
        assert_eq!(got.get(account), Some(txns), "account {account}: transactions out of file order");
    }
}

/// The path of a workspace binary (`processor`, `controller`, `initiator`, `scaling-agent`) of the
/// profile these tests were built with, built first when it is missing (`cargo test -p` builds only the
/// binaries of the package under test).
pub fn bin(name: &str) -> PathBuf {
    // target/{profile}/deps/{test binary} -> target/{profile}/{name}
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(Path::parent).expect("target/{profile}");
    let path = dir.join(name);
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    if !path.exists() {
        let profile = dir.file_name().and_then(|p| p.to_str()).unwrap_or("debug");
        let mut cmd = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        // The package of each binary has its name; -p picks it from any directory of the workspace.
        cmd.args(["build", "-p", name, "--bin", name]);
        if profile == "release" {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success() && path.exists(), "cannot build {name} ({status})");
    }
    path
}
