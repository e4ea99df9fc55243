//! Unit tests of the aggregation rules with the in-memory blob store.

use super::*;
use bytes::Bytes;
use controller_core::limits::MAX_PARTS;
use fleet_domain::billing::AccountTotals;
use fleet_domain::billing::Tariff;
use fleet_domain::codec::{accounts_to_zstd_csv, from_zstd_json, sha256_hex, to_zstd_json};
use fleet_domain::layout::{accounts_key, checkpoint_key, checkpoint_parts_prefix, manifest_key, open_key, quarantined_checkpoint_key, report_key};
use fleet_domain::model::{now_rfc3339, BlobRef, ChunkRecord, ChunkResult, Rejected};
use fleet_domain::model::{AccountsPayload, Checkpoint, CheckpointPart, ChunkOutcome, Manifest, Progress, ResultMessage, WorkItem};
use fleet_domain::report;
use fleet_domain::requests::RequestCounts;
use fleet_engine::completion::BatchSettings;
use fleet_engine::Completions;
use fleet_io::blob::Cond;
use fleet_io::error::Error;
use fleet_io::memory::{Hook, Hooked, MemoryQueue, MemoryStore};
use fleet_io::queue::{Delivery, Message, Queue};
use rust_decimal::Decimal;

fn manifest(job: &str, chunks: &[u64]) -> Manifest {
    Manifest {
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

/// The chunk blobs of a job's first `n` chunks (written by the initiator before their work items).
async fn put_chunks(store: &MemoryStore, job: &str, n: u32) {
    for c in 0..n {
        store.put(&fleet_domain::layout::chunk_key(job, c), Bytes::from_static(b"chunk"), "application/zstd").await.unwrap();
    }
}

/// The chunk blobs with their records (transactions; a generous size), as the initiator writes them.
async fn put_records(store: &MemoryStore, job: &str, chunks: &[u64]) {
    for (c, &n) in chunks.iter().enumerate() {
        let record = ChunkRecord { transactions: n, raw_bytes: 100 * n, partition: None };
        let key = fleet_domain::layout::chunk_key(job, c as u32);
        store.put_if(&key, Bytes::from_static(b"chunk"), "application/zstd", &record.to_meta(), &Cond::Any).await.unwrap();
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

#[tokio::test]
async fn duplicates_count_once_and_report_is_exact() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j1", &[2, 1])).await;
    let agg = quick(store.clone());
    let r0 = result("j1", 0, vec![acct("a", 2, 1000, 100)]);
    let applied = agg.apply(Source::Results, keep(Source::Results, &[r0.clone(), r0.clone()])).await;
    assert!(applied.delete.is_empty(), "nothing is deleted before a checkpoint covers it");
    assert_eq!(agg.pending(), 2);
    assert_eq!(agg.flush().await.len(), 2, "duplicates are deleted too, after the checkpoint");
    let meta = store.head(&checkpoint_key("j1")).await.unwrap().expect("checkpoint written");
    let p = fleet_domain::model::Progress::from_meta(&meta).expect("progress in the metadata");
    assert_eq!((p.status, p.accounted, p.failed, p.processed), (JobStatus::Running, 1, 0, 2));
    assert!(report_of(&store, "j1").await.is_none());
    agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r0))).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("j1", 1, vec![acct("a", 1, -500, 0)])])).await;
    assert!(report_of(&store, "j1").await.is_none(), "every chunk is in, but the job is not sealed yet");
    agg.apply(Source::Results, keep(Source::Results, &[sealed("j1", 2)])).await;
    let r = report_of(&store, "j1").await.expect("report written once sealed");
    assert_eq!(r.status, JobStatus::Complete);
    assert_eq!((r.transactions.processed, r.transactions.failed, r.transactions.rejected), (3, 0, 1));
    assert_eq!((r.accounts[0].count, r.accounts[0].gross.as_str(), r.accounts[0].net.as_str()), (3, "5.00", "4.00"));
    let csv = String::from_utf8(store.get(&accounts_key("j1")).await.unwrap().unwrap().to_vec()).unwrap();
    assert_eq!(csv.lines().nth(1), Some("a,EUR,3,5.00,1.00,4.00"));
    // A late duplicate after the report changes nothing.
    agg.apply(Source::Results, keep(Source::Results, &[r0])).await;
    assert_eq!(report_of(&store, "j1").await.unwrap().accounts, r.accounts);
}

#[tokio::test]
async fn restart_resumes_from_checkpoint() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j2", &[1, 1, 1])).await;
    let first = quick(store.clone());
    first.apply(Source::Results, keep(Source::Results, &[result("j2", 0, vec![acct("a", 1, 100, 33)]), sealed("j2", 3)])).await;
    first.apply(Source::Results, keep(Source::Results, &[result("j2", 1, vec![acct("b", 1, 200, 36)])])).await;
    first.flush().await; // checkpointed; then "crash" before the deletes
    first.apply(Source::Results, keep(Source::Results, &[result("j2", 2, vec![acct("a", 1, 300, 39)])])).await;
    drop(first); // chunk 2 was applied in memory only: lost with the crash, and not deleted
    let second = quick(store.clone());
    // chunk 1 is redelivered (its delete was lost), then chunk 2 arrives
    second.apply(Source::Results, keep(Source::Results, &[result("j2", 1, vec![acct("b", 1, 200, 36)]), result("j2", 2, vec![acct("a", 1, 300, 39)])])).await;
    let r = report_of(&store, "j2").await.unwrap();
    assert_eq!(r.transactions.processed, 3);
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.gross.as_str())).collect::<Vec<_>>(), [("a", 2, "4.00"), ("b", 1, "2.00")]);
}

#[tokio::test]
async fn dead_letter_makes_job_partial_and_failed_result_wins_once() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j3", &[4, 5])).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[sealed("j3", 2), result("j3", 0, vec![acct("a", 4, 400, 10)])])).await;
    let item = WorkItem {
        partition: 0,
        v: 1,
        job_id: "j3".into(),
        chunk: 1,
        transactions: 5,
        blob: BlobRef { key: fleet_domain::layout::chunk_key("j3", 1), sha256: "0".repeat(64), compressed_bytes: 1, raw_bytes: 1 },
        tariff: Tariff::default(),
    };
    agg.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[msg(serde_json::to_string(&item).unwrap())])).await;
    let r = report_of(&store, "j3").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert_eq!((r.transactions.processed, r.transactions.failed), (4, 5));
    assert_eq!(r.failed_chunks.len(), 1);
    assert_eq!(r.failed_chunks[0].chunk, 1);
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

#[tokio::test]
async fn a_real_result_beats_a_dead_letter_or_a_failure_report_in_either_order() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j9", &[2, 3, 4, 5])).await;
    let agg = quick(store.clone());
    let r1 = result("j9", 1, vec![acct("b", 3, 300, 30)]);
    let r2 = result("j9", 2, vec![acct("c", 4, 400, 40)]);
    // Chunk 1: dead-lettered (its delete failed after it was billed), then its real result.
    agg.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[dead_letter("j9", 1, 3)])).await;
    agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r1))).await;
    // Chunk 2: a failure report (a processor that gave up), then the real result of another try.
    agg.apply(Source::Results, keep(Source::Results, &[failed("j9", 2, 4, "S3 GetObject: no answer")])).await;
    agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r2))).await;
    // Chunk 3: the real result first, then a dead letter of it: the result stays.
    agg.apply(Source::Results, keep(Source::Results, &[result("j9", 3, vec![acct("d", 5, 500, 50)])])).await;
    agg.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[dead_letter("j9", 3, 5)])).await;
    agg.apply(Source::Results, keep(Source::Results, &[failed("j9", 3, 5, "late failure report")])).await;
    // A second copy of a corrected chunk's result counts once.
    agg.apply(Source::Results, keep(Source::Results, &[r1, r2])).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("j9", 0, vec![acct("a", 2, 200, 20)]), sealed("j9", 4)])).await;
    let r = report_of(&store, "j9").await.expect("finished");
    assert_eq!(r.status, JobStatus::Complete, "{:?}", r.failed_chunks);
    assert_eq!((r.transactions.processed, r.transactions.failed), (14, 0));
    assert!(r.failed_chunks.is_empty());
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count)).collect::<Vec<_>>(), [("a", 2), ("b", 3), ("c", 4), ("d", 5)]);
}

#[tokio::test]
async fn a_correction_survives_a_restart() {
    // One controller restarted twice (its own leases are its own at once).
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j10", &[2, 3])).await;
    let first = quick_owned(store.clone(), "c1".into(), LEASE);
    first.apply(Source::WorkDeadLetter, keep(Source::WorkDeadLetter, &[dead_letter("j10", 1, 3)])).await;
    first.flush().await; // the failure is checkpointed
    drop(first);
    let second = quick_owned(store.clone(), "c1".into(), LEASE);
    second.apply(Source::Results, keep(Source::Results, &[result("j10", 1, vec![acct("b", 3, 300, 30)])])).await;
    second.flush().await;
    let meta = store.head(&checkpoint_key("j10")).await.unwrap().expect("checkpoint written");
    let p = fleet_domain::model::Progress::from_meta(&meta).expect("progress in the metadata");
    assert_eq!((p.accounted, p.failed, p.processed), (1, 0, 3), "the correction is checkpointed");
    drop(second);
    let third = quick_owned(store.clone(), "c1".into(), LEASE);
    third.apply(Source::Results, keep(Source::Results, &[result("j10", 0, vec![acct("a", 2, 200, 20)]), sealed("j10", 2)])).await;
    let r = report_of(&store, "j10").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Complete, 5, 0), "{:?}", r.failed_chunks);
}

#[tokio::test]
async fn a_controller_down_longer_than_abandon_after_reads_the_waiting_seal_first() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j11", &[2, 3])).await;
    let after = Duration::from_millis(800);
    let first = quick_owned(store.clone(), "c1".into(), LEASE);
    first.apply(Source::Results, keep(Source::Results, &[result("j11", 0, vec![acct("a", 2, 200, 20)])])).await;
    first.flush().await;
    drop(first);
    // Down for longer than `after`; meanwhile the seal and the last result reach the queue.
    tokio::time::sleep(after * 2).await;
    let second = quick_owned(store.clone(), "c1".into(), LEASE);
    // Its first expiry tick comes before it has read the queue: nothing is abandoned.
    assert!(second.expire(after).await.is_empty());
    assert!(report_of(&store, "j11").await.is_none(), "abandoned at start, before its seal on the queue was read");
    second.apply(Source::Results, keep(Source::Results, &[sealed("j11", 2), result("j11", 1, vec![acct("b", 3, 300, 30)])])).await;
    let r = report_of(&store, "j11").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 5));
    // A job that really gets no news is still abandoned, one `after` past the start.
    put_manifest(&store, &manifest("j12", &[1, 1])).await;
    let third = quick_owned(store.clone(), "c1".into(), LEASE);
    third.apply(Source::Results, keep(Source::Results, &[result("j12", 0, vec![acct("a", 1, 100, 10)])])).await;
    third.flush().await;
    drop(third);
    let fourth = quick_owned(store.clone(), "c1".into(), LEASE);
    // Its first tick scans at start: the job's checkpoint is dated from then, on its own clock.
    fourth.expire(after).await;
    tokio::time::sleep(after + Duration::from_millis(200)).await;
    fourth.expire(after).await;
    assert_eq!(report_of(&store, "j12").await.expect("abandoned").status, JobStatus::Abandoned);
}

#[tokio::test]
async fn missing_manifest_keeps_messages_for_redelivery() {
    let store = MemoryStore::new();
    let agg = quick(store.clone());
    let batch = [result("j4", 0, vec![acct("a", 1, 100, 1)]), sealed("j4", 1)];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert!(applied.delete.is_empty(), "not deleted: the job cannot be finished yet");
    put_manifest(&store, &manifest("j4", &[1])).await;
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), 2);
    assert_eq!(report_of(&store, "j4").await.unwrap().transactions.processed, 1);
}

#[tokio::test]
async fn chunks_beyond_the_sealed_size_are_ignored() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j6", &[1])).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[sealed("j6", 1), result("j6", 5, vec![acct("x", 9, 900, 9)])])).await;
    assert!(report_of(&store, "j6").await.is_none());
    agg.apply(Source::Results, keep(Source::Results, &[result("j6", 0, vec![acct("a", 1, 100, 1)])])).await;
    let r = report_of(&store, "j6").await.unwrap();
    assert_eq!(r.transactions.processed, 1);
    assert_eq!(r.accounts.len(), 1);
}

#[tokio::test]
async fn inconsistent_result_is_a_failed_chunk_and_garbage_is_quarantined() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j5", &[3])).await;
    let agg = quick(store.clone());
    let mut bad: ResultMessage = serde_json::from_str(&result("j5", 0, vec![acct("a", 2, 100, 1)]).body).unwrap();
    if let ResultMessage::Chunk(c) = &mut bad {
        c.transactions = 3;
    }
    let garbage = Message { id: "g1".into(), body: "{not json".into(), receive_count: 2, ..Default::default() };
    let applied = agg.apply(Source::Results, keep(Source::Results, &[msg(serde_json::to_string(&bad).unwrap()), garbage, sealed("j5", 1)])).await;
    assert_eq!(applied.delete.len(), 3, "the garbage message is quarantined, then deleted");
    let q = fleet_io::quarantine::read(store.as_ref(), "quarantine/billing-results/g1.json").await.unwrap().expect("quarantined");
    assert_eq!((q.body.as_str(), q.receive_count, q.queue.as_str()), ("{not json", 2, "billing-results"));
    assert!(q.reason.contains("invalid JSON"), "{}", q.reason);
    let r = report_of(&store, "j5").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert!(r.failed_chunks[0].reason.contains("counts 2"));
}

