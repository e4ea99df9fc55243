//! Unit tests of the aggregation rules with the in-memory blob store.

use super::limits::FAILING_FOR;
use super::*;
use bytes::Bytes;
use controller_core::limits::MAX_PARTS;
use fleet_domain::billing::AccountTotals;
use fleet_domain::billing::Tariff;
use fleet_domain::codec::{accounts_to_zstd_csv, from_zstd_json, sha256_hex, to_zstd_json};
use fleet_domain::layout::{accounts_key, checkpoint_key, checkpoint_parts_prefix, manifest_key, open_key, quarantined_checkpoint_key, report_key};
use fleet_domain::model::JobStatus;
use fleet_domain::model::{now_rfc3339, BlobRef, ChunkRecord, ChunkResult, Rejected};
use fleet_domain::model::{AccountsPayload, Checkpoint, CheckpointPart, ChunkOutcome, Manifest, Progress, ResultMessage, WorkItem};
use fleet_domain::report;
use fleet_domain::requests::RequestCounts;
use fleet_engine::completion::BatchSettings;
use fleet_engine::Completions;
use fleet_io::blob::Cond;
use fleet_io::error::Error;
use fleet_io::error::Result;
use fleet_io::lock;
use fleet_io::memory::{Hook, Hooked, MemoryQueue, MemoryStore, Put};
use fleet_io::queue::{Delivery, Message, Queue};
use rust_decimal::Decimal;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;

mod checkpoints;
mod claims;
mod controllers;
mod exactness;
mod expiry;
mod outage;
mod records;
mod requests;

fn manifest(job: &str, chunks: &[u64]) -> Manifest {
    Manifest {
        chunk_lines: Vec::new(),
        completes: None,
        partition: 0,
        v: 1,
        job_id: job.into(),
        created_at: now_rfc3339(),
        files: vec!["in.csv".into()],
        submitted: chunks.iter().sum::<u64>() + 1,
        accepted: chunks.iter().sum(),
        rejected: vec![Rejected { file: "in.csv".into(), line: 3, txn_id: None, reason: "txn_id: empty".into() }],
        total_chunks: chunks.len() as u32,
        chunk_transactions: chunks.to_vec(),
        tariff: Tariff::default(),
        requests: RequestCounts::default(),
    }
}

fn acct(a: &str, n: u64, gross_cents: i64, fee_cents: i64) -> AccountTotals {
    AccountTotals { account_id: a.into(), currency: "EUR".into(), count: n, gross: Decimal::new(gross_cents, 2), fees: Decimal::new(fee_cents, 2) }
}

fn sealed(job: &str, total: u32) -> Message {
    msg(serde_json::to_string(&ResultMessage::Sealed { v: 1, job_id: job.into(), total_chunks: total }).unwrap())
}

fn result(job: &str, chunk: u32, accounts: Vec<AccountTotals>) -> Message {
    // Wrapping, as a hostile sender's would.
    let n = accounts.iter().fold(0u64, |n, a| n.wrapping_add(a.count));
    let r = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: job.into(),
        chunk,
        transactions: n,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts } },
        requests: RequestCounts::default(),
    });
    msg(serde_json::to_string(&r).unwrap())
}

fn msg(body: String) -> Message {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Message { id: format!("m{n}"), body, receive_count: 1, ..Default::default() }
}

/// The messages as deliveries from `source`'s queue (an in-memory one that does not hold them: their
/// completions go nowhere), kept as the controller's handler keeps them.
fn keep(source: Source, msgs: &[Message]) -> Vec<Kept> {
    let queue = MemoryQueue::new(source.default_queue(), Duration::from_secs(30));
    let done = Completions::start(queue, BatchSettings::default());
    msgs.iter().map(|m| done.keep(Delivery::new(m.clone(), format!("r-{}", m.id)))).collect()
}

/// An aggregator that finishes a job with failed chunks at once (no settle time), as these tests
/// expect; the settle time has tests of its own.
fn quick(store: Arc<dyn BlobStore>) -> Aggregator {
    quick_with(store, Options::default())
}

/// [`quick`], set up as `options` say otherwise.
fn quick_with(store: Arc<dyn BlobStore>, options: Options) -> Aggregator {
    Aggregator::with(store, Options { settle: Duration::ZERO, ..options })
}

