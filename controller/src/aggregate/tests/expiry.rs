//! Quiet jobs ended: abandoned when never sealed, finished `partial` when sealed and nothing more can
//! arrive, never before the controller has read what waits for them.

use super::*;

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
    assert_eq!(agg.memory().open_jobs(), 0, "memory freed");
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
    agg.release_leases(|_| true).await;
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
    a.release_leases(|_| true).await;
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