#[tokio::test]
async fn hostile_values_fail_their_chunk_and_leave_other_jobs_alone() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("h1", &[1, 1, 2])).await;
    put_manifest(&store, &manifest("ok", &[1])).await;
    let agg = quick(store.clone());
    let huge = Decimal::MAX - Decimal::ONE;
    // Another currency: the EUR total is near its limit after chunk 0.
    let usd = |a: &str| AccountTotals { currency: "USD".into(), ..acct(a, 1, 100, 1) };
    let mut big_requests = result("h1", 2, vec![usd("c"), usd("c2")]);
    big_requests.body = big_requests.body.replace("\"requests\":{}", "\"requests\":{\"sqs.ReceiveMessage\":18446744073709551615}");
    assert!(big_requests.body.contains("18446744073709551615"), "{}", big_requests.body);
    let batch = [
        sealed("h1", 3),
        // Each fits alone; their sum does not.
        result("h1", 0, vec![AccountTotals { gross: huge, ..acct("a", 1, 0, 0) }]),
        result("h1", 1, vec![AccountTotals { gross: huge, ..acct("a", 1, 0, 0) }]),
        big_requests,
        result("ok", 0, vec![acct("z", 1, 500, 5)]),
        sealed("ok", 1),
    ];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), batch.len());
    let r = report_of(&store, "h1").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert_eq!((r.transactions.processed, r.transactions.failed), (3, 1));
    assert!(r.failed_chunks[0].reason.contains("would overflow"), "{:?}", r.failed_chunks);
    assert_eq!(r.requests.total, u64::MAX, "request counts saturate instead of wrapping");
    // A count that cannot be summed.
    let agg = quick(store.clone());
    put_manifest(&store, &manifest("h2", &[1])).await;
    let rows = vec![acct("a", u64::MAX, 100, 1), acct("b", 2, 100, 1)];
    let m = result("h2", 0, rows);
    assert!(m.body.contains("\"transactions\":1,"), "the wrapped count: {}", m.body);
    agg.apply(Source::Results, keep(Source::Results, &[m, sealed("h2", 1)])).await;
    let r = report_of(&store, "h2").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    // Two rows for a chunk of one transaction: refused before they are summed.
    assert!(r.failed_chunks[0].reason.contains("result has 2 account rows; its chunk has 1 transactions"), "{:?}", r.failed_chunks);
    let ok = report_of(&store, "ok").await.unwrap();
    assert_eq!((ok.status, ok.transactions.processed, ok.accounts[0].gross.as_str()), (JobStatus::Complete, 1, "5.00"));
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

#[tokio::test]
async fn hostile_results_are_bounded_by_their_declared_rows_and_their_own_keys() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("x1", &[2, 2, 2, 2])).await;
    put_manifest(&store, &manifest("other", &[1])).await;
    // A payload of 2 declared rows that inflates to 16 MiB: refused at its cap (2 rows' worth).
    let long_id = "a".repeat(16 << 20);
    let bomb = accounts_to_zstd_csv(
        [fleet_domain::billing::RowRef { account_id: &long_id, currency: "EUR", count: 2, gross: Decimal::new(100, 2), fees: Decimal::new(10, 2) }].into_iter(),
    );
    assert!(bomb.len() < 64 * 1024, "a small message: {} bytes", bomb.len());
    let inline_bomb = with_payload("x1", 0, 2, AccountsPayload::ZstdCsv { data: fleet_domain::codec::base64_encode(&bomb) });
    // The same as a result blob (its declared raw size a lie too).
    let key = fleet_domain::layout::result_key("x1", 1);
    store.put(&key, Bytes::from(bomb.clone()), "application/zstd").await.unwrap();
    let blob_bomb = with_payload(
        "x1",
        1,
        2,
        AccountsPayload::Blob { blob: BlobRef { key, sha256: sha256_hex(&bomb), compressed_bytes: bomb.len() as u64, raw_bytes: 1 << 30 } },
    );
    // A result pointing at another job's object (its checksum right).
    let theirs = fleet_domain::layout::result_key("other", 0);
    let good = accounts_to_zstd_csv(
        [fleet_domain::billing::RowRef { account_id: "a", currency: "EUR", count: 2, gross: Decimal::new(100, 2), fees: Decimal::new(10, 2) }].into_iter(),
    );
    store.put(&theirs, Bytes::from(good.clone()), "application/zstd").await.unwrap();
    let foreign = with_payload(
        "x1",
        2,
        2,
        AccountsPayload::Blob { blob: BlobRef { key: theirs, sha256: sha256_hex(&good), compressed_bytes: good.len() as u64, raw_bytes: 1024 } },
    );
    // A failure report whose count would wrap a sum: it contradicts the chunk's record (refused,
    // quarantined); the real one counts.
    let huge = failed("x1", 3, u64::MAX, "hostile count");
    let agg = quick(store.clone());
    let batch = [
        inline_bomb,
        blob_bomb,
        foreign,
        huge,
        failed("x1", 3, 2, "bad rows"),
        sealed("x1", 4),
        result("other", 0, vec![acct("z", 1, 500, 5)]),
        sealed("other", 1),
    ];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), batch.len());
    let refused = quarantined_of(&store, "x1").await;
    assert_eq!(refused.len(), 1, "the forged count is quarantined");
    assert!(refused[0].contains("declares 18446744073709551615 transactions; the chunk has 2"), "{}", refused[0]);
    let r = report_of(&store, "x1").await.expect("finished");
    assert_eq!(r.status, JobStatus::Partial);
    let reasons: Vec<(u32, &str)> = r.failed_chunks.iter().map(|f| (f.chunk, f.reason.as_str())).collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    // The chunk's worth of bytes (its record: 2 rows of 200 bytes), not the 16 MiB the payloads hold
    // nor the 1 GiB the blob claims.
    let cap = format!("decompresses to more than {} bytes", limits::Figures { transactions: 2, raw_bytes: Some(200) }.max_bytes());
    assert!(reasons[0].1.contains("result unreadable") && reasons[0].1.contains(&cap), "{reasons:?}");
    assert!(reasons[1].1.contains("result unreadable") && reasons[1].1.contains(&cap), "{reasons:?}");
    assert!(reasons[2].1.contains("is not the key of job x1 chunk 2"), "{reasons:?}");
    assert_eq!(r.transactions.failed, 8, "failed chunks count their manifest's transactions, not what hostile results declared");
    assert_eq!(r.transactions.processed, 0);
    let ok = report_of(&store, "other").await.unwrap();
    assert_eq!((ok.status, ok.transactions.processed), (JobStatus::Complete, 1));
}

#[tokio::test]
async fn a_result_whose_blob_is_gone_fails_its_chunk_and_stranded_results_count() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("s1", &[1, 1])).await;
    let agg = quick(store.clone());
    let lost = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: "s1".into(),
        chunk: 1,
        transactions: 1,
        outcome: ChunkOutcome::Processed {
            payload: AccountsPayload::Blob {
                blob: BlobRef { key: fleet_domain::layout::result_key("s1", 1), sha256: "0".repeat(64), compressed_bytes: 9, raw_bytes: 9 },
            },
        },
        requests: RequestCounts::default(),
    });
    // From the results dead-letter queue (S3 was down for minutes): applied like any result.
    let applied = agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &[sealed("s1", 2), result("s1", 0, vec![acct("a", 1, 100, 1)])])).await;
    assert!(applied.delete.is_empty());
    let applied = agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &[msg(serde_json::to_string(&lost).unwrap())])).await;
    assert_eq!(applied.delete.len(), 3);
    assert!(applied.delete.iter().all(|k| k.queue() == Source::ResultsDeadLetter.default_queue()));
    let r = report_of(&store, "s1").await.unwrap();
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 1, 1));
    assert!(r.failed_chunks[0].reason.contains("result unreadable"), "{:?}", r.failed_chunks);
}

fn abandon(job: &str) -> Message {
    msg(serde_json::to_string(&ResultMessage::Abandon { v: 1, job_id: job.into(), reason: "operator".into() }).unwrap())
}

#[tokio::test]
async fn abandon_finishes_a_job_with_what_was_processed() {
    let store = MemoryStore::new();
    // Sealed and manifest written, one chunk never came back: its chunk is listed as failed.
    put_manifest(&store, &manifest("a1", &[2, 3])).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[sealed("a1", 2), result("a1", 0, vec![acct("a", 2, 200, 2)])])).await;
    agg.apply(Source::Results, keep(Source::Results, &[abandon("a1")])).await;
    let r = report_of(&store, "a1").await.unwrap();
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed, r.transactions.accepted), (JobStatus::Abandoned, 2, 3, 5));
    assert!(r.failed_chunks[0].reason.contains("abandoned: operator"), "{:?}", r.failed_chunks);
    assert_eq!(agg.open_jobs(), 0, "memory freed");
    // Never sealed, no manifest: the report holds what was processed.
    put_chunks(&store, "a2", 5).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("a2", 4, vec![acct("b", 7, 700, 7)]), abandon("a2")])).await;
    let r = report_of(&store, "a2").await.unwrap();
    assert_eq!((r.status, r.transactions.processed, r.transactions.accepted), (JobStatus::Abandoned, 7, 7));
    assert!(r.note.as_deref().unwrap().contains("no manifest"), "{:?}", r.note);
    // Late results of an abandoned job are duplicates.
    let applied = agg.apply(Source::Results, keep(Source::Results, &[result("a1", 1, vec![acct("a", 3, 300, 3)])])).await;
    assert_eq!(applied.delete.len(), 1);
    assert_eq!(report_of(&store, "a1").await.unwrap().transactions.processed, 2);
}

#[tokio::test(start_paused = true)]
async fn unsealed_jobs_expire_also_after_a_restart() {
    let store = MemoryStore::new();
    // The same controller before and after its restart (a stable id: it takes its leases back at once),
    // its wall clock moving with the paused one.
    let clock = Clock::driven(1_800_000_000_000);
    let agg = Aggregator::with(store.clone(), Options { owner: "c1".into(), clock, ..Options::default() });
    put_chunks(&store, "e1", 1).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("e1", 0, vec![acct("a", 1, 100, 1)])])).await;
    put_manifest(&store, &manifest("e2", &[1, 1])).await;
    agg.apply(Source::Results, keep(Source::Results, &[sealed("e2", 2), result("e2", 0, vec![acct("a", 1, 100, 1)])])).await;
    assert_eq!(agg.flush().await.len(), 3);
    assert_eq!(store.keys().iter().filter(|k| k.starts_with("open/")).count(), 2, "open markers");
    tokio::time::advance(Duration::from_secs(30)).await;
    assert!(agg.expire(Duration::from_secs(60)).await.is_empty(), "not yet");
    drop(agg); // crash and restart
    let agg = Aggregator::with(store.clone(), Options { owner: "c1".into(), clock, ..Options::default() });
    assert_eq!(agg.scan_open().await.unwrap(), 2);
    tokio::time::advance(Duration::from_secs(61)).await;
    agg.expire(Duration::from_secs(60)).await;
    let r = report_of(&store, "e1").await.expect("the unsealed job was abandoned");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Abandoned, 1));
    assert!(report_of(&store, "e2").await.is_none(), "a sealed job waits for its chunks");
    assert_eq!(store.keys().iter().filter(|k| k.starts_with("open/")).cloned().collect::<Vec<_>>(), vec!["open/e2".to_string()]);
}

/// Two controllers, one job: a stale owner (its lease lapsed while it held unsaved state) cannot
/// overwrite the new owner's checkpoint; a job another controller holds is handed back; the totals end
/// exact once the stale owner's messages come back to the new owner.
#[tokio::test]
async fn a_stale_owner_is_fenced_and_messages_of_anothers_job_are_handed_back() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("f", &[1, 1, 1])).await;
    let ttl = Duration::from_millis(600);
    let a = quick_owned(store.clone(), "a".into(), ttl);
    let b = quick_owned(store.clone(), "b".into(), ttl);
    let r0 = result("f", 0, vec![acct("x", 1, 100, 1)]);
    let r1 = result("f", 1, vec![acct("x", 1, 200, 1)]);
    let r2 = result("f", 2, vec![acct("y", 1, 300, 1)]);
    // a owns the job and holds chunk 0 unsaved; b is turned away meanwhile.
    assert!(a.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r0))).await.delete.is_empty());
    let turned = b.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r1))).await;
    assert_eq!((turned.delete.len(), turned.release.len()), (0, 1), "b hands the message back to a");
    // a pauses past its lease; b takes the job over and checkpoints chunk 1.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    b.apply(Source::Results, keep(Source::Results, &[r1.clone(), sealed("f", 3)])).await;
    assert_eq!(b.flush().await.len(), 2);
    // a wakes and tries to save chunk 0: fenced, nothing deleted, b's checkpoint intact.
    assert!(a.flush().await.is_empty(), "a stale owner's messages are not deleted");
    assert_eq!(a.open_jobs(), 0, "a dropped the job");
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("f")).await.unwrap().unwrap(), 1 << 20).unwrap();
    assert_eq!(cp.accounted.iter().copied().collect::<Vec<_>>(), vec![1], "b's checkpoint was not overwritten");
    // a receives chunk 2: b holds the job, so it is handed back.
    assert_eq!(a.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r2))).await.release.len(), 1);
    // Chunk 0 (redelivered: a never deleted it) and chunk 2 reach b: exact.
    b.apply(Source::Results, keep(Source::Results, &[r0, r2])).await;
    let r = report_of(&store, "f").await.expect("b finished the job");
    assert_eq!(r.transactions.processed, 3);
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.gross.as_str())).collect::<Vec<_>>(), [("x", 2, "3.00"), ("y", 1, "3.00")]);
}