fn quick_owned(store: Arc<dyn BlobStore>, owner: String, lease: Duration) -> Aggregator {
    quick_with(store, Options { owner, lease, ..Options::default() })
}

/// Options naming results partitions' queues (`billing-results`, `billing-results-1`, ...).
fn partitioned(queues: &[&str]) -> HashMap<String, u16> {
    queues.iter().enumerate().map(|(p, q)| (q.to_string(), p as u16)).collect()
}

/// A chunk blob of `n` rows with ids of the job's own (`{job}-{chunk}-{i}`), as the initiator
/// stores it (zstd CSV): what a finish reads again to claim its rows.
fn chunk_blob(job: &str, chunk: u32, n: u64) -> Bytes {
    let mut csv = String::from("txn_id,account_id,amount,currency,timestamp\n");
    for i in 0..n {
        csv.push_str(&format!("{job}-{chunk}-{i},a,1.00,EUR,2026-12-01T10:00:00Z\n"));
    }
    Bytes::from(zstd::bulk::compress(csv.as_bytes(), 1).unwrap())
}

/// The chunk blobs of a job's first `n` chunks (written by the initiator before their work items).
async fn put_chunks(store: &MemoryStore, job: &str, n: u32) {
    for c in 0..n {
        store.put(&fleet_domain::layout::chunk_key(job, c), chunk_blob(job, c, 1), "application/zstd").await.unwrap();
    }
}

/// The chunk blobs with their records (transactions; a generous size), as the initiator writes them.
async fn put_records(store: &MemoryStore, job: &str, chunks: &[u64]) {
    for (c, &n) in chunks.iter().enumerate() {
        let record = ChunkRecord { transactions: n, raw_bytes: 100 * n, partition: None };
        let key = fleet_domain::layout::chunk_key(job, c as u32);
        store.put_if(&key, chunk_blob(job, c as u32, n), "application/zstd", &record.to_meta(), &Cond::Any).await.unwrap();
    }
}

/// The manifest, and the chunk blobs the initiator writes before it enqueues their work items (a
/// result for a chunk without one is not counted before the seal).
async fn put_manifest(store: &MemoryStore, m: &Manifest) {
    put_records(store, &m.job_id, &m.chunk_transactions).await;
    store.put(&manifest_key(&m.job_id), Bytes::from(serde_json::to_vec(m).unwrap()), "application/json").await.unwrap();
}

async fn report_of(store: &MemoryStore, job: &str) -> Option<report::Report> {
    store.get(&report_key(job)).await.unwrap().map(|b| serde_json::from_slice(&b).unwrap())
}

fn dead_letter(job: &str, chunk: u32, transactions: u64) -> Message {
    let item = WorkItem {
        partition: 0,
        v: 1,
        job_id: job.into(),
        chunk,
        transactions,
        blob: BlobRef { key: fleet_domain::layout::chunk_key(job, chunk), sha256: "0".repeat(64), compressed_bytes: 1, raw_bytes: 1 },
        tariff: Tariff::default(),
    };
    msg(serde_json::to_string(&item).unwrap())
}

fn failed(job: &str, chunk: u32, transactions: u64, reason: &str) -> Message {
    let r = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: job.into(),
        chunk,
        transactions,
        outcome: ChunkOutcome::Failed { reason: reason.into() },
        requests: RequestCounts::default(),
    });
    msg(serde_json::to_string(&r).unwrap())
}

fn with_payload(job: &str, chunk: u32, transactions: u64, payload: AccountsPayload) -> Message {
    let r = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: job.into(),
        chunk,
        transactions,
        outcome: ChunkOutcome::Processed { payload },
        requests: RequestCounts::default(),
    });
    msg(serde_json::to_string(&r).unwrap())
}

fn abandon(job: &str) -> Message {
    msg(serde_json::to_string(&ResultMessage::Abandon { v: 1, job_id: job.into(), reason: "operator".into() }).unwrap())
}

/// Calls on one job's objects (or on all, while `down`) fail at once, as after a call deadline;
/// counted.
struct Broken {
    /// The store the calls reach.
    memory: Arc<MemoryStore>,
    job: &'static str,
    failed: AtomicUsize,
    down: std::sync::atomic::AtomicBool,
    /// The breaker its S3 client would have (none: the store has none).
    breaker: Option<Arc<fleet_io::breaker::Breaker>>,
}

