//! The processor against the in-memory queue and blob store: a good work item is billed, its result
//! sent and the item deleted; a corrupt one is never deleted, is reported failed on its last allowed
//! attempt and ends in the dead-letter queue.

use std::time::Duration;

use bytes::Bytes;
use fleet_domain::billing::Tariff;
use fleet_domain::codec::{encode_chunk, ChunkWriter};
use fleet_domain::layout::chunk_key;
use fleet_domain::model::{AccountsPayload, BlobRef, ChunkOutcome, ResultMessage, WorkItem};
use fleet_domain::validate::validate_row;
use fleet_io::blob::BlobStore;
use fleet_io::call::Op;
use fleet_io::memory::{MemoryQueue, MemoryStore};
use fleet_io::queue::Queue;
use tokio_util::sync::CancellationToken;

async fn work_item(store: &MemoryStore, job: &str, chunk: u32, rows: &[(&str, &str, &str)]) -> String {
    let mut w = ChunkWriter::new();
    for (id, acct, amount) in rows {
        let t = validate_row(Some(id.as_bytes()), Some(acct.as_bytes()), Some(amount.as_bytes()), Some(b"EUR"), Some(b"2026-11-21T10:00:00Z")).unwrap();
        w.push(&t);
    }
    let e = encode_chunk(w);
    let key = chunk_key(job, chunk);
    store.put(&key, Bytes::from(e.bytes.clone()), "application/zstd").await.unwrap();
    let item = WorkItem {
        partition: 0,
        v: 1,
        job_id: job.into(),
        chunk,
        transactions: e.rows,
        blob: BlobRef { key, sha256: e.sha256, compressed_bytes: e.bytes.len() as u64, raw_bytes: e.raw_bytes },
        tariff: Tariff::default(),
    };
    serde_json::to_string(&item).unwrap()
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The tests here that run a processor, one at a time: the process's metrics are shared, and the
/// first test reads what its run added.
static ONE_PROCESSOR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn metric(series: &str) -> Option<u64> {
    let metrics = fleet_engine::http::render_metrics(&[]);
    metrics.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse::<u64>().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bills_good_items_and_fails_corrupt_ones_at_once() {
    let _one = ONE_PROCESSOR.lock().await;
    let before: Vec<u64> = [
        r#"processor_chunks_total{result="billed"} "#,
        r#"processor_chunks_total{result="failed"} "#,
        "processor_transactions_billed_total ",
        "processor_results_sent_total ",
    ]
    .iter()
    .map(|s| metric(s).unwrap_or(0))
    .collect();
    let store = MemoryStore::new();
    let dlq = MemoryQueue::new("work-dlq", Duration::from_secs(30));
    let work = MemoryQueue::with_dlq("work", Duration::from_secs(30), 2, dlq.clone());
    let results = MemoryQueue::new("results", Duration::from_secs(30));
    let good = work_item(&store, "j1", 0, &[("t1", "a", "100.00"), ("t2", "a", "-5"), ("t3", "b", "15.00")]).await;
    let bad = work_item(&store, "j1", 1, &[("t4", "a", "1.00")]).await;
    store.put(&chunk_key("j1", 1), Bytes::from_static(b"not zstd"), "application/zstd").await.unwrap();
    work.send(vec![good, bad]).await.unwrap();

    let stop = CancellationToken::new();
    let settings = processor::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 5, ..Default::default() };
    let deps = processor::Deps::new(work.clone(), results.clone(), store.clone());
    let running = tokio::spawn(processor::run(settings, deps, stop.clone()));

    wait_until("two results", || results.bodies().len() == 2).await;
    wait_until("both items deleted", || work.bodies().is_empty()).await;
    assert!(dlq.bodies().is_empty(), "a chunk that can never succeed is failed at once, not cycled to the DLQ");
    let mut outcomes: Vec<ResultMessage> = results.bodies().iter().map(|b| serde_json::from_str(b).unwrap()).collect();
    outcomes.sort_by_key(|m| if let ResultMessage::Chunk(c) = m { c.chunk } else { u32::MAX });
    let ResultMessage::Chunk(ok) = &outcomes[0] else { panic!("chunk result expected") };
    let ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts } } = &ok.outcome else { panic!("inline result expected: {:?}", ok.outcome) };
    let a = accounts.iter().find(|x| x.account_id == "a").unwrap();
    assert_eq!((a.count, a.gross.to_string(), a.fees.to_string()), (2, "95.00".to_string(), "3.20".to_string()));
    assert!(ok.requests.calls(Op::S3GetObject) == 1 && ok.requests.calls(Op::SqsReceiveMessage) > 0);
    let ResultMessage::Chunk(failed) = &outcomes[1] else { panic!("chunk result expected") };
    let ChunkOutcome::Failed { reason } = &failed.outcome else { panic!("failure expected") };
    assert!(reason.starts_with("corrupt data: blob jobs/j1/chunks/000001") && reason.contains("attempt 1; not retried"), "{reason}");
    // The typed events counted what they logged (what this run added to the process's metrics).
    let metrics = fleet_engine::http::render_metrics(&[]);
    let value = |series: &str, i: usize| metrics.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse::<u64>().ok()).map(|v| v - before[i]);
    assert_eq!(value(r#"processor_chunks_total{result="billed"} "#, 0), Some(1), "{metrics}");
    assert_eq!(value(r#"processor_chunks_total{result="failed"} "#, 1), Some(1), "{metrics}");
    assert_eq!(value("processor_transactions_billed_total ", 2), Some(ok.transactions), "{metrics}");
    assert_eq!(value("processor_results_sent_total ", 3), Some(2), "{metrics}");
    let value = |series: &str| metric(series);
    // Both items waited in the queue (a first delivery each), observed as they started.
    assert!(value(r#"processor_work_wait_seconds_count{delivery="first"} "#).is_some_and(|n| n >= 2), "{metrics}");
    assert_eq!(value(r#"processor_chunks_total{result="held"} "#), Some(0), "every result's series is there from the start: {metrics}");
    fleet_test_support::promtool::assert_clean("the processor's /metrics", &metrics);
    stop.cancel();
    running.await.unwrap().unwrap();
}

/// A job's request counts, summed over its results, are what the clients counted: the chunk reads
/// (read off the store's own counter), the result sends (planned as the queue then batches them); the
/// planned deletes are at least the batched deletes made (the completion batcher may merge two
/// handler calls' deletes into one request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_requests_are_what_the_clients_counted() {
    let _one = ONE_PROCESSOR.lock().await;
    let store = MemoryStore::new();
    let work = MemoryQueue::new("work", Duration::from_secs(30));
    let results = MemoryQueue::new("results", Duration::from_secs(30));
    let mut items = Vec::new();
    for chunk in 0..25 {
        items.push(work_item(&store, "j2", chunk, &[("t1", "a", "1.00"), ("t2", "b", "2.00")]).await);
    }
    let reads_before = store.calls().snapshot().calls(Op::S3GetObject);
    work.send(items).await.unwrap();
    let stop = CancellationToken::new();
    let settings = processor::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 5, ..Default::default() };
    let running = tokio::spawn(processor::run(settings, processor::Deps::new(work.clone(), results.clone(), store.clone()), stop.clone()));
    wait_until("25 results", || results.bodies().len() == 25).await;
    wait_until("all items deleted", || work.bodies().is_empty()).await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let mut job = fleet_domain::requests::RequestCounts::default();
    for b in results.bodies() {
        let ResultMessage::Chunk(c) = serde_json::from_str(&b).unwrap() else { panic!("chunk result expected") };
        job.merge(&c.requests);
    }
    let counted = |q: &dyn Queue, op: Op| q.calls().snapshot().calls(op);
    let reads = store.calls().snapshot().calls(Op::S3GetObject) - reads_before;
    assert_eq!(job.calls(Op::S3GetObject), reads, "{job:?}");
    assert_eq!(job.calls(Op::SqsSendMessageBatch), counted(results.as_ref(), Op::SqsSendMessageBatch), "{job:?}");
    let deletes = counted(work.as_ref(), Op::SqsDeleteMessageBatch);
    assert!(deletes > 0 && job.calls(Op::SqsDeleteMessageBatch) >= deletes, "{job:?} against {deletes} deletes");
}

/// The key given in `Deps` reaches the handler: a processor run with a processor's key sends results
/// a controller's keyring counts as a processor's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_with_a_key_signs_its_results() {
    use fleet_io::auth::{Key, Keyring, Role};
    let _one = ONE_PROCESSOR.lock().await;
    let store = MemoryStore::new();
    let work = MemoryQueue::new("work", Duration::from_secs(30));
    let results = MemoryQueue::new("results", Duration::from_secs(30));
    let mut items = Vec::new();
    for chunk in 0..3 {
        items.push(work_item(&store, "j3", chunk, &[("t1", "a", "1.00")]).await);
    }
    work.send(items).await.unwrap();
    let key = Key::generate(Role::Processor);
    let stop = CancellationToken::new();
    let settings = processor::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 5, ..Default::default() };
    let deps = processor::Deps { signing_key: Some(key.clone()), ..processor::Deps::new(work.clone(), results.clone(), store.clone()) };
    let running = tokio::spawn(processor::run(settings, deps, stop.clone()));
    wait_until("3 results", || results.bodies().len() == 3).await;
    stop.cancel();
    running.await.unwrap().unwrap();
    let ring = Keyring::new([key]);
    let got = results.receive(10, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 3);
    for m in &got {
        assert_eq!(ring.verify(&m.body, m.attrs.auth.as_deref()), Ok(Role::Processor), "{}", m.body);
    }
}