/// Calls on one job's objects wait at a gate (an S3 prefix that hangs).
struct Gated {
    job: &'static str,
    open: tokio::sync::watch::Receiver<bool>,
}

impl Gated {
    async fn gate(&self, key: &str) {
        if key.contains(self.job) {
            let mut open = self.open.clone();
            let _ = open.wait_for(|o| *o).await;
        }
    }
}

#[async_trait::async_trait]
impl Hook for Gated {
    async fn put_if(
        &self,
        inner: &dyn BlobStore,
        key: &str,
        body: Bytes,
        content_type: &str,
        meta: &BTreeMap<String, String>,
        cond: &Cond,
    ) -> Result<Option<String>> {
        self.gate(key).await;
        inner.put_if(key, body, content_type, meta, cond).await
    }
    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        self.gate(key).await;
        inner.get_tagged(key).await
    }
    async fn head(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        self.gate(key).await;
        inner.head(key).await
    }
    async fn delete(&self, inner: &dyn BlobStore, key: &str) -> Result<()> {
        self.gate(key).await;
        inner.delete(key).await
    }
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
    async fn put_if(
        &self,
        inner: &dyn BlobStore,
        key: &str,
        body: Bytes,
        content_type: &str,
        meta: &BTreeMap<String, String>,
        cond: &Cond,
    ) -> Result<Option<String>> {
        self.check(key)?;
        inner.put_if(key, body, content_type, meta, cond).await
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

/// After a job's S3 calls failed, its next batches are turned back at once (held) instead of each
/// waiting out another call deadline; after a short pause it is tried again.
#[tokio::test(start_paused = true)]
async fn a_job_whose_store_fails_turns_its_batches_back_without_waiting() {
    let store = Broken::new("down");
    let agg = quick(store.clone());
    let first = agg.apply(Source::Results, keep(Source::Results, &[result("down", 0, vec![acct("a", 1, 100, 1)])])).await;
    assert!(first.delete.is_empty() && first.release.is_empty(), "held");
    assert_eq!(agg.held(Some(Source::Results)), 1);
    let tried = store.failed.load(Ordering::Relaxed);
    assert!(tried >= 1);
    for chunk in 1..4 {
        let next = agg.apply(Source::Results, keep(Source::Results, &[result("down", chunk, vec![acct("a", 1, 100, 1)])])).await;
        assert!(next.delete.is_empty() && next.release.is_empty());
    }
    assert_eq!(store.failed.load(Ordering::Relaxed), tried, "no call made for the job while it is failing");
    tokio::time::sleep(FAILING_FOR).await;
    agg.apply(Source::Results, keep(Source::Results, &[result("down", 4, vec![acct("a", 1, 100, 1)])])).await;
    assert!(store.failed.load(Ordering::Relaxed) > tried, "tried again after the pause");
}

/// Jobs progress in parallel: while every S3 call about one job hangs, another job is applied,
/// checkpointed and finished, and the slow one completes once its calls return.
#[tokio::test]
async fn a_job_whose_s3_calls_hang_does_not_hold_up_another() {
    let inner = MemoryStore::new();
    put_manifest(&inner, &manifest("slow", &[1])).await;
    put_manifest(&inner, &manifest("fast", &[1, 2])).await;
    let (gate, open) = tokio::sync::watch::channel(false);
    let agg = Arc::new(quick(Hooked::new(inner.clone(), Gated { job: "slow", open })));
    let slow = {
        let agg = agg.clone();
        tokio::spawn(
            async move { agg.apply(Source::Results, keep(Source::Results, &[sealed("slow", 1), result("slow", 0, vec![acct("s", 1, 100, 1)])])).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!slow.is_finished(), "the slow job's calls hang");
    let fast = tokio::time::timeout(Duration::from_secs(5), async {
        agg.apply(Source::Results, keep(Source::Results, &[sealed("fast", 2), result("fast", 0, vec![acct("a", 1, 100, 1)])])).await;
        assert_eq!(agg.flush_idle().await.len(), 2, "the fast job is checkpointed; the hung one is skipped");
        agg.apply(Source::Results, keep(Source::Results, &[result("fast", 1, vec![acct("a", 2, 200, 2)])])).await
    })
    .await
    .expect("the other job is not held up by the hung one");
    assert_eq!(fast.delete.len(), 1, "the report covers the last message");
    let r = report_of(&inner, "fast").await.expect("the fast job finished");
    assert_eq!(r.transactions.processed, 3);
    assert!(report_of(&inner, "slow").await.is_none());
    gate.send(true).unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(5), slow).await.unwrap().unwrap();
    assert_eq!(applied.delete.len(), 2);
    assert_eq!(report_of(&inner, "slow").await.unwrap().transactions.processed, 1);
}

/// The transactions rows add up to (a chunk's count, as its record gives it).
fn count_of(rows: &[AccountTotals]) -> u64 {
    rows.iter().map(|a| a.count).sum()
}

fn many(prefix: &str, n: usize, cents: i64) -> Vec<AccountTotals> {
    // Amounts that differ from row to row, as real ones do (identical rows compress to nothing).
    (0..n).map(|i| acct(&format!("{prefix}{i:06}"), 1 + (i as u64 * 7) % 13, cents + (i as i64 * 7919) % 1_000_003, (i as i64 * 31) % 997)).collect()
}

/// A large job's checkpoints write what changed: a base once, then only the rows of the accounts a
/// result touched; a new base when the parts pile up; a restarted controller restores the base and
/// the parts in order and finishes with exact totals; the finished job leaves no part behind.
// Paused time: no batch is old enough to be checkpointed by the batch itself, so each `flush` here
// writes one checkpoint.
#[tokio::test(start_paused = true)]
async fn large_jobs_checkpoint_only_what_changed_and_restore_exactly() {
    let store = MemoryStore::new();
    let chunks = 2 + MAX_PARTS as u32;
    let mut sizes = vec![count_of(&many("acc", 10_000, 100))];
    sizes.extend(std::iter::repeat_n(3, chunks as usize - 2));
    sizes.push(1);
    put_manifest(&store, &manifest("big", &sizes)).await;
    let mut expected = fleet_domain::billing::Totals::new();
    let first = many("acc", 10_000, 100);
    expected.add_all(first.iter());
    let agg = quick_owned(store.clone(), "c1".into(), LEASE);
    agg.apply(Source::Results, keep(Source::Results, &[result("big", 0, first)])).await;
    assert_eq!(agg.flush().await.len(), 1);
    let base_bytes = agg.stats().bytes.load(Ordering::Relaxed);
    assert_eq!(agg.stats().full_parts.load(Ordering::Relaxed), 1, "more rows than fit inline: a base part");
    let mut deltas = Vec::new();
    for chunk in 1..chunks - 1 {
        // Three accounts, one of them new.
        let rows = vec![acct("acc000001", 1, 5, 0), acct(&format!("acc{:06}", chunk * 7), 1, 7, 0), acct(&format!("new{chunk}"), 1, 9, 1)];
        expected.add_all(rows.iter());
        let before = agg.stats().bytes.load(Ordering::Relaxed);
        agg.apply(Source::Results, keep(Source::Results, &[result("big", chunk, rows)])).await;
        assert_eq!(agg.flush().await.len(), 1);
        deltas.push(agg.stats().bytes.load(Ordering::Relaxed) - before);
    }
    let stats = agg.stats();
    assert_eq!(stats.full_parts.load(Ordering::Relaxed), 2, "a new base after {MAX_PARTS} parts");
    assert_eq!(stats.delta_parts.load(Ordering::Relaxed), u64::from(chunks) - 3);
    let small = deltas[1];
    assert!(small * 20 < base_bytes, "a checkpoint after a 3-account result writes {small} bytes, the base {base_bytes}");
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("big")).await.unwrap().unwrap(), 1 << 30).unwrap();
    assert!(cp.accounts.is_empty() && cp.parts[0].full && cp.parts.len() < MAX_PARTS, "{:?}", cp.parts.len());
    let listed = store.list(&checkpoint_parts_prefix("big"), 1000).await.unwrap();
    assert_eq!(listed.len(), cp.parts.len(), "replaced parts are deleted");
    // A restart (the same owner name takes its lease back): restored from the base and the parts.
    drop(agg);
    let agg = quick_owned(store.clone(), "c1".into(), LEASE);
    let last = vec![acct("acc009999", 1, 1, 0)];
    expected.add_all(last.iter());
    let applied = agg.apply(Source::Results, keep(Source::Results, &[result("big", chunks - 1, last), sealed("big", chunks)])).await;
    assert_eq!(applied.delete.len(), 2);
    let r = report_of(&store, "big").await.expect("finished");
    let want: Vec<(String, u64, String)> = expected.rows().iter().map(|a| (a.account_id.clone(), a.count, fleet_domain::billing::money(a.gross))).collect();
    let got: Vec<(String, u64, String)> = r.accounts.iter().map(|a| (a.account_id.clone(), a.count, a.gross.clone())).collect();
    assert_eq!(got, want);
    assert!(store.list(&checkpoint_parts_prefix("big"), 1000).await.unwrap().is_empty(), "no part outlives the job");
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("big")).await.unwrap().unwrap(), 1 << 30).unwrap();
    assert_eq!((cp.status, cp.parts.len(), cp.accounts.len()), (JobStatus::Complete, 0, 0));
}

/// The deliveries a checkpoint covers are deleted on the queue each came from (results and the
/// results dead-letter queue at once), and nothing a checkpoint does not cover is deleted.
#[tokio::test]
async fn a_checkpoint_deletes_each_message_on_the_queue_it_came_from() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("q1", &[1, 1, 1])).await;
    let agg = quick(store.clone());
    let results = MemoryQueue::new("billing-results", Duration::from_secs(30));
    let dlq = MemoryQueue::new("billing-results-dlq", Duration::from_secs(30));
    results.send(vec![result("q1", 0, vec![acct("a", 1, 100, 1)]).body, sealed("q1", 3).body]).await.unwrap();
    dlq.send(vec![result("q1", 1, vec![acct("b", 1, 200, 2)]).body]).await.unwrap();
    let (on_results, on_dlq) = (Completions::start(results.clone(), BatchSettings::default()), Completions::start(dlq.clone(), BatchSettings::default()));
    let got = results.receive(10, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 2);
    let applied = agg.apply(Source::Results, got.into_iter().map(|d| on_results.keep(d)).collect()).await;
    assert!(applied.delete.is_empty() && applied.release.is_empty(), "kept until a checkpoint covers them");
    let got = dlq.receive(10, Duration::ZERO).await.unwrap();
    let applied = agg.apply(Source::ResultsDeadLetter, got.into_iter().map(|d| on_dlq.keep(d)).collect()).await;
    assert!(applied.delete.is_empty());
    let covered = agg.flush().await;
    let mut queues: Vec<&str> = covered.iter().map(|k| k.queue()).collect();
    queues.sort();
    assert_eq!(queues, ["billing-results", "billing-results", "billing-results-dlq"]);
    for k in covered {
        k.delete();
    }
    on_results.finish(true).await;
    on_dlq.finish(true).await;
    assert!(results.bodies().is_empty() && dlq.bodies().is_empty(), "every covered message deleted where it came from");
    assert_eq!(results.calls().snapshot().get("sqs.DeleteMessageBatch"), Some(&1));
    assert_eq!(dlq.calls().snapshot().get("sqs.DeleteMessageBatch"), Some(&1));
}