type BrokenStore = Hooked<Broken>;

impl Broken {
    fn with(job: &'static str, breaker: Option<Arc<fleet_io::breaker::Breaker>>) -> Arc<BrokenStore> {
        let memory = MemoryStore::new();
        Hooked::new(memory.clone(), Broken { memory, job, failed: AtomicUsize::new(0), down: Default::default(), breaker })
    }

    fn new(job: &'static str) -> Arc<BrokenStore> {
        Broken::with(job, None)
    }

    /// With a breaker whose probe asks the store (as the S3 client's does).
    fn with_breaker(job: &'static str) -> Arc<BrokenStore> {
        let breaker = fleet_io::breaker::Breaker::new(fleet_io::error::Service::S3, Default::default());
        let store = Broken::with(job, Some(breaker.clone()));
        let weak = Arc::downgrade(&store);
        breaker.set_probe(Arc::new(move || {
            let weak = weak.clone();
            Box::pin(async move {
                match weak.upgrade() {
                    Some(s) => s.check("probe"),
                    None => Ok(()),
                }
            })
        }));
        store
    }

    fn check(&self, key: &str) -> Result<()> {
        let r = if key.contains(self.job) || self.down.load(Ordering::Relaxed) {
            self.failed.fetch_add(1, Ordering::Relaxed);
            Err(Error::Timeout { service: fleet_io::error::Service::S3, operation: "GetObject", after: Duration::from_secs(30), attempts: 3 })
        } else {
            Ok(())
        };
        if let Some(b) = &self.breaker {
            b.record(&r);
        }
        r
    }
}

#[async_trait::async_trait]
impl Hook for Broken {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        self.check(put.key)?;
        put.to(inner).await
    }
    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        self.check(key)?;
        inner.get_tagged(key).await
    }
    async fn head(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        self.check(key)?;
        inner.head(key).await
    }
    async fn delete(&self, inner: &dyn BlobStore, key: &str) -> Result<()> {
        self.check(key)?;
        inner.delete(key).await
    }
    fn breaker(&self, _inner: &dyn BlobStore) -> Option<Arc<fleet_io::breaker::Breaker>> {
        self.breaker.clone()
    }
}

/// The transactions rows add up to (a chunk's count, as its record gives it).
fn count_of(rows: &[AccountTotals]) -> u64 {
    rows.iter().map(|a| a.count).sum()
}

fn many(prefix: &str, n: usize, cents: i64) -> Vec<AccountTotals> {
    // Amounts that differ from row to row, as real ones do (identical rows compress to nothing).
    (0..n).map(|i| acct(&format!("{prefix}{i:06}"), 1 + (i as u64 * 7) % 13, cents + (i as i64 * 7919) % 1_000_003, (i as i64 * 31) % 997)).collect()
}

/// The quarantined messages of a job (their reasons), from the quarantine of unreadable messages.
async fn quarantined_of(store: &MemoryStore, job: &str) -> Vec<String> {
    let mut out = Vec::new();
    for key in fleet_io::quarantine::list(store, 1000).await.unwrap() {
        let q = fleet_io::quarantine::read(store, &key).await.unwrap().unwrap();
        if q.body.contains(&format!("\"job_id\":\"{job}\"")) {
            out.push(q.reason);
        }
    }
    out
}

fn one_of(job: &str, c: u32) -> Message {
    result(job, c, vec![acct("a", 1, 100, 1)])
}

/// Job `s` (two chunks) on a store that stops answering when told, its results queue as partition 0.
async fn partition_zero_fixture() -> (Arc<BrokenStore>, Arc<MemoryQueue>, Completions, Aggregator) {
    let store = Broken::with_breaker("no-such-job");
    put_manifest(&store.memory, &manifest("s", &[1, 1])).await;
    let queue = MemoryQueue::new("billing-results", Duration::from_secs(30));
    let done = Completions::start(queue.clone(), BatchSettings::default());
    let options = Options { owner: "c".into(), lease: Duration::from_secs(30), partition_queues: partitioned(&["billing-results"]), ..Options::default() };
    let agg = quick_with(store.clone(), options);
    agg.reading().read(0);
    (store, queue, done, agg)
}
