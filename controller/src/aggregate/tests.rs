//! Unit tests of the aggregation rules with the in-memory blob store.

use super::*;
use rust_decimal::Decimal;
use shared::billing::Tariff;
use shared::memory::MemoryStore;
use shared::model::{BlobRef, ChunkResult, Rejected};

fn manifest(job: &str, chunks: &[u64]) -> Manifest {
    Manifest {
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
    let n = accounts.iter().map(|a| a.count).sum();
    let r = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: job.into(),
        chunk,
        transactions: n,
        outcome: Outcome::Processed { payload: AccountsPayload::Inline { accounts } },
        requests: RequestCounts::default(),
    });
    msg(serde_json::to_string(&r).unwrap())
}

fn msg(body: String) -> Message {
    Message { id: "m".into(), receipt: format!("r{}", body.len()), body, receive_count: 1, ..Default::default() }
}

async fn put_manifest(store: &MemoryStore, m: &Manifest) {
    store.put(&manifest_key(&m.job_id), Bytes::from(serde_json::to_vec(m).unwrap()), "application/json").await.unwrap();
}

async fn report_of(store: &MemoryStore, job: &str) -> Option<report::Report> {
    store.get(&report_key(job)).await.unwrap().map(|b| serde_json::from_slice(&b).unwrap())
}

#[tokio::test]
async fn duplicates_count_once_and_report_is_exact() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j1", &[2, 1])).await;
    let mut agg = Aggregator::new(store.clone());
    let r0 = result("j1", 0, vec![acct("a", 2, 1000, 100)]);
    let applied = agg.apply(Source::Results, &[r0.clone(), r0.clone()]).await;
    assert!(applied.delete.is_empty(), "nothing is deleted before a checkpoint covers it");
    assert_eq!(agg.pending(), 2);
    assert_eq!(agg.flush().await.len(), 2, "duplicates are deleted too, after the checkpoint");
    assert!(store.get(&checkpoint_key("j1")).await.unwrap().is_some());
    assert!(report_of(&store, "j1").await.is_none());
    agg.apply(Source::Results, std::slice::from_ref(&r0)).await;
    agg.apply(Source::Results, &[result("j1", 1, vec![acct("a", 1, -500, 0)])]).await;
    assert!(report_of(&store, "j1").await.is_none(), "every chunk is in, but the job is not sealed yet");
    agg.apply(Source::Results, &[sealed("j1", 2)]).await;
    let r = report_of(&store, "j1").await.expect("report written once sealed");
    assert_eq!(r.status, JobStatus::Complete);
    assert_eq!((r.transactions.processed, r.transactions.failed, r.transactions.rejected), (3, 0, 1));
    assert_eq!((r.accounts[0].count, r.accounts[0].gross.as_str(), r.accounts[0].net.as_str()), (3, "5.00", "4.00"));
    let csv = String::from_utf8(store.get(&accounts_key("j1")).await.unwrap().unwrap().to_vec()).unwrap();
    assert_eq!(csv.lines().nth(1), Some("a,EUR,3,5.00,1.00,4.00"));
    // A late duplicate after the report changes nothing.
    agg.apply(Source::Results, &[r0]).await;
    assert_eq!(report_of(&store, "j1").await.unwrap().accounts, r.accounts);
}

#[tokio::test]
async fn restart_resumes_from_checkpoint() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j2", &[1, 1, 1])).await;
    let mut first = Aggregator::new(store.clone());
    first.apply(Source::Results, &[result("j2", 0, vec![acct("a", 1, 100, 33)]), sealed("j2", 3)]).await;
    first.apply(Source::Results, &[result("j2", 1, vec![acct("b", 1, 200, 36)])]).await;
    first.flush().await; // checkpointed; then "crash" before the deletes
    first.apply(Source::Results, &[result("j2", 2, vec![acct("a", 1, 300, 39)])]).await;
    drop(first); // chunk 2 was applied in memory only: lost with the crash, and not deleted
    let mut second = Aggregator::new(store.clone());
    // chunk 1 is redelivered (its delete was lost), then chunk 2 arrives
    second.apply(Source::Results, &[result("j2", 1, vec![acct("b", 1, 200, 36)]), result("j2", 2, vec![acct("a", 1, 300, 39)])]).await;
    let r = report_of(&store, "j2").await.unwrap();
    assert_eq!(r.transactions.processed, 3);
    assert_eq!(r.accounts.iter().map(|a| (a.account_id.as_str(), a.count, a.gross.as_str())).collect::<Vec<_>>(), [("a", 2, "4.00"), ("b", 1, "2.00")]);
}