/// A store outage far longer than maxReceiveCount x the visibility timeout: the results in hand, and
/// those applied to a job since its last checkpoint, are held with their visibility kept for the whole
/// outage (nobody else reads their partition: a peer that reaches the store gets them when this
/// controller's membership lapses and it stops reading, `hand_back_held`; issue 43 retired the
/// hand-over after a lease time, which only gave them back to this controller). Nothing is received
/// while the store is down and none reaches the dead-letter queue; once it answers they are applied
/// from the hold without a receive spent: the job's report is exact.
#[tokio::test(start_paused = true)]
async fn results_are_held_through_a_store_outage_then_applied_without_spending_receives() {
    let store = Broken::with_breaker("no-such-job");
    let breaker = store.breaker().unwrap();
    put_manifest(&store.memory, &manifest("h", &[1, 2, 1])).await;
    let dlq = MemoryQueue::new("billing-results-dlq", Duration::from_secs(10));
    let queue = MemoryQueue::with_dlq("billing-results", Duration::from_secs(10), 2, dlq.clone());
    let done = Completions::start(queue.clone(), BatchSettings::default());
    let lease = Duration::from_secs(30);
    let agg = quick_owned(store.clone(), "c".into(), lease);
    // As the listener engine does: nothing is received while the store's breaker is open.
    let receive = || async {
        if breaker.is_open() {
            return Vec::new();
        }
        queue.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done.keep(d)).collect::<Vec<_>>()
    };

    // Chunk 0 is applied while the store answers; it waits in its job for a checkpoint.
    queue.send(vec![result("h", 0, vec![acct("a", 1, 100, 1)]).body]).await.unwrap();
    let first = receive().await;
    assert_eq!(first.len(), 1);
    assert!(agg.apply(Source::Results, first).await.delete.is_empty());
    assert_eq!(agg.pending(), 1);

    // The store stops answering; the rest of the job arrives (the seal makes the job finish: it cannot).
    store.down.store(true, Ordering::Relaxed);
    let rest = [result("h", 1, vec![acct("a", 1, 250, 2), acct("b", 1, 50, 1)]), result("h", 2, vec![acct("b", 1, 75, 1)]), sealed("h", 3)];
    queue.send(rest.iter().map(|m| m.body.clone()).collect()).await.unwrap();
    let batch = receive().await;
    assert_eq!(batch.len(), 3);
    let applied = agg.apply(Source::Results, batch).await;
    assert!(applied.delete.is_empty() && applied.release.is_empty());
    assert_eq!(agg.held(None), 4, "the batch and the job's pending message are held");
    assert_eq!(agg.pending(), 0);

    // Ten minutes down: sixty visibility timeouts, far past a lease.
    assert!(Duration::from_secs(600) > lease * 10);
    for _ in 1..=600u64 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        agg.extend_held();
        let a = agg.retry_held().await;
        assert!(a.delete.is_empty() && a.release.is_empty(), "nothing applied or given back while the store is down");
        assert!(agg.expire(Duration::from_secs(60)).await.is_empty(), "nothing abandoned during the outage");
        assert!(receive().await.is_empty(), "received while the breaker is open");
    }
    assert!(breaker.is_open());
    assert_eq!(agg.held(None), 4, "every message still held");
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.visible, depth.in_flight), (0, 4), "kept invisible for the whole outage");
    assert_eq!(dlq.depth().await.unwrap().visible, 0, "nothing dead-lettered");
    let tries = store.failed.load(Ordering::Relaxed);
    assert!(tries < 100, "retries back off, the probe asks at most every 10 s (the store was called {tries} times in 10 minutes)");

    // The store answers again: the probe closes the breaker, the held messages are applied from the
    // hold (no receive spent), and the job finishes exactly.
    store.down.store(false, Ordering::Relaxed);
    let mut deleted = Vec::new();
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let a = agg.retry_held().await;
        deleted.extend(a.delete);
        deleted.extend(agg.flush().await);
        assert!(receive().await.is_empty(), "nothing to receive: every message is in hand");
        if deleted.len() == 4 {
            break;
        }
    }
    assert_eq!(deleted.len(), 4, "every message is covered by the report");
    let r = report_of(&store.memory, "h").await.expect("the job finished");
    assert_eq!(r.status, JobStatus::Complete);
    assert_eq!(r.transactions.processed, 4);
    let accounts: Vec<_> = r.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.gross.as_str())).collect();
    assert_eq!(accounts, [("a", 2, "3.50"), ("b", 2, "1.25")]);
    for k in deleted {
        k.delete();
    }
    done.finish(true).await;
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.visible, depth.in_flight), (0, 0), "every message deleted");
    assert_eq!(dlq.depth().await.unwrap().visible, 0, "nothing dead-lettered");
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

/// A job whose checkpoint (document or part) cannot be read is quarantined and reported at once; its
/// messages, then and later (an abandon too), are kept in the quarantine and deleted instead of
/// cycling; other jobs are untouched.
#[tokio::test]
async fn a_job_whose_checkpoint_cannot_be_read_is_quarantined_and_reported() {
    let store = MemoryStore::new();
    for job in ["cq", "pq", "ok"] {
        put_manifest(&store, &manifest(job, &[1, 1])).await;
    }
    // "cq": a checkpoint document that is not one; "pq": one naming a part that is not there.
    store.put(&checkpoint_key("cq"), Bytes::from_static(b"\x28\xb5\x2f\xfd garbage"), "application/zstd").await.unwrap();
    let mut cp: Checkpoint = serde_json::from_value(serde_json::json!({
        "v": 1, "job_id": "pq", "status": "running", "accounted": [0], "processed_transactions": 1, "failed_chunks": [], "accounts": [], "parts": [],
        "requests": {}, "updated_at": now_rfc3339()
    }))
    .unwrap();
    cp.parts.push(CheckpointPart { key: "jobs/pq/checkpoint-parts/gone.csv.zst".into(), rows: 1, bytes: 10, sha256: "00".into(), full: true });
    store.put(&checkpoint_key("pq"), Bytes::from(to_zstd_json(&cp).unwrap()), "application/zstd").await.unwrap();
    for job in ["cq", "pq"] {
        store.put(&open_key(job), Bytes::new(), "application/octet-stream").await.unwrap();
    }
    let agg = quick(store.clone());
    let batch = [result("cq", 0, vec![acct("a", 1, 100, 1)]), result("pq", 1, vec![acct("b", 1, 100, 1)]), result("ok", 0, vec![acct("c", 1, 100, 1)])];
    let applied = agg.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(applied.delete.len(), 2, "the quarantined jobs' messages are kept in the quarantine and deleted");
    for (job, why) in [("cq", "checkpoint cannot be read"), ("pq", "gone.csv.zst")] {
        let r = report_of(&store, job).await.expect("a quarantined job is reported");
        assert_eq!(r.status, JobStatus::Quarantined, "{job}");
        let note = r.note.clone().unwrap_or_default();
        assert!(note.contains(why), "{job}: {note}");
        assert!(r.accounts.is_empty(), "nothing billable in a quarantined job's report");
        assert!(store.head(&open_key(job)).await.unwrap().is_none(), "{job}: its open marker is removed");
        assert_eq!(quarantined_of(&store, job).await.len(), 1, "{job}");
        // The unreadable checkpoint is kept as it was; the one in its place says quarantined.
        assert!(store.get(&quarantined_checkpoint_key(job)).await.unwrap().is_some(), "{job}");
        let meta = store.head(&checkpoint_key(job)).await.unwrap().unwrap();
        assert_eq!(Progress::from_meta(&meta).map(|p| p.status), Some(JobStatus::Quarantined), "{job}");
    }
    assert_eq!(store.get(&quarantined_checkpoint_key("cq")).await.unwrap().as_deref(), Some(&b"\x28\xb5\x2f\xfd garbage"[..]));
    // Later messages, an abandon among them, go the same way: no load, no cycling.
    let abandon = msg(serde_json::to_string(&ResultMessage::Abandon { v: 1, job_id: "cq".into(), reason: "operator".into() }).unwrap());
    let later = agg.apply(Source::Results, keep(Source::Results, &[result("cq", 1, vec![acct("a", 1, 100, 1)]), abandon, sealed("cq", 2)])).await;
    assert_eq!(later.delete.len(), 3);
    assert_eq!(quarantined_of(&store, "cq").await.len(), 4);
    assert_eq!(report_of(&store, "cq").await.unwrap().status, JobStatus::Quarantined);
    // The other job goes on.
    agg.apply(Source::Results, keep(Source::Results, &[result("ok", 1, vec![acct("c", 1, 100, 1)]), sealed("ok", 2)])).await;
    assert_eq!(report_of(&store, "ok").await.unwrap().status, JobStatus::Complete);
    // A restarted controller reads the status: the message is kept in the quarantine too.
    let again = quick(store.clone());
    assert_eq!(again.apply(Source::Results, keep(Source::Results, &[result("pq", 0, vec![acct("b", 1, 100, 1)])])).await.delete.len(), 1);
    assert_eq!(quarantined_of(&store, "pq").await.len(), 2);
    assert_eq!(report_of(&store, "pq").await.unwrap().status, JobStatus::Quarantined);
}

/// A job whose manifest cannot be read (not JSON, or larger than a manifest may be) is quarantined
/// when it would finish; its checkpoint keeps the chunks and rows it had, and its messages are deleted.
#[tokio::test]
async fn a_job_whose_manifest_cannot_be_read_is_quarantined_with_its_checkpoint_kept() {
    let store = MemoryStore::new();
    store.put(&manifest_key("mq"), Bytes::from_static(b"{\"v\": 1, \"job_id\": "), "application/json").await.unwrap();
    put_records(&store, "mq", &[2]).await;
    let agg = quick(store.clone());
    let applied = agg.apply(Source::Results, keep(Source::Results, &[result("mq", 0, vec![acct("a", 2, 100, 1)]), sealed("mq", 1)])).await;
    assert_eq!(applied.delete.len(), 2, "covered by the checkpoint: deleted");
    let r = report_of(&store, "mq").await.expect("reported");
    assert_eq!(r.status, JobStatus::Quarantined);
    assert!(r.note.as_deref().unwrap_or_default().contains("manifest"), "{:?}", r.note);
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("mq")).await.unwrap().unwrap(), 1 << 20).unwrap();
    assert_eq!((cp.status, cp.accounted.len(), cp.processed_transactions, cp.accounts.len()), (JobStatus::Quarantined, 1, 2, 1), "the rows are kept");
    // A duplicate afterwards is kept in the quarantine, not applied.
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, &[result("mq", 0, vec![acct("a", 2, 100, 1)])])).await.delete.len(), 1);
    assert_eq!(quarantined_of(&store, "mq").await.len(), 1);
}

fn fleet_queues() -> (FleetQueues, Arc<MemoryQueue>) {
    let q = |name: &str| MemoryQueue::new(name, Duration::from_secs(30));
    let work = q("billing-work");
    (
        FleetQueues {
            work: work.clone(),
            work_dlq: q("billing-work-dlq"),
            results: q("billing-results"),
            results_dlq: q("billing-results-dlq"),
            announce: None,
        },
        work,
    )
}

/// A sealed job whose work item was lost (retention, FIFO de-duplication) is finished as `partial`,
/// naming the chunk it never got, once it had no news for the stall limit *and* the fleet's queues
/// have emptied since its last news; not while a queue still holds something; and also when it is
/// only known from its open marker after a restart.
#[tokio::test(start_paused = true)]
async fn a_sealed_job_that_stalls_is_finished_as_partial_once_nothing_can_arrive() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("st", &[1, 2, 1])).await;
    let (queues, work) = fleet_queues();
    let stall = Duration::from_secs(600);
    let agg = quick_with(store.clone(), Options { stall: Some(StallLimit { after: stall, queues: queues.clone() }), ..Options::default() });
    // Chunk 1 never comes.
    agg.apply(
        Source::Results,
        keep(Source::Results, &[result("st", 0, vec![acct("a", 1, 100, 1)]), result("st", 2, vec![acct("b", 1, 50, 1)]), sealed("st", 3)]),
    )
    .await;
    assert_eq!(agg.flush().await.len(), 3);
    // Another job's work item waits in the work queue: something may still arrive.
    work.send(vec!["another job's item".into()]).await.unwrap();
    tokio::time::sleep(stall + Duration::from_secs(60)).await;
    assert!(agg.expire(Duration::from_secs(3600)).await.is_empty());
    assert!(report_of(&store, "st").await.is_none(), "not finished while a queue holds a message");

    // A restarted controller knows the job from its open marker only: it waits the stall limit from
    // its own start, the queues being empty.
    let got = work.receive(10, Duration::ZERO).await.unwrap();
    work.delete(got).await.unwrap();
    agg.release_leases().await;
    drop(agg);
    let restarted = quick_with(store.clone(), Options { stall: Some(StallLimit { after: stall, queues }), ..Options::default() });
    assert!(restarted.expire(Duration::from_secs(3600)).await.is_empty(), "scanned; not due yet");
    tokio::time::sleep(stall / 2).await;
    assert!(restarted.expire(Duration::from_secs(3600)).await.is_empty());
    assert!(report_of(&store, "st").await.is_none());
    // Due: the queues are looked at in turn, each look counting a lag after the one before.
    tokio::time::sleep(stall / 2 + Duration::from_secs(1)).await;
    assert!(restarted.expire(Duration::from_secs(3600)).await.is_empty(), "the work queue seen empty: a pass starts");
    tokio::time::sleep(DEPTH_LAG).await;
    assert!(restarted.expire(Duration::from_secs(3600)).await.is_empty(), "the results queue seen empty after it");
    assert!(report_of(&store, "st").await.is_none());
    tokio::time::sleep(DEPTH_LAG).await;
    restarted.expire(Duration::from_secs(3600)).await;
    let r = report_of(&store, "st").await.expect("finished once stalled with the queues empty");
    assert_eq!(r.status, JobStatus::Partial);
    assert_eq!((r.transactions.processed, r.transactions.failed), (2, 2));
    assert_eq!(r.failed_chunks.iter().map(|f| (f.chunk, f.transactions)).collect::<Vec<_>>(), [(1, 2)]);
    assert!(r.failed_chunks[0].reason.contains("can no longer arrive"), "{}", r.failed_chunks[0].reason);
    assert!(r.note.as_deref().is_some_and(|n| n.contains("without 1 of its 3 chunks (1)")), "{:?}", r.note);
    assert!(store.head(&open_key("st")).await.unwrap().is_none());
}

