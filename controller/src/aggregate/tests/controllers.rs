//! Several controllers: a stale owner fenced, leases renewed while a job is busy, dormant jobs left
//! to their partition's reader, strays forwarded to their partition, a finish completed by another
//! controller.

use super::*;

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
    assert_eq!(a.memory().open_jobs(), 0, "a dropped the job");
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

/// Two controllers on one store: A reads results partition 0, B partition 1.
fn readers_of_0_and_1(store: &Arc<MemoryStore>, clock: Clock) -> (Aggregator, Aggregator) {
    let pair = ["a", "b"].map(|owner| {
        let partition_queues = partitioned(&["billing-results", "billing-results-1"]);
        Aggregator::with(store.clone(), Options { owner: owner.into(), clock, partition_queues, ..Options::default() })
    });
    let [a, b] = pair;
    a.reading().read(0);
    b.reading().read(1);
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
    assert_eq!(b.memory().open_jobs(), 0, "nor loaded: no lease taken");
    b.reading().read(0);
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
    old.release_leases(|_| true).await;
    tokio::time::advance(Duration::from_secs(50 * 60)).await;
    assert_eq!(b.scan_open().await.unwrap(), 1, "B knows the job as dormant, of no partition");
    tokio::time::advance(Duration::from_secs(5 * 60)).await;
    let saved = a.apply(Source::Results, keep(Source::Results, &[result("lg", 1, vec![acct("x", 1, 100, 1)])])).await.delete.len();
    assert_eq!(saved + a.flush().await.len(), 1);
    a.release_leases(|_| true).await;
    let progress = store.head(&checkpoint_key("lg")).await.unwrap().and_then(|m| Progress::from_meta(&m)).expect("a checkpoint");
    assert_eq!(progress.partition, Some(0), "A's checkpoint names the partition");
    tokio::time::advance(Duration::from_secs(6 * 60)).await;
    b.expire(hour).await;
    assert_eq!(b.memory().open_jobs(), 0, "B gave the job back (it held its lease while A read its messages)");
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
    put_manifest(&store, &Manifest { chunk_lines: Vec::new(), partition, ..manifest(job, &vec![1; chunks as usize]) }).await;
    let clock = Clock::driven(1_800_000_000_000);
    let old = Aggregator::with(store.clone(), Options { owner: "old".into(), clock, ..Options::default() });
    let mut batch = vec![result(job, 0, vec![acct("x", 1, 100, 1)])];
    batch.extend(seal.then(|| sealed(job, chunks)));
    old.apply(Source::Results, keep(Source::Results, &batch)).await;
    assert_eq!(old.flush().await.len(), batch.len());
    old.release_leases(|_| true).await;
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
    assert_eq!(b.memory().open_jobs(), 0, "B gave the job back: its manifest names partition 0, which A reads");
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
    assert_eq!(b.memory().open_jobs(), 1, "B reads partition 1, which the manifest names: the job stays with B");
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
    news.release_leases(|_| true).await;
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
        agg.reading().read(0);
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
    assert_eq!(heir.memory().open_jobs(), 0);
    let quiet = Duration::from_secs(60);
    tokio::time::advance(quiet).await;
    assert!(heir.waiting(quiet).partitions.contains(&0), "still dormant: its partition's listeners look for its messages");
}

/// Writes of reports take `delay` (a slow S3 answer in the middle of a finish).
struct SlowReports {
    delay: Duration,
}

#[async_trait::async_trait]
impl Hook for SlowReports {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        if put.key.ends_with("/report.json") {
            tokio::time::sleep(self.delay).await;
        }
        put.to(inner).await
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
    assert_eq!(agg.waiting(quiet), Waiting { partitions: std::collections::BTreeSet::from([0]), any: false });
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
    let broken = Broken::new("tables/v2/accounts/");
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
    assert_eq!(store.list("tables/", 10).await.unwrap(), ["tables/v2/accounts/billed_on=2026-11-27/mid.parquet", "tables/v2/jobs/billed_on=2026-11-27/mid.parquet"]);
    // Finished again (a late duplicate, a controller that missed the end): still one object each.
    second.apply(Source::Results, keep(Source::Results, &[sealed("mid", 2)])).await;
    assert_eq!(store.list("tables/", 10).await.unwrap().len(), 2);
}

/// The chunk records of a job whose messages travel on results partition `p`, as the initiator writes them.
async fn put_records_on(store: &MemoryStore, job: &str, chunks: &[u64], p: u16) {
    for (c, &n) in chunks.iter().enumerate() {
        let record = ChunkRecord { transactions: n, raw_bytes: 100 * n, partition: Some(p) };
        let key = fleet_domain::layout::chunk_key(job, c as u32);
        store.put_if(&key, chunk_blob(job, c as u32, n), "application/zstd", &record.to_meta(), &Cond::Any).await.unwrap();
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
    a.reading().read(0);
    b.reading().read(1);
    let r0 = result("st", 0, vec![acct("x", 1, 100, 1)]);
    // The stray reaches B, which reads partition 1, before the job's manifest exists.
    q1.send(vec![r0.body.clone()]).await.unwrap();
    let done1 = Completions::start(q1.clone(), BatchSettings::default());
    let stray: Vec<Kept> = q1.receive(10, Duration::ZERO).await.unwrap().into_iter().map(|d| done1.keep(d)).collect();
    let applied = b.apply(Source::Results, stray).await;
    assert_eq!((applied.delete.len(), applied.release.len()), (1, 0), "the stray is deleted once forwarded");
    assert_eq!(b.memory().open_jobs(), 0, "B neither loaded nor leased the job");
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
    assert_eq!(agg.memory().open_jobs(), 1, "applied here");
}
