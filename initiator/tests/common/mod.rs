//! Test harness: a uniquely named fleet (queues, DLQs, bucket, trigger exchange) on the LocalStack and
//! RabbitMQ that `deploy/test.sh` starts, with processor and controller running in-process.

#![allow(dead_code)]

pub mod proxy;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_domain::billing::{money, Tariff, Totals};
use fleet_domain::input::{InputFile, Validator};
use fleet_domain::report::Report;
use fleet_io::config::{Aws, FleetArgs};
use fleet_io::provision::{ensure_fleet, QueueSettings};
use fleet_io::queue::{Queue, SqsQueue};
use initiator::submit::{Clients, SubmitOptions, Submitted};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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
    pub store: Arc<fleet_io::blob::S3Store>,
}

/// Creates a fresh fleet with unique names.
pub async fn stack(settings: QueueSettings) -> Stack {
    stack_of(FleetArgs::defaults(), settings).await
}

/// Creates a fresh fleet with unique names on a FIFO work queue (and FIFO work dead-letter queue).
pub async fn fifo_stack(settings: QueueSettings) -> Stack {
    stack_of(FleetArgs::defaults().fifo(), settings).await
}

async fn stack_of(base: FleetArgs, settings: QueueSettings) -> Stack {
    let aws = Aws::local_or_env(LOCALSTACK).await;
    let suffix = uuid::Uuid::now_v7().simple().to_string();
    let mut names = base.with_suffix(&suffix[suffix.len() - 12..]);
    names.amqp_url = amqp_url();
    ensure_fleet(&aws, &names, settings)
        .await
        .unwrap_or_else(|e| panic!("cannot create test resources on {LOCALSTACK} ({e}); start the stack with deploy/test.sh"));
    let store = aws.store(&names.bucket);
    Stack {
        work: aws.queue(&names.work_queue).await.unwrap(),
        work_dlq: aws.queue(&names.work_dlq()).await.unwrap(),
        results: aws.queue(&names.results_queue).await.unwrap(),
        results_dlq: aws.queue(&names.results_dlq()).await.unwrap(),
        store,
        names,
        aws,
    }
}

pub struct Running {
    pub stop: CancellationToken,
    pub handle: JoinHandle<fleet_io::Result<()>>,
}

impl Running {
    /// Graceful stop: cancel and wait.
    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.unwrap().unwrap();
    }
}

impl Stack {
    pub fn clients(&self) -> Clients {
        Clients { work: self.work.clone(), results: self.results.clone(), store: self.store.clone(), triggers: self.names.trigger_bus() }
    }

    pub fn start_processor(&self, settings: processor::Settings) -> Running {
        let stop = CancellationToken::new();
        let deps = processor::Deps {
            work: self.work.clone(),
            work_dlq: Some(self.work_dlq.clone()),
            results: self.results.clone(),
            store: self.store.clone(),
            triggers: self.names.subscribe(vec![fleet_io::trigger::work_key(self.work.name())], &stop),
            publish: self.names.trigger_bus(),
        };
        let handle = tokio::spawn(processor::run(settings, deps, stop.clone()));
        Running { stop, handle }
    }

    /// The scaling agent, looking every second: it triggers when a queue turns non-empty, such as work
    /// items coming back after a killed processor's visibility timeout (nobody announces those).
    pub fn start_agent(&self) -> Running {
        let stop = CancellationToken::new();
        let watched = scaling_agent::Watched {
            work: self.work.clone(),
            work_dlq: self.work_dlq.clone(),
            results: self.results.clone(),
            results_dlq: self.results_dlq.clone(),
        };
        let deps = scaling_agent::Deps {
            watched,
            publish: self.names.trigger_bus(),
            subscription: None,
            backend: Arc::new(scaling_agent::backend::NoneBackend::new(0)),
        };
        let handle = tokio::spawn(scaling_agent::run(scaling_agent::Settings::quick(), deps, stop.clone()));
        Running { stop, handle }
    }

    /// A controller that follows triggers: idle, its listeners park after one empty 1 s poll and wake
    /// only on triggers (processors and the initiator announce what they put on its queues).
    pub fn start_controller(&self) -> Running {
        let stop = CancellationToken::new();
        let deps = controller::Deps {
            results: self.results.clone(),
            work_dlq: self.work_dlq.clone(),
            results_dlq: self.results_dlq.clone(),
            store: self.store.clone(),
            triggers: self
                .names
                .subscribe([self.results.name(), self.work_dlq.name(), self.results_dlq.name()].map(fleet_io::trigger::work_key).to_vec(), &stop),
            publish: self.names.trigger_bus(),
        };
        let settings = controller::Settings {
            listener: fleet_engine::args::ListenerArgs::quick(),
            drain_secs: 10,
            id: Some(TEST_CONTROLLER.into()),
            ..Default::default()
        };
        let handle = tokio::spawn(controller::run(settings, deps, stop.clone()));
        Running { stop, handle }
    }

    pub async fn submit(&self, files: &[PathBuf], chunk_size: u64) -> Submitted {
        self.submit_with(SubmitOptions { chunk_size, ..SubmitOptions::new(files.to_vec()) }).await
    }

    pub async fn submit_with(&self, opts: SubmitOptions) -> Submitted {
        initiator::submit::submit(opts, &self.clients()).await.expect("submit")
    }

    pub async fn wait_report(&self, s: &Submitted, timeout: Duration) -> Report {
        initiator::follow::wait(self.store.as_ref(), &s.job_id, s.total_chunks, timeout, false).await.expect("job finished in time")
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

/// Fast processor settings for tests.
pub fn fast_processor() -> processor::Settings {
    processor::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 10, ..Default::default() }
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
    totals.rows().into_iter().map(|r| (r.account_id.clone(), r.currency.clone(), r.count, money(r.gross), money(r.fees), money(r.net()))).collect()
}

pub fn report_accounts(r: &Report) -> Vec<(String, String, u64, String, String, String)> {
    r.accounts.iter().map(|a| (a.account_id.clone(), a.currency.clone(), a.count, a.gross.clone(), a.fees.clone(), a.net.clone())).collect()
}

/// The arithmetic identities every report must satisfy.
pub fn assert_consistent(r: &Report) {
    let t = &r.transactions;
    assert_eq!(t.submitted, t.accepted + t.rejected, "submitted = accepted + rejected");
    assert_eq!(t.accepted, t.processed + t.failed, "accepted = processed + failed");
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
        work.delete(&msgs.iter().map(|m| m.receipt.clone()).collect::<Vec<_>>()).await.unwrap();
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