// The sequences of issue 30 that ended a job wrong with several controllers, each as it was found.

/// A store that runs `after_read` once, right after the first read of `key` answered: another
/// controller acting between two calls of this one.
struct Interleaved {
    key: String,
    after_read: Mutex<Option<futures::future::BoxFuture<'static, ()>>>,
    /// The next conditional write of `key` goes through, its answer is lost, and the retry meets it.
    lose_answer: std::sync::atomic::AtomicBool,
}

impl Interleaved {
    fn new(inner: Arc<MemoryStore>, key: String) -> Arc<Hooked<Interleaved>> {
        Hooked::new(inner, Interleaved { key, after_read: Mutex::new(None), lose_answer: Default::default() })
    }
}

#[async_trait::async_trait]
impl Hook for Interleaved {
    async fn put_if(
        &self,
        inner: &dyn BlobStore,
        key: &str,
        body: Bytes,
        content_type: &str,
        meta: &BTreeMap<String, String>,
        cond: &Cond,
    ) -> Result<Option<String>> {
        let first = inner.put_if(key, body.clone(), content_type, meta, cond).await?;
        if key == self.key && *cond != Cond::Any && self.lose_answer.swap(false, Ordering::SeqCst) {
            assert!(first.is_some(), "the lost write went through");
            return inner.put_if(key, body, content_type, meta, cond).await;
        }
        Ok(first)
    }
    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        let found = inner.get_tagged(key).await;
        if key == self.key {
            let action = lock(&self.after_read).take();
            if let Some(action) = action {
                action.await;
            }
        }
        found
    }
}

