//! Checkpoints: only what changed is written and restored exactly, each message deleted where it came
//! from, an unreadable checkpoint or manifest quarantined, a checkpoint that moves while it is read read
//! again, a write whose answer was lost known as ours, a checkpoint of an older layout moved.

use super::*;
use fleet_io::call::Op;

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
    let want: Vec<(String, u64, String)> = expected.rows().iter().map(|a| (a.account_id.clone(), a.count, fleet_domain::billing::money(a.gross, &a.currency))).collect();
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
    assert_eq!(results.calls().snapshot().calls(Op::SqsDeleteMessageBatch), 1);
    assert_eq!(dlq.calls().snapshot().calls(Op::SqsDeleteMessageBatch), 1);
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
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        let first = put.clone().to(inner).await?;
        if put.key == self.key && *put.cond != Cond::Any && self.lose_answer.swap(false, Ordering::SeqCst) {
            assert!(first.is_some(), "the lost write went through");
            return put.to(inner).await;
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
    a.release_leases(|_| true).await;
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
    assert_eq!(agg.memory().open_jobs(), 1, "still this controller's job");
    agg.apply(Source::Results, keep(Source::Results, &[result("la", 1, vec![acct("x", 1, 200, 1)])])).await;
    let r = report_of(&inner, "la").await.expect("finished");
    assert_eq!((r.status, r.transactions.processed), (JobStatus::Complete, 2));
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