#[tokio::test]
async fn dead_letter_makes_job_partial_and_failed_result_wins_once() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j3", &[4, 5])).await;
    let mut agg = Aggregator::new(store.clone());
    agg.apply(Source::Results, &[sealed("j3", 2), result("j3", 0, vec![acct("a", 4, 400, 10)])]).await;
    let item = WorkItem {
        v: 1,
        job_id: "j3".into(),
        chunk: 1,
        transactions: 5,
        blob: BlobRef { key: shared::layout::chunk_key("j3", 1), sha256: "0".repeat(64), compressed_bytes: 1, raw_bytes: 1 },
        tariff: Tariff::default(),
    };
    agg.apply(Source::WorkDeadLetter, &[msg(serde_json::to_string(&item).unwrap())]).await;
    let r = report_of(&store, "j3").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert_eq!((r.transactions.processed, r.transactions.failed), (4, 5));
    assert_eq!(r.failed_chunks.len(), 1);
    assert_eq!(r.failed_chunks[0].chunk, 1);
}

#[tokio::test]
async fn missing_manifest_keeps_messages_for_redelivery() {
    let store = MemoryStore::new();
    let mut agg = Aggregator::new(store.clone());
    let batch = [result("j4", 0, vec![acct("a", 1, 100, 1)]), sealed("j4", 1)];
    let applied = agg.apply(Source::Results, &batch).await;
    assert!(applied.delete.is_empty(), "not deleted: the job cannot be finished yet");
    put_manifest(&store, &manifest("j4", &[1])).await;
    let applied = agg.apply(Source::Results, &batch).await;
    assert_eq!(applied.delete.len(), 2);
    assert_eq!(report_of(&store, "j4").await.unwrap().transactions.processed, 1);
}

#[tokio::test]
async fn chunks_beyond_the_sealed_size_are_ignored() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j6", &[1])).await;
    let mut agg = Aggregator::new(store.clone());
    agg.apply(Source::Results, &[sealed("j6", 1), result("j6", 5, vec![acct("x", 9, 900, 9)])]).await;
    assert!(report_of(&store, "j6").await.is_none());
    agg.apply(Source::Results, &[result("j6", 0, vec![acct("a", 1, 100, 1)])]).await;
    let r = report_of(&store, "j6").await.unwrap();
    assert_eq!(r.transactions.processed, 1);
    assert_eq!(r.accounts.len(), 1);
}

#[tokio::test]
async fn inconsistent_result_is_a_failed_chunk_and_garbage_is_not_deleted() {
    let store = MemoryStore::new();
    put_manifest(&store, &manifest("j5", &[3])).await;
    let mut agg = Aggregator::new(store.clone());
    let mut bad: ResultMessage = serde_json::from_str(&result("j5", 0, vec![acct("a", 2, 100, 1)]).body).unwrap();
    if let ResultMessage::Chunk(c) = &mut bad {
        c.transactions = 3;
    }
    let applied = agg.apply(Source::Results, &[msg(serde_json::to_string(&bad).unwrap()), msg("{not json".into()), sealed("j5", 1)]).await;
    assert_eq!(applied.delete.len(), 2, "the garbage message is left to reach the dead-letter queue");
    let r = report_of(&store, "j5").await.unwrap();
    assert_eq!(r.status, JobStatus::Partial);
    assert!(r.failed_chunks[0].reason.contains("counts 2"));
}