/// Sequence 1: B loads a large job just as A, its lease lapsed, finishes it (a finished checkpoint,
/// its parts deleted): B's read of a part misses. That is a moving checkpoint, not a corrupt one: B
/// reads it again, finds it finished, and A's complete report stands (it was once replaced by an
/// empty quarantined one).
#[tokio::test]
async fn a_checkpoint_that_moves_while_it_is_read_is_read_again_not_quarantined() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("mv", &[count_of(&many("acct", INLINE_ROWS + 10, 100)), 1])).await;
    let a = quick_owned(store.clone(), "a".into(), LEASE);
    let r0 = result("mv", 0, many("acct", INLINE_ROWS + 10, 100));
    a.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&r0))).await;
    assert_eq!(a.flush().await.len(), 1);
    a.release_leases().await;
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("mv")).await.unwrap().unwrap(), 1 << 30).unwrap();
    assert!(!cp.parts.is_empty(), "a large job keeps its rows in parts");
    // Right after B read the checkpoint, A (for the test, by hand) writes its report and a finished
    // checkpoint, and deletes the parts.
    let racing = Interleaved::new(store.clone(), checkpoint_key("mv"));
    let (inner, parts) = (store.clone(), cp.parts.clone());
    let mut finished = cp.clone();
    (finished.status, finished.parts, finished.updated_at) = (JobStatus::Complete, Vec::new(), now_rfc3339());
    *lock(&racing.after_read) = Some(Box::pin(async move {
        inner.put(&report_key("mv"), Bytes::from_static(br#"{"status":"complete"}"#), "application/json").await.unwrap();
        let meta = Progress::of(&finished).to_meta();
        inner.put_if(&checkpoint_key("mv"), Bytes::from(to_zstd_json(&finished).unwrap()), "application/zstd", &meta, &Cond::Any).await.unwrap();
        for p in parts {
            inner.delete(&p.key).await.unwrap();
        }
    }));
    let b = quick_owned(racing.clone(), "b".into(), LEASE);
    let applied = b.apply(Source::Results, keep(Source::Results, &[r0])).await;
    assert_eq!(applied.delete.len(), 1, "a late duplicate of a finished job");
    assert_eq!(store.get(&report_key("mv")).await.unwrap().as_deref(), Some(&br#"{"status":"complete"}"#[..]), "A's report stands");
    assert!(store.keys().iter().all(|k| !k.contains("quarantine")), "nothing quarantined: {:?}", store.keys());
}

/// Sequence 2: B's scan saw job J idle since t0; J then had news on A at t0+55 min, and A stopped
/// (its lease given back). When B loads J as due, its idle time is read again from the checkpoint A
/// wrote, so B does not abandon it (it once did, from the scan's stale time): that checkpoint is new
/// to B, so J's news is dated when B first saw it (its own clock), and J is abandoned an hour later.
#[tokio::test(start_paused = true)]
async fn news_on_another_controller_keeps_a_job_from_being_abandoned() {
    let store = MemoryStore::new();
    put_chunks(&store, "nw", 4).await;
    let clock = Clock::driven(1_800_000_000_000);
    let hour = Duration::from_secs(3600);
    let a = Aggregator::with(store.clone(), Options { owner: "a".into(), clock, ..Options::default() });
    let b = Aggregator::with(store.clone(), Options { owner: "b".into(), clock, ..Options::default() });
    a.apply(Source::Results, keep(Source::Results, &[result("nw", 0, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(a.flush().await.len(), 1);
    tokio::time::advance(Duration::from_secs(50 * 60)).await;
    assert_eq!(b.scan_open().await.unwrap(), 1, "B knows the job as dormant");
    tokio::time::advance(Duration::from_secs(5 * 60)).await;
    // Checkpointed by the batch itself (the last checkpoint is old) or by the flush.
    let saved = a.apply(Source::Results, keep(Source::Results, &[result("nw", 1, vec![acct("x", 1, 100, 1)])])).await.delete.len();
    assert_eq!(saved + a.flush().await.len(), 1);
    a.release_leases().await;
    tokio::time::advance(Duration::from_secs(6 * 60)).await;
    b.expire(hour).await;
    assert!(report_of(&store, "nw").await.is_none(), "abandoned 6 minutes after its last news");
    // Due by the scan's view (an hour after B first saw it): loaded, and the new checkpoint dates it.
    tokio::time::advance(Duration::from_secs(50 * 60)).await;
    b.expire(hour).await;
    assert!(report_of(&store, "nw").await.is_none(), "abandoned though its news was new to B");
    tokio::time::advance(hour).await;
    b.expire(hour).await;
    let r = report_of(&store, "nw").await.expect("abandoned an hour after B saw its last news");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Abandoned, 2));
}

/// Two controllers on one store: A reads results partition 0, B partition 1.
fn readers_of_0_and_1(store: &Arc<MemoryStore>, clock: Clock) -> (Aggregator, Aggregator) {
    let pair = ["a", "b"].map(|owner| {
        let partition_queues = partitioned(&["billing-results", "billing-results-1"]);
        Aggregator::with(store.clone(), Options { owner: owner.into(), clock, partition_queues, ..Options::default() })
    });
    let [a, b] = pair;
    a.reading(0);
    b.reading(1);
    (a, b)
}

/// A dormant job is loaded only by the reader of its partition, which its checkpoint names. Loaded by
/// another controller, a sealed job whose last result waits in the partition's dead-letter queue
/// never stalls, and its lease is renewed for ever while the owner hands that message back (found by
/// the simulation with triggers, seed 257).
#[tokio::test(start_paused = true)]
async fn a_dormant_job_is_left_to_the_reader_of_its_partition() {
    let store = MemoryStore::new();
    put_chunks(&store, "pd", 2).await;
    let clock = Clock::driven(1_800_000_000_000);
    let hour = Duration::from_secs(3600);
    let (a, b) = readers_of_0_and_1(&store, clock);
    a.apply(Source::Results, keep(Source::Results, &[result("pd", 0, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(a.flush().await.len(), 1);
    let progress = store.head(&checkpoint_key("pd")).await.unwrap().and_then(|m| Progress::from_meta(&m)).expect("a checkpoint");
    assert_eq!(progress.partition, Some(0), "the checkpoint names the job's partition");
    a.let_go(0).await;
    tokio::time::advance(hour + Duration::from_secs(60)).await;
    assert_eq!(b.scan_open().await.unwrap(), 1, "B knows the job as dormant");
    b.expire(hour).await;
    assert!(report_of(&store, "pd").await.is_none(), "not finished by a controller that does not read its partition");
    assert_eq!(b.open_jobs(), 0, "nor loaded: no lease taken");
    b.reading(0);
    // Its idle time counts from B's first sight of its checkpoint (B's own clock).
    tokio::time::advance(hour).await;
    b.expire(hour).await;
    let r = report_of(&store, "pd").await.expect("abandoned by its partition's reader");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Abandoned, 1));
}

/// A job whose checkpoint named no partition when B's scan saw it (written by a release before
/// partitions) may be loaded by any controller; when the checkpoint B loads names a partition A reads
/// (its messages came there since), B gives the job back to A at once instead of holding its lease.
#[tokio::test(start_paused = true)]
async fn a_dormant_job_that_turns_out_to_be_of_another_partition_is_given_back() {
    let store = MemoryStore::new();
    put_chunks(&store, "lg", 3).await;
    let clock = Clock::driven(1_800_000_000_000);
    let hour = Duration::from_secs(3600);
    let old = Aggregator::with(store.clone(), Options { owner: "old".into(), clock, ..Options::default() });
    let (a, b) = readers_of_0_and_1(&store, clock);
    old.apply(Source::Results, keep(Source::Results, &[result("lg", 0, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(old.flush().await.len(), 1);
    old.release_leases().await;
    tokio::time::advance(Duration::from_secs(50 * 60)).await;
    assert_eq!(b.scan_open().await.unwrap(), 1, "B knows the job as dormant, of no partition");
    tokio::time::advance(Duration::from_secs(5 * 60)).await;
    let saved = a.apply(Source::Results, keep(Source::Results, &[result("lg", 1, vec![acct("x", 1, 100, 1)])])).await.delete.len();
    assert_eq!(saved + a.flush().await.len(), 1);
    a.release_leases().await;
    let progress = store.head(&checkpoint_key("lg")).await.unwrap().and_then(|m| Progress::from_meta(&m)).expect("a checkpoint");
    assert_eq!(progress.partition, Some(0), "A's checkpoint names the partition");
    tokio::time::advance(Duration::from_secs(6 * 60)).await;
    b.expire(hour).await;
    assert_eq!(b.open_jobs(), 0, "B gave the job back (it held its lease while A read its messages)");
    assert!(report_of(&store, "lg").await.is_none());
    let saved = a.apply(Source::Results, keep(Source::Results, &[result("lg", 2, vec![acct("x", 1, 100, 1)])])).await.delete.len();
    assert_eq!(saved + a.flush().await.len(), 1, "A takes the job at once");
}

/// A two-chunk job whose manifest names `partition`, chunk 0 and its seal checkpointed by a
/// controller that reads no partitions (as the release before partitions did), its lease given back.
async fn old_release_job(job: &str, partition: u16) -> (Arc<MemoryStore>, Clock) {
    old_release_checkpoint(job, partition, 2, true).await
}

/// A job of `chunks` one-transaction chunks whose manifest names `partition`, chunk 0 (and the seal
/// if `seal`) checkpointed by a controller of the release before partitions, its lease given back.
async fn old_release_checkpoint(job: &str, partition: u16, chunks: u32, seal: bool) -> (Arc<MemoryStore>, Clock) {
    let store = MemoryStore::new();
    put_chunks(&store, job, chunks).await;
    put_manifest(&store, &Manifest { partition, ..manifest(job, &vec![1; chunks as usize]) }).await;
    let clock = Clock::driven(1_800_000_000_000);
    let old = Aggregator::with(store.clone(), Options { owner: "old".into(), clock, ..Options::default() });
    let mut batch = vec![result(job, 0, vec![acct("x", 1, 100, 1)])];
    batch.extend(seal.then(|| sealed(job, chunks)));
    old.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(old.flush().await.len(), batch.len());
    old.release_leases().await;
    (store, clock)
}

/// A dormant job whose checkpoint names no partition (the release before partitions wrote it, and no
/// message of it came since) is of the partition its manifest records: a controller that does not
/// read that partition gives it back instead of keeping it, its lease renewed for ever while the
/// partition's reader hands its last result back (found by the simulation, seed 1630).
#[tokio::test(start_paused = true)]
async fn a_dormant_job_without_a_partition_takes_its_manifests() {
    let (store, clock) = old_release_job("pm", 0).await;
    let hour = Duration::from_secs(3600);
    let progress = store.head(&checkpoint_key("pm")).await.unwrap().and_then(|m| Progress::from_meta(&m)).expect("a checkpoint");
    assert_eq!(progress.partition, None, "the release before partitions names none");
    let (a, b) = readers_of_0_and_1(&store, clock);
    assert_eq!(b.scan_open().await.unwrap(), 1, "B knows the job as dormant, of no partition");
    tokio::time::advance(Duration::from_secs(30 * 60)).await;
    b.expire(hour).await;
    assert_eq!(b.open_jobs(), 0, "B gave the job back: its manifest names partition 0, which A reads");
    let saved = a.apply(Source::Results, keep(Source::Results, &[result("pm", 1, vec![acct("x", 1, 100, 1)])])).await.delete.len();
    assert_eq!(saved + a.flush().await.len(), 1, "A takes the job at once");
    let r = report_of(&store, "pm").await.expect("finished by A");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 2));
}

/// The same job, its manifest naming the partition the loading controller reads: kept there.
#[tokio::test(start_paused = true)]
async fn a_dormant_job_without_a_partition_is_kept_where_its_manifests_partition_is_read() {
    let (store, clock) = old_release_job("pk", 1).await;
    let (_a, b) = readers_of_0_and_1(&store, clock);
    assert_eq!(b.scan_open().await.unwrap(), 1);
    tokio::time::advance(Duration::from_secs(30 * 60)).await;
    b.expire(Duration::from_secs(3600)).await;
    assert_eq!(b.open_jobs(), 1, "B reads partition 1, which the manifest names: the job stays with B");
}

/// A dormant job whose checkpoint names no partition may have news at a controller of the release
/// before partitions (which reads every message): its news is dated by when this controller first
/// sees its checkpoint change, so such a job is looked at every tick while one is known, not every
/// abandon time. Looked at an abandon time apart, it was abandoned two abandon times after its news
/// (found by the simulation, seed 845122901, a rolling upgrade; `unpartitioned-looked-at-each-tick`).
#[tokio::test(start_paused = true)]
async fn a_dormant_job_without_a_partition_is_looked_at_every_tick() {
    let (store, clock) = old_release_checkpoint("ut", 1, 3, false).await;
    let after = Duration::from_secs(600);
    let (_a, b) = readers_of_0_and_1(&store, clock);
    assert!(b.expire(after).await.is_empty(), "its first tick scans");
    assert!(b.waiting(Duration::ZERO).any, "the job is dormant, of no partition");
    // News a tenth of an abandon time later, at a controller of the release before partitions.
    tokio::time::advance(after / 10).await;
    let news = Aggregator::with(store.clone(), Options { owner: "old-2".into(), clock, ..Options::default() });
    news.apply(Source::Results, keep(Source::Results, &[result("ut", 1, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(news.flush().await.len(), 1);
    news.release_leases().await;
    let progress = store.head(&checkpoint_key("ut")).await.unwrap().and_then(|m| Progress::from_meta(&m)).expect("a checkpoint");
    assert_eq!(progress.partition, None, "the release before partitions names none");
    // B ticks every tenth of an abandon time, as the service does.
    for tick in 2..=15 {
        tokio::time::advance(after / 10).await;
        b.expire(after).await;
        if tick <= 10 {
            assert!(report_of(&store, "ut").await.is_none(), "abandoned at {tick} tenths, less than an abandon time after its news");
        }
    }
    let r = report_of(&store, "ut").await.expect("abandoned within half an abandon time of its due time, not an abandon time later");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Abandoned, 2));
}

/// A dormant job whose lease a batch finds busy (its owner died holding it) stays dormant, tried
/// again once the lease may have run out, and its partition's listeners keep looking for it: forgotten,
/// a job whose messages were handed back until they were dead-lettered was nobody's, and nobody
/// looked at the dead-letter queue until the hourly safety poll with the scaling agent down (found
/// by the simulation, seed 228242485; `busy-stays-dormant`).
#[tokio::test(start_paused = true)]
async fn a_dormant_job_whose_lease_is_busy_stays_dormant_and_looked_for() {
    let store = MemoryStore::new();
    put_chunks(&store, "bd", 3).await;
    let clock = Clock::driven(1_800_000_000_000);
    let reader = |owner: &str| {
        let agg =
            Aggregator::with(store.clone(), Options { owner: owner.into(), clock, partition_queues: partitioned(&["billing-results"]), ..Options::default() });
        agg.reading(0);
        agg
    };
    let dead = reader("dead");
    dead.apply(Source::Results, keep(Source::Results, &[result("bd", 0, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(dead.flush().await.len(), 1);
    // It dies holding the job's lease (nothing given back).
    drop(dead);
    let heir = reader("heir");
    assert_eq!(heir.scan_open().await.unwrap(), 1, "the heir knows the job as dormant");
    let applied = heir.apply(Source::Results, keep(Source::Results, &[result("bd", 1, vec![acct("x", 1, 100, 1)])])).await;
    assert!(applied.delete.is_empty(), "the dead owner's lease is busy: the result is handed back");
    assert_eq!(heir.open_jobs(), 0);
    let quiet = Duration::from_secs(60);
    tokio::time::advance(quiet).await;
    assert!(heir.waiting(quiet).partitions.contains(&0), "still dormant: its partition's listeners look for its messages");
}

/// Sequence 4: a checkpoint write goes through but its answer is lost, and the retry meets the first
/// write (412). That is this controller's own write, not another's: the job stays its own, the
/// messages it covers are deleted, and the job finishes.
#[tokio::test]
async fn a_conditional_write_whose_answer_was_lost_is_known_as_ours() {
    let inner = MemoryStore::new();
    put_manifest(&inner, &manifest("la", &[1, 1])).await;
    let store = Interleaved::new(inner.clone(), checkpoint_key("la"));
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[result("la", 0, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(agg.flush().await.len(), 1);
    store.lose_answer.store(true, Ordering::SeqCst);
    agg.apply(Source::Results, keep(Source::Results, &[sealed("la", 2)])).await;
    assert_eq!(agg.flush().await.len(), 1, "the seal is covered by the checkpoint whose answer was lost");
    assert!(!store.lose_answer.load(Ordering::SeqCst), "the answer was lost");
    assert_eq!(agg.open_jobs(), 1, "still this controller's job");
    agg.apply(Source::Results, keep(Source::Results, &[result("la", 1, vec![acct("x", 1, 200, 1)])])).await;
    let r = report_of(&inner, "la").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 2));
}

/// Sequence 5: results for chunks 0, 1 and 5 of a three-chunk job arrive before its seal. Chunk 5
/// has no chunk blob: it is not counted, so the seal of 3 does not complete the job without chunk 2,
/// and the totals never hold chunk 5's rows (a 3-row job was once reported complete with 11).
#[tokio::test]
async fn a_chunk_beyond_the_job_before_its_seal_is_not_counted() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("bj", &[1, 1, 1])).await;
    let agg = quick(store.clone());
    let one = |c: u32| result("bj", c, vec![acct("a", 1, 100, 1)]);
    let forged = result("bj", 5, vec![acct("a", 8, 800, 8), acct("evil", 1, 100, 0)]);
    agg.apply(Source::Results, keep(Source::Results, &[one(0), one(1), forged])).await;
    agg.apply(Source::Results, keep(Source::Results, &[sealed("bj", 3)])).await;
    assert!(report_of(&store, "bj").await.is_none(), "complete without chunk 2");
    agg.apply(Source::Results, keep(Source::Results, &[one(2)])).await;
    let r = report_of(&store, "bj").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 3));
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count)).collect::<Vec<_>>(), [("a", 3)]);
    // A real failure report for a chunk whose blob is gone, before the seal: it waits on the queue
    // (the job has no record of the chunk until its manifest is written), then counts.
    put_records(&store, "gone", &[1]).await;
    let report = failed("gone", 1, 1, "blob does not exist");
    let first = agg.apply(Source::Results, keep(Source::Results, &[one_of("gone", 0), report.clone()])).await;
    assert!(first.release.len() == 1 && first.delete.is_empty(), "the report waits on the queue, the result in the job");
    store.put(&manifest_key("gone"), Bytes::from(serde_json::to_vec(&manifest("gone", &[1, 1])).unwrap()), "application/json").await.unwrap();
    agg.apply(Source::Results, keep(Source::Results, &[sealed("gone", 2)])).await;
    assert!(report_of(&store, "gone").await.is_none(), "the failure report was not counted before the seal");
    agg.apply(Source::Results, keep(Source::Results, &[report])).await;
    let r = report_of(&store, "gone").await.expect("finished once the report came back");
    assert_eq!((r.status, r.failed_chunks.len(), r.failed_chunks[0].chunk), (JobStatus::Partial, 1, 1));
}

fn one_of(job: &str, c: u32) -> Message {
    result(job, c, vec![acct("a", 1, 100, 1)])
}

/// Sequence 6: a failure report on the last chunk lands before its real result. The job waits the
/// settle time before it is finished, and the real result replaces the failure (it was once
/// finished `partial` at once and the real result dropped). A failure with nothing after it
/// finishes the job `partial` once the settle time has passed.
#[tokio::test(start_paused = true)]
async fn a_real_result_after_a_failure_on_the_last_chunk_still_counts() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("ff", &[1, 1])).await;
    put_manifest(&store, &manifest("fp", &[1, 1])).await;
    let agg = Aggregator::new(store.clone());
    let one = |job: &str, c: u32| result(job, c, vec![acct("a", 1, 100, 1)]);
    for job in ["ff", "fp"] {
        agg.apply(Source::Results, keep(Source::Results, &[one(job, 0), sealed(job, 2), failed(job, 1, 1, "bad rows")])).await;
    }
    agg.flush_idle().await;
    assert!(report_of(&store, "ff").await.is_none() && report_of(&store, "fp").await.is_none(), "finished before the settle time");
    tokio::time::advance(SETTLE / 2).await;
    agg.apply(Source::Results, keep(Source::Results, &[one("ff", 1)])).await;
    let r = report_of(&store, "ff").await.expect("the real result completes it");
    assert_eq!((r.status, r.transactions.processed, r.failed_chunks.len()), (JobStatus::Complete, 2, 0));
    agg.flush_idle().await;
    assert!(report_of(&store, "fp").await.is_none());
    tokio::time::advance(SETTLE / 2).await;
    agg.flush_idle().await;
    let r = report_of(&store, "fp").await.expect("finished once settled");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 1, 1));
}

/// Writes of reports take `delay` (a slow S3 answer in the middle of a finish).
struct SlowReports {
    delay: Duration,
}

#[async_trait::async_trait]
impl Hook for SlowReports {
    async fn put_if(
        &self,
        inner: &dyn BlobStore,
        key: &str,
        body: Bytes,
        content_type: &str,
        meta: &BTreeMap<String, String>,
        cond: &Cond,
    ) -> Result<Option<String>> {
        if key.ends_with("/report.json") {
            tokio::time::sleep(self.delay).await;
        }
        inner.put_if(key, body, content_type, meta, cond).await
    }
}

/// A finish that takes three times the lease (its report write is slow) keeps the lease: the timer
/// renews it while the job is busy, so another controller finds the job taken and hands its message
/// back, and the owner writes the report (the busy job's lease once lapsed, and the job changed hands
/// mid-finish).
#[tokio::test(start_paused = true)]
async fn a_lease_is_renewed_while_its_job_is_busy() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("lb", &[1])).await;
    let clock = Clock::driven(1_800_000_000_000);
    let lease = Duration::from_secs(3);
    let slow: Arc<dyn BlobStore> = Hooked::new(store.clone(), SlowReports { delay: lease * 3 });
    let a = Arc::new(Aggregator::with(slow, Options { owner: "a".into(), lease, clock, ..Options::default() }));
    let b = Aggregator::with(store.clone(), Options { owner: "b".into(), lease, clock, ..Options::default() });
    let timer = {
        let a = a.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(FLUSH_INTERVAL).await;
                a.renew_leases().await;
            }
        })
    };
    let r0 = result("lb", 0, vec![acct("x", 1, 100, 1)]);
    let finishing = {
        let (a, batch) = (a.clone(), [r0.clone(), sealed("lb", 1)]);
        tokio::spawn(async move { a.apply(Source::Results, keep(Source::Results, &batch)).await })
    };
    tokio::time::sleep(lease * 2).await;
    assert!(!finishing.is_finished(), "the finish is still writing the report");
    let turned = b.apply(Source::Results, keep(Source::Results, &[r0])).await;
    assert_eq!(turned.release.len(), 1, "the job is still a's: b hands the message back");
    assert_eq!(finishing.await.unwrap().delete.len(), 2, "a finished the job");
    timer.abort();
    let r = report_of(&store, "lb").await.expect("a wrote the report");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 1));
}

/// Issue bug 1: a seal smaller than the manifest is refused (quarantined with the reason), never
/// applied: the job is not finished from the chunks that arrived; the real seal finishes it exact.
#[tokio::test]
async fn a_seal_that_disagrees_with_the_manifest_is_quarantined_never_applied() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("s3", &[1, 1, 1])).await;
    let agg = quick(store.clone());
    let one = |c: u32| result("s3", c, vec![acct("a", 1, 100, 1)]);
    let applied = agg.apply(Source::Results, keep(Source::Results, &[sealed("s3", 1), one(0)])).await;
    assert_eq!(applied.delete.len(), 1, "the forged seal is quarantined and deleted; the result waits for a checkpoint");
    assert!(report_of(&store, "s3").await.is_none(), "a seal of 1 does not finish a job of 3 chunks");
    let why = quarantined_of(&store, "s3").await;
    assert!(why.len() == 1 && why[0].contains("says 1 chunks, its manifest 3"), "{why:?}");
    agg.apply(Source::Results, keep(Source::Results, &[one(1), one(2), sealed("s3", 3)])).await;
    let r = report_of(&store, "s3").await.expect("the real seal finishes it");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Complete, 3, 0));
}

/// Issue bug 2: a result declaring more rows than its chunk has is refused, not counted; the real
/// result is.
#[tokio::test]
async fn a_result_whose_count_differs_from_its_chunk_is_refused_never_counted() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("c3", &[3])).await;
    let agg = quick(store.clone());
    let forged = result("c3", 0, vec![acct("a", 3, 300, 3), acct("evil", 8, 800, 0)]);
    let real = result("c3", 0, vec![acct("a", 3, 300, 3)]);
    agg.apply(Source::Results, keep(Source::Results, &[forged, real, sealed("c3", 1)])).await;
    let r = report_of(&store, "c3").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 3), "11 transactions are never billed for 3 accepted");
    assert_eq!(r.accounts.iter().map(|a| a.account_id.as_str()).collect::<Vec<_>>(), ["a"]);
    let why = quarantined_of(&store, "c3").await;
    assert!(why.len() == 1 && why[0].contains("declares 11 transactions; the chunk has 3 as recorded"), "{why:?}");
}

/// Issue bug 3: a few kilobytes that declare 200,000 rows for a chunk of 3 are refused before any
/// decoding; one that declares the chunk's 3 rows is decoded within the chunk's figures (stopped at
/// its 4th row), and nothing held at once ever exceeds the memory budget.
#[tokio::test]
async fn a_well_formed_bomb_is_capped_by_its_chunk_and_the_budget() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("b3", &[3])).await;
    let rows: Vec<AccountTotals> = (0..200_000).map(|i| acct(&format!("x{i}"), 1, 1, 0)).collect();
    let csv = accounts_to_zstd_csv(rows.iter().map(AccountTotals::borrowed));
    assert!(csv.len() < 1 << 20, "small on the wire: {} bytes", csv.len());
    let data = fleet_domain::codec::base64_encode(&csv);
    let declared = with_payload("b3", 0, 200_000, AccountsPayload::ZstdCsv { data: data.clone() });
    let lying = with_payload("b3", 0, 3, AccountsPayload::ZstdCsv { data });
    let agg = quick_with(store.clone(), Options { decode_budget: 1 << 20, ..Options::default() });
    agg.apply(Source::Results, keep(Source::Results, &[declared, lying, sealed("b3", 1)])).await;
    let r = report_of(&store, "b3").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.transactions.failed), (JobStatus::Partial, 0, 3));
    assert!(r.failed_chunks[0].reason.contains("decompresses to more than"), "{:?}", r.failed_chunks);
    assert!(agg.decode_budget().high_water() <= 1 << 20);
    assert!(quarantined_of(&store, "b3").await[0].contains("declares 200000 transactions"));
}

/// Issue bug 4: results for job ids nobody submitted make no job, lease, checkpoint or report: they
/// wait a few receives on the queue, then are quarantined; from a dead-letter queue, at once.
#[tokio::test]
async fn results_for_jobs_nobody_submitted_make_nothing_and_are_quarantined() {
    let store = MemoryStore::new();
    let agg = quick(store.clone());
    let forged: Vec<Message> = (0..50).map(|i| result(&format!("forged{i}"), 0, vec![acct("a", 1, 100, 1)])).collect();
    let first = agg.apply(Source::Results, keep(Source::Results, &forged)).await;
    assert_eq!((first.release.len(), first.delete.len()), (50, 0), "back to the queue for a while");
    let again: Vec<Message> = forged.iter().map(|m| Message { receive_count: UNRECORDED_RECEIVES, ..m.clone() }).collect();
    let last = agg.apply(Source::Results, keep(Source::Results, &again)).await;
    assert_eq!((last.release.len(), last.delete.len()), (0, 50), "quarantined, then deleted");
    let dead = agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &forged[..5])).await;
    assert_eq!(dead.delete.len(), 5, "from the dead-letter queue at once");
    assert_eq!(agg.open_jobs(), 0);
    for prefix in ["leases/", "jobs/", "open/", "warehouse/", "tables/"] {
        assert!(store.list(prefix, 10).await.unwrap().is_empty(), "nothing under {prefix}");
    }
    assert_eq!(quarantined_of(&store, "forged7").await.len(), 1);
}

/// Issue bug 5: a seal for a job with no manifest is quarantined after a bounded wait, never cycled.
#[tokio::test]
async fn a_seal_without_a_manifest_is_quarantined_after_a_bounded_wait() {
    let store = MemoryStore::new();
    put_records(&store, "nm", &[1]).await;
    let agg = quick(store.clone());
    let seal = sealed("nm", 1);
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, std::slice::from_ref(&seal))).await.release.len(), 1);
    let late = Message { receive_count: UNRECORDED_RECEIVES, ..seal };
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, &[late])).await.delete.len(), 1);
    let why = quarantined_of(&store, "nm").await;
    assert!(why.len() == 1 && why[0].contains("has no manifest"), "{why:?}");
}

/// Job `s` (two chunks) on a store that stops answering when told, its results queue as partition 0.
async fn partition_zero_fixture() -> (Arc<BrokenStore>, Arc<MemoryQueue>, Completions, Aggregator) {
    let store = Broken::with_breaker("no-such-job");
    put_manifest(&store.memory, &manifest("s", &[1, 1])).await;
    let queue = MemoryQueue::new("billing-results", Duration::from_secs(30));
    let done = Completions::start(queue.clone(), BatchSettings::default());
    let options = Options { owner: "c".into(), lease: Duration::from_secs(30), partition_queues: partitioned(&["billing-results"]), ..Options::default() };
    let agg = quick_with(store.clone(), options);
    agg.reading(0);
    (store, queue, done, agg)
}

#[tokio::test(start_paused = true)]
async fn a_stop_hands_held_messages_back_at_once_for_the_next_reader() {
    // The store stops answering with a batch in hand: the batch is held (its visibility kept). On a
    // stop (or its partition given up) it goes back to its queue at once, for whoever reads it next,
    // instead of waiting out the hold's extended visibility. (Written for the mutation harness: it
    // found that the hold's extension could be sent after the release, undoing it.)
    let (store, queue, done, agg) = partition_zero_fixture().await;
    store.down.store(true, Ordering::Relaxed);
    queue.send(vec![result("s", 0, vec![acct("a", 1, 100, 1)]).body, sealed("s", 2).body]).await.unwrap();
    let batch: Vec<_> = queue.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done.keep(d)).collect();
    assert_eq!(batch.len(), 2);
    let applied = agg.apply(Source::Results, batch).await;
    assert!(applied.delete.is_empty() && applied.release.is_empty());
    assert_eq!(agg.held(None), 2, "held while the store does not answer");
    assert!(agg.hand_back_held(Some(1)).is_empty(), "another partition's stop leaves them");
    let back = agg.hand_back_held(Some(0));
    assert_eq!((back.len(), agg.held(None)), (2, 0), "its own partition's stop hands them back");
    for k in back {
        k.release(Duration::ZERO);
    }
    // Past the queue's visibility timeout, short of the hold's: the hold's extension, pushed before
    // the release, was not sent after it (it made the message invisible again for 120 s).
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(queue.depth().await.unwrap().visible, 2, "visible at once, not after the hold's visibility");
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_fails_after_its_partition_was_let_go_is_handed_back_not_held() {
    // A batch whose handler outlived its partition's stop (the stop's grace ran out) fails on the
    // store afterwards: this controller no longer reads the partition, so the batch goes back to its
    // queue at once for the partition's new owner instead of being held (invisible for the hold's
    // two minutes). Read again, the partition's messages are held as before.
    let (store, queue, done, agg) = partition_zero_fixture().await;
    assert!(agg.let_go(0).await.is_empty());
    store.down.store(true, Ordering::Relaxed);
    queue.send(vec![result("s", 0, vec![acct("a", 1, 100, 1)]).body]).await.unwrap();
    let batch: Vec<_> = queue.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done.keep(d)).collect();
    let applied = agg.apply(Source::Results, batch).await;
    // Handed back before anything is tried (its partition is no longer read here).
    assert!(applied.delete.is_empty());
    assert_eq!(applied.release.iter().map(|(_, after)| *after).collect::<Vec<_>>(), [Duration::ZERO], "handed back at once");
    for (k, after) in applied.release {
        k.release(after);
    }
    assert_eq!(agg.held(None), 0, "not held for a partition let go");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(queue.depth().await.unwrap().visible, 1, "back on its queue at once");
    agg.reading(0);
    let batch: Vec<_> = queue.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done.keep(d)).collect();
    agg.apply(Source::Results, batch).await;
    assert_eq!(agg.held(None), 1, "read again: held through the outage");
}

#[tokio::test(start_paused = true)]
async fn a_job_quiet_in_memory_names_its_partition_as_waiting() {
    // A job in memory with a chunk still to come: once quiet for the look's time its partition is
    // waiting (its listeners look, parked or not); news makes it not waiting again; finished, it is
    // gone. A job of no known partition makes every partition waiting.
    let (store, queue, done, agg) = partition_zero_fixture().await;
    let quiet = Duration::from_secs(60);
    queue.send(vec![result("s", 0, vec![acct("a", 1, 100, 1)]).body, sealed("s", 2).body]).await.unwrap();
    let batch: Vec<_> = queue.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done.keep(d)).collect();
    agg.apply(Source::Results, batch).await;
    assert_eq!(agg.waiting(quiet), Waiting::default(), "news just came");
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(agg.waiting(quiet), Waiting { partitions: BTreeSet::from([0]), any: false });
    // A job whose messages came from no partition's queue (the release before partitions).
    put_manifest(&store.memory, &manifest("old", &[1, 1])).await;
    agg.apply(Source::ResultsDeadLetter, keep(Source::ResultsDeadLetter, &[result("old", 0, vec![acct("b", 1, 100, 1)])])).await;
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert!(agg.waiting(quiet).any, "a job of no known partition: every partition looks");
    queue.send(vec![result("s", 1, vec![acct("a", 1, 100, 1)]).body]).await.unwrap();
    let batch: Vec<_> = queue.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done.keep(d)).collect();
    agg.apply(Source::Results, batch).await;
    assert!(report_of(&store.memory, "s").await.is_some(), "finished with its last chunk");
    assert!(agg.waiting(quiet).partitions.is_empty(), "a finished job waits for nothing");
}

#[tokio::test(start_paused = true)]
async fn a_finish_completed_by_another_controller_after_midnight_files_the_rows_under_the_committed_day() {
    // The job's ending is committed at 23:59 on one controller, whose write of the accounts table
    // fails; another controller, its clock a day on, finishes it: the tables' objects are filed under
    // the committed day, once each, and the report says the committed time.
    let broken = Broken::new("tables/accounts/");
    let store = broken.memory.clone();
    put_manifest(&store, &manifest("mid", &[1, 1])).await;
    let epoch = 1_795_823_940_000; // 2026-11-27T23:59:00Z
    let first = quick_with(
        broken.clone(),
        Options { owner: "c1".into(), lease: Duration::from_secs(30), clock: crate::clock::Clock::driven(epoch), ..Options::default() },
    );
    let msgs = [result("mid", 0, vec![acct("a", 1, 100, 1)]), result("mid", 1, vec![acct("b", 1, 250, 2)]), sealed("mid", 2)];
    first.apply(Source::Results, keep(Source::Results, &msgs)).await;
    assert!(report_of(&store, "mid").await.is_none(), "the accounts table could not be written: no report yet");
    assert!(store.list("tables/", 10).await.unwrap().is_empty());
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("mid")).await.unwrap().unwrap(), 1 << 20).unwrap();
    assert!(cp.finishing, "the ending is committed");
    assert_eq!(cp.ended_at.as_deref(), Some("2026-11-27T23:59:00Z"));
    drop(first);

    let clock = crate::clock::Clock::driven(epoch + 86_400_000);
    let second = quick_with(store.clone(), Options { owner: "c2".into(), lease: Duration::from_secs(30), clock, ..Options::default() });
    // c1's lease (never given back) is judged on c2's own clock, whatever c1's said: taken once c2 has
    // seen it unchanged for a lease.
    second.apply(Source::Results, keep(Source::Results, &[sealed("mid", 2)])).await;
    assert!(report_of(&store, "mid").await.is_none(), "c1's lease, first seen now, still runs");
    tokio::time::advance(Duration::from_secs(31)).await;
    second.apply(Source::Results, keep(Source::Results, &[sealed("mid", 2)])).await;
    let r = report_of(&store, "mid").await.expect("the second controller writes the report");
    assert_eq!(r.finished_at, "2026-11-27T23:59:00Z", "the committed time, not the writer's clock");
    assert_eq!(store.list("tables/", 10).await.unwrap(), ["tables/accounts/billed_on=2026-11-27/mid.parquet", "tables/jobs/billed_on=2026-11-27/mid.parquet"]);
    // Finished again (a late duplicate, a controller that missed the end): still one object each.
    second.apply(Source::Results, keep(Source::Results, &[sealed("mid", 2)])).await;
    assert_eq!(store.list("tables/", 10).await.unwrap().len(), 2);
}

/// The chunk records of a job whose messages travel on results partition `p`, as the initiator writes them.
async fn put_records_on(store: &MemoryStore, job: &str, chunks: &[u64], p: u16) {
    for (c, &n) in chunks.iter().enumerate() {
        let record = ChunkRecord { transactions: n, raw_bytes: 100 * n, partition: Some(p) };
        let key = fleet_domain::layout::chunk_key(job, c as u32);
        store.put_if(&key, Bytes::from_static(b"chunk"), "application/zstd", &record.to_meta(), &Cond::Any).await.unwrap();
    }
}

/// Issue 58, finding 1: a copy of job J's result read from another partition (a stray) while J is in
/// no reader's memory made that partition's reader take J's lease and keep it; J's own reader handed
/// J's real results back for ever. Now the stray is forwarded to J's partition (where it is a
/// duplicate) and deleted; no lease is taken, and J finishes exactly on its own reader.
#[tokio::test(start_paused = true)]
async fn a_stray_on_another_partition_is_forwarded_never_leased() {
    let store = MemoryStore::new();
    let mut m = manifest("st", &[1, 1]);
    m.partition = 0;
    put_records_on(&store, "st", &m.chunk_transactions, 0).await;
    let clock = Clock::driven(1_800_000_000_000);
    let q0 = MemoryQueue::new("billing-results", Duration::from_secs(30));
    let q1 = MemoryQueue::new("billing-results-1", Duration::from_secs(30));
    let [a, b] = ["a", "b"].map(|owner| {
        let partition_queues = partitioned(&["billing-results", "billing-results-1"]);
        let strays_to = BTreeMap::from([(0, q0.clone() as Arc<dyn Queue>), (1, q1.clone() as Arc<dyn Queue>)]);
        quick_with(store.clone(), Options { owner: owner.into(), clock, partition_queues, strays_to, ..Options::default() })
    });
    a.reading(0);
    b.reading(1);
    let r0 = result("st", 0, vec![acct("x", 1, 100, 1)]);
    // The stray reaches B, which reads partition 1, before the job's manifest exists.
    q1.send(vec![r0.body.clone()]).await.unwrap();
    let done1 = Completions::start(q1.clone(), BatchSettings::default());
    let stray: Vec<Kept> = q1.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done1.keep(d)).collect();
    let applied = b.apply(Source::Results, stray).await;
    assert_eq!((applied.delete.len(), applied.release.len()), (1, 0), "the stray is deleted once forwarded");
    assert_eq!(b.open_jobs(), 0, "B neither loaded nor leased the job");
    assert!(store.get(&fleet_domain::layout::lease_key("st")).await.unwrap().is_none(), "no lease taken for a stray");
    assert_eq!(q0.depth().await.unwrap().visible, 1, "forwarded to the job's own partition");
    // J's own reader applies the forwarded copy, the real results and the seal: exact, at once.
    store.put(&manifest_key("st"), Bytes::from(serde_json::to_vec(&m).unwrap()), "application/json").await.unwrap();
    q0.send(vec![r0.body.clone(), result("st", 1, vec![acct("y", 1, 200, 2)]).body, sealed("st", 2).body]).await.unwrap();
    let done0 = Completions::start(q0.clone(), BatchSettings::default());
    let batch: Vec<Kept> = q0.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done0.keep(d)).collect();
    assert_eq!(batch.len(), 4);
    let applied = a.apply(Source::Results, batch).await;
    assert!(applied.release.is_empty(), "nothing handed back: nobody else holds the job");
    let r = report_of(&store, "st").await.expect("finished by its own reader");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 2));
}

/// Without a queue for the job's partition (the count lowered while it was in flight), a message is
/// applied where it was read, as before partitions.
#[tokio::test(start_paused = true)]
async fn a_message_of_a_partition_with_no_queue_is_applied_where_it_is_read() {
    let store = MemoryStore::new();
    put_records_on(&store, "gone", &[1], 5).await;
    let agg = quick(store.clone());
    agg.apply(Source::Results, keep(Source::Results, &[result("gone", 0, vec![acct("x", 1, 100, 1)])])).await;
    assert_eq!(agg.open_jobs(), 1, "applied here");
}

/// Issue 58, remnant: a job whose results account for fewer transactions than its manifest accepted
/// (processed + failed != accepted) is never written `complete`.
#[tokio::test]
async fn a_report_is_complete_only_when_every_accepted_transaction_is_counted() {
    let store = MemoryStore::new();
    let mut m = manifest("cnt", &[1, 1]);
    put_manifest(&store, &m).await;
    // The manifest's own figures disagree with its chunks (accepted 3, chunks 1 + 1).
    m.accepted = 3;
    store.put(&manifest_key("cnt"), Bytes::from(serde_json::to_vec(&m).unwrap()), "application/json").await.unwrap();
    let agg = quick(store.clone());
    let msgs = [result("cnt", 0, vec![acct("a", 1, 100, 1)]), result("cnt", 1, vec![acct("b", 1, 100, 1)]), sealed("cnt", 2)];
    agg.apply(Source::Results, keep(Source::Results, &msgs)).await;
    let r = report_of(&store, "cnt").await.expect("finished");
    assert_eq!(r.status, JobStatus::Partial, "{:?}", r.note);
    assert!(r.note.as_deref().is_some_and(|n| n.contains("manifest accepted 3")), "{:?}", r.note);
}

/// Issue 58, remnants: a chunk blob without a record (the release before records) is held to the
/// manifest once the manifest exists, not to the message's own count; and a result that could decode
/// to more than the whole decode budget is refused, not decoded alone past it.
#[tokio::test]
async fn an_unrecorded_chunk_is_judged_by_the_manifest_and_an_oversized_share_refused() {
    let store = MemoryStore::new();
    put_chunks(&store, "old", 2).await;
    let m = manifest("old", &[3, 2]);
    store.put(&manifest_key("old"), Bytes::from(serde_json::to_vec(&m).unwrap()), "application/json").await.unwrap();
    let agg = quick_with(store.clone(), Options { decode_budget: 4 << 20, ..Options::default() });
    // 11 transactions declared for a chunk of 3: refused against the manifest.
    let eleven = result("old", 0, (0..11).map(|i| acct(&format!("a{i}"), 1, 100, 1)).collect());
    let applied = agg.apply(Source::Results, keep(Source::Results, &[eleven])).await;
    assert_eq!(applied.delete.len(), 1, "quarantined");
    let why = quarantined_of(&store, "old").await;
    assert!(why.iter().any(|w| w.contains("declares 11 transactions; the chunk has 3")), "{why:?}");
    // Without a manifest, the declared count is all there is: a result declaring a million rows
    // could decode far past a 4 MiB budget, and is refused.
    put_chunks(&store, "old2", 1).await;
    let huge = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: "old2".into(),
        chunk: 0,
        transactions: 1_000_000,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![acct("z", 1_000_000, 100, 1)] } },
        requests: RequestCounts::default(),
    });
    let applied = agg.apply(Source::Results, keep(Source::Results, &[msg(serde_json::to_string(&huge).unwrap())])).await;
    assert_eq!(applied.delete.len(), 1, "quarantined");
    let why = quarantined_of(&store, "old2").await;
    assert!(why.iter().any(|w| w.contains("more than the decode budget")), "{why:?}");
    assert_eq!(agg.open_jobs(), 0, "nothing applied");
}

/// `m` signed with `key` (as its role's sender signs it).
fn signed(mut m: Message, key: &fleet_io::auth::Key) -> Message {
    m.attrs.auth = Some(key.sign(&m.body));
    m
}

/// `m` (a result) with its chunk's token, as `submitter` made it for the work item.
fn with_token(mut m: Message, submitter: &fleet_io::auth::Key) -> Message {
    let Ok(ResultMessage::Chunk(c)) = serde_json::from_str::<ResultMessage>(&m.body) else { panic!("a result") };
    m.attrs.chunk_token = Some(submitter.chunk_token(&c.job_id, c.chunk));
    m
}

/// Issue 58, findings 2 and 4 (authority by role): with a keyring, a message counts only when a role
/// that may send it signed it. A processor's forged abandon (any results-queue sender knew the job's
/// id) and an unsigned or submitter-signed result are quarantined; the job finishes exact from its
/// processors' results and its submitter's seal; an operator's abandon still ends a job.
#[tokio::test]
async fn only_a_role_that_may_send_a_message_makes_it_count() {
    use fleet_io::auth::{Key, Keyring, Role};
    let (processor, submitter, operator) = (Key::generate(Role::Processor), Key::generate(Role::Submitter), Key::generate(Role::Operator));
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("rl", &[1, 1])).await;
    let keyring = Some(Keyring::new([processor.clone(), submitter.clone(), operator.clone()]));
    let agg = quick_with(store.clone(), Options { keyring, ..Options::default() });
    let forged = [
        signed(abandon("rl"), &processor),
        result("rl", 0, vec![acct("mallory", 1, 99_999_999_999, 0)]),
        signed(result("rl", 1, vec![acct("mallory", 1, 99_999_999_999, 0)]), &submitter),
        signed(sealed("rl", 2), &processor),
    ];
    let applied = agg.apply(Source::Results, keep(Source::Results, &forged)).await;
    assert_eq!(applied.delete.len(), 4, "all four quarantined, then deleted");
    assert_eq!(agg.open_jobs(), 0, "nothing of the job loaded or leased");
    let why = quarantined_of(&store, "rl").await;
    assert_eq!(why.len(), 4, "{why:?}");
    assert!(why.iter().any(|w| w.contains("an abandon of job rl signed by a processor, which may not send one")), "{why:?}");
    assert!(why.iter().any(|w| w.contains("is not signed")), "{why:?}");
    // A rogue processor's result with the recorded count and its own account, signed with its own
    // key but without the chunk's token (it was not handed the work item).
    let rogue = signed(result("rl", 0, vec![acct("mallory", 1, 99_999_999_999, 0)]), &processor);
    assert_eq!(agg.apply(Source::Results, keep(Source::Results, &[rogue])).await.delete.len(), 1);
    assert!(quarantined_of(&store, "rl").await.iter().any(|w| w.contains("no valid token of its chunk")));
    let real = [
        signed(with_token(result("rl", 0, vec![acct("a", 1, 100, 1)]), &submitter), &processor),
        signed(with_token(result("rl", 1, vec![acct("b", 1, 200, 2)]), &submitter), &processor),
        signed(sealed("rl", 2), &submitter),
    ];
    agg.apply(Source::Results, keep(Source::Results, &real)).await;
    let r = report_of(&store, "rl").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed, r.accounts.len()), (JobStatus::Complete, 2, 2));
    assert!(r.accounts.iter().all(|a| a.account_id != "mallory"));
    // An operator's abandon counts.
    put_manifest(&store, &manifest("op", &[1, 1])).await;
    agg.apply(Source::Results, keep(Source::Results, &[signed(with_token(result("op", 0, vec![acct("a", 1, 100, 1)]), &submitter), &processor)])).await;
    agg.apply(Source::Results, keep(Source::Results, &[signed(abandon("op"), &operator)])).await;
    assert_eq!(report_of(&store, "op").await.expect("abandoned").status, JobStatus::Abandoned);
}

#[tokio::test(start_paused = true)]
async fn a_job_begun_before_the_checkpoints_prefix_is_resumed_from_where_its_checkpoint_was_and_moved() {
    // c1 (standing in for an earlier release) applies chunk 0; its checkpoint is then put where
    // releases before `checkpoints/` kept it. c2 resumes the job from there, finishes it exactly,
    // and writes the checkpoint under `checkpoints/` (If-None-Match), the old one read, never written.
    use fleet_domain::layout::legacy_checkpoint_key;
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("mig", &[1, 1, 1])).await;
    let first = quick_owned(store.clone(), "c1".into(), Duration::from_secs(30));
    first.apply(Source::Results, keep(Source::Results, &[result("mig", 0, vec![acct("a", 1, 100, 1)])])).await;
    first.flush().await;
    drop(first);
    let body = store.get(&checkpoint_key("mig")).await.unwrap().expect("c1's checkpoint");
    let meta = store.head(&checkpoint_key("mig")).await.unwrap().unwrap();
    store.put_if(&legacy_checkpoint_key("mig"), body.clone(), "application/zstd", &meta, &Cond::Any).await.unwrap();
    store.delete(&checkpoint_key("mig")).await.unwrap();

    let second = quick_owned(store.clone(), "c2".into(), Duration::from_secs(30));
    let rest = [result("mig", 1, vec![acct("b", 1, 250, 2)]), result("mig", 2, vec![acct("a", 1, 50, 1)]), sealed("mig", 3)];
    second.apply(Source::Results, keep(Source::Results, &rest)).await;
    assert!(report_of(&store, "mig").await.is_none(), "c1's lease, first seen now, still runs");
    tokio::time::advance(Duration::from_secs(31)).await;
    second.apply(Source::Results, keep(Source::Results, &rest)).await;
    let r = report_of(&store, "mig").await.expect("finished from the moved checkpoint");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 3), "{r:?}");
    let a = r.accounts.iter().find(|x| x.account_id == "a").expect("account a");
    assert_eq!((a.count, a.gross.as_str()), (2, "1.50"), "chunk 0 (from the old checkpoint) and chunk 2");
    let cp: Checkpoint = from_zstd_json(&store.get(&checkpoint_key("mig")).await.unwrap().expect("moved"), 1 << 20).unwrap();
    assert!(cp.status.is_finished());
    assert_eq!(store.get(&legacy_checkpoint_key("mig")).await.unwrap(), Some(body), "the old checkpoint is never written");
    // A late copy of chunk 0 is a duplicate: the moved checkpoint says the job finished.
    second.apply(Source::Results, keep(Source::Results, &[result("mig", 0, vec![acct("a", 1, 100, 1)])])).await;
    second.flush().await;
    assert_eq!(report_of(&store, "mig").await.unwrap().transactions.processed, 3);
}
