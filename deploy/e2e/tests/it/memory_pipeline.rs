//! The whole pipeline on the in-memory backends (no LocalStack): initiator -> processor -> controller,
//! with a chunk whose per-account totals are too large for a queue message, so the result travels as a
//! blob reference and the controller reads it back.

use std::sync::Arc;
use std::time::Duration;

use crate::support::{assert_consistent, expected_accounts, report_accounts};
use fleet_domain::model::JobStatus;
use fleet_io::blob::BlobStore;
use fleet_io::memory::{Hook, Hooked, MemoryQueue, MemoryStore, Put};
use fleet_io::queue::Queue;
use initiator::submit::{Clients, SubmitOptions};
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_results_travel_as_blobs() {
    let store = MemoryStore::new();
    let work_dlq = MemoryQueue::new("work-dlq", Duration::from_secs(30));
    let work = MemoryQueue::with_dlq("work", Duration::from_secs(30), 3, work_dlq.clone());
    let results = MemoryQueue::new("results", Duration::from_secs(30));

    // 30,000 transactions, each for its own account with a long, poorly compressible id.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.csv");
    let mut csv = String::from("txn_id,account_id,amount,currency,timestamp\n");
    for i in 0..30_000u64 {
        let id = format!("{:016x}{:016x}{:016x}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15), i.wrapping_mul(0xC2B2_AE3D_27D4_EB4F), i ^ 0x5555_5555);
        csv.push_str(&format!("t{i},{id},{}.{:02},EUR,2026-11-21T10:00:00Z\n", i % 997 + 1, i % 100));
    }
    std::fs::write(&path, csv).unwrap();

    let stop = CancellationToken::new();
    let p = tokio::spawn(processor::run(crate::support::fast_processor(), processor::Deps::new(work.clone(), results.clone(), store.clone()), stop.clone()));
    let c = tokio::spawn(controller::run(
        // A day's retention keeps the job's blobs (and leaves a purge marker), so the result blob can be seen.
        controller::Settings {
            listener: fleet_engine::args::ListenerArgs::quick(),
            drain_secs: 5,
            settle_secs: 3,
            blob_retention_secs: 86_400,
            ..Default::default()
        },
        controller::Deps {
            results: results.clone(),
            work_dlq: work_dlq.clone(),
            results_dlq: MemoryQueue::new("results-dlq", Duration::from_secs(30)),
            store: store.clone() as Arc<dyn BlobStore>,
            work: Some(work.clone()),
            triggers: None,
            publish: None,
        },
        stop.clone(),
    ));
    let clients = Clients {
        work: work.clone() as Arc<dyn Queue>,
        results: results.clone() as Arc<dyn Queue>,
        store: store.clone() as Arc<dyn BlobStore>,
        triggers: None,
        signing_key: None,
    };
    let s = initiator::submit::submit(SubmitOptions { chunk_size: 30_000, chunk_bytes: 64 << 20, ..SubmitOptions::new(vec![path.clone()]) }, &clients)
        .await
        .unwrap();
    assert_eq!(s.total_chunks, 1);
    let r = initiator::follow::wait(store.as_ref(), &s.job_id, s.total_chunks, Duration::from_secs(60), false).await.unwrap();
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.accounts.len(), 30_000);
    assert_eq!(report_accounts(&r), expected_accounts(&[path]));
    assert!(store.keys().iter().any(|k| k.contains("/results/")), "the result went through a blob: {:?}", store.keys());
    let marker = format!("/{}", s.job_id);
    let t = std::time::Instant::now();
    while !store.keys().iter().any(|k| k.starts_with(controller::purge::DUE_PREFIX) && k.ends_with(&marker)) {
        assert!(t.elapsed() < Duration::from_secs(5), "no purge marker for the retention: {:?}", store.keys());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The writes made for the job before its report (chunk, result blob, manifest, lease, open
    // marker, checkpoint) and the reads of the chunk, the result blob, the manifest and the (absent)
    // first checkpoint were all counted; the report's own writes are not (docs/requests.md).
    assert!(r.requests.s3["PutObject"] >= 6, "{:?}", r.requests);
    assert!(r.requests.s3["GetObject"] >= 4, "{:?}", r.requests);
    stop.cancel();
    p.await.unwrap().unwrap();
    c.await.unwrap().unwrap();
}

/// Uploads that misbehave: they start failing after `ok` of them (the stack going away
/// mid-submission) and/or take 0-7 ms, varying by key (uploads finish out of order).
struct Uploads {
    ok: Option<std::sync::atomic::AtomicUsize>,
    jitter: bool,
}

#[async_trait::async_trait]
impl Hook for Uploads {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> fleet_io::Result<Option<String>> {
        if self.jitter {
            tokio::time::sleep(Duration::from_millis(xxhash_rust::xxh3::xxh3_64(put.key.as_bytes()) % 8)).await;
        }
        if let Some(ok) = &self.ok {
            if ok.fetch_sub(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                ok.store(0, std::sync::atomic::Ordering::SeqCst);
                return Err(fleet_io::Error::Unreachable {
                    service: fleet_io::error::Service::S3,
                    endpoint: "test".into(),
                    detail: "gone".into(),
                    source: None,
                });
            }
        }
        put.to(inner).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_mid_submission_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("in.csv");
    fleet_domain::generate::write_csv(&mut std::fs::File::create(&path).unwrap(), 5_000, 10, 1, false).unwrap();
    let store = Hooked::new(MemoryStore::new(), Uploads { ok: Some(3.into()), jitter: false });
    let clients = Clients {
        work: MemoryQueue::new("work", Duration::from_secs(30)) as Arc<dyn Queue>,
        results: MemoryQueue::new("results", Duration::from_secs(30)) as Arc<dyn Queue>,
        store: store as Arc<dyn BlobStore>,
        triggers: None,
        signing_key: None,
    };
    // 1,000 chunks of 5: far more than the reader's hand-over channel holds.
    let opts = SubmitOptions { chunk_size: 5, ..SubmitOptions::new(vec![path]) };
    let r = tokio::time::timeout(Duration::from_secs(20), initiator::submit::submit(opts, &clients)).await.expect("submit returned instead of hanging");
    match r {
        Err(initiator::CliError::Infra(e)) => {
            assert!(e.to_string().contains("cannot reach S3"), "{e}")
        }
        other => panic!("expected an infrastructure error, got {other:?}"),
    }
}

/// A submission that fails after work items went out says so, and what became of the job: it is
/// abandoned at once (an `Abandon` on the results queue), not left for the controller's abandon time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_after_work_items_went_out_abandons_the_job_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("in.csv");
    fleet_domain::generate::write_csv(&mut std::fs::File::create(&path).unwrap(), 5_000, 10, 1, false).unwrap();
    let store = Hooked::new(MemoryStore::new(), Uploads { ok: Some(40.into()), jitter: false });
    let work = MemoryQueue::new("work", Duration::from_secs(30));
    let results = MemoryQueue::new("results", Duration::from_secs(30));
    let clients = Clients {
        work: work.clone() as Arc<dyn Queue>,
        results: results.clone() as Arc<dyn Queue>,
        store: store as Arc<dyn BlobStore>,
        triggers: None,
        signing_key: None,
    };
    let opts = SubmitOptions { chunk_size: 5, ..SubmitOptions::new(vec![path]) };
    let r = tokio::time::timeout(Duration::from_secs(20), initiator::submit::submit(opts, &clients)).await.expect("submit returned");
    let Err(e @ initiator::CliError::Enqueued { .. }) = r else { panic!("expected an error after enqueueing, got {r:?}") };
    let initiator::CliError::Enqueued { job_id, enqueued, cause, .. } = &e else { unreachable!() };
    assert!(matches!(**cause, initiator::CliError::Infra(_)), "{cause:?}");
    assert_eq!(e.exit(), initiator::Exit::Infra, "the cause's exit code");
    assert_eq!(*enqueued as usize, work.bodies().len(), "the count said is what is on the queue");
    assert!(*enqueued > 0);
    let line = e.to_string();
    assert!(line.contains(&format!("job {job_id} had {enqueued} work item(s) enqueued")) && line.contains("abandoned"), "{line}");
    let abandon: Vec<String> = results.bodies().into_iter().filter(|b| b.contains("\"abandon\"") || b.contains("Abandon")).collect();
    assert_eq!(abandon.len(), 1, "one abandon request: {:?}", results.bodies());
    assert!(abandon[0].contains(job_id.as_str()) && abandon[0].contains("the submission failed"), "{}", abandon[0]);
}

/// `--group-by account` on a FIFO queue: each account's rows are in one group, in file order, and the
/// groups' chunks arrive in order; on a standard queue it is refused before anything is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_by_account_keeps_each_accounts_order() {
    use initiator::grouping::{GroupBy, Grouping};
    let dir = tempfile::tempdir().unwrap();
    let path = crate::support::generated(dir.path(), "in.csv", 6_000, 37, 5);
    let store = MemoryStore::new();
    let work = MemoryQueue::new("work.fifo", Duration::from_secs(30));
    let clients = Clients {
        work: work.clone() as Arc<dyn Queue>,
        results: MemoryQueue::new("results", Duration::from_secs(30)) as Arc<dyn Queue>,
        store: Hooked::new(store.clone(), Uploads { ok: None, jitter: true }) as Arc<dyn BlobStore>,
        triggers: None,
        signing_key: None,
    };
    let grouping = Grouping::new(Some(GroupBy::Account), 4);
    let opts = SubmitOptions { chunk_size: 250, upload_concurrency: 8, grouping, ..SubmitOptions::new(vec![path.clone()]) };
    let s = initiator::submit::submit(opts, &clients).await.unwrap();
    assert!(s.total_chunks >= 24, "{} chunks", s.total_chunks);
    let delivered = crate::support::drain_fifo(work.as_ref(), store.as_ref()).await;
    assert_eq!(delivered.len() as u32, s.total_chunks);
    let groups: std::collections::BTreeSet<_> = delivered.iter().map(|d| d.group.as_str()).collect();
    assert_eq!(groups.into_iter().collect::<Vec<_>>(), ["accounts-0-of-4", "accounts-1-of-4", "accounts-2-of-4", "accounts-3-of-4"]);
    crate::support::assert_accounts_in_order(&delivered, std::slice::from_ref(&path));

    // Without --group-by, a FIFO queue still gets a group per chunk (no order, full parallelism).
    let s = initiator::submit::submit(SubmitOptions { chunk_size: 1000, ..SubmitOptions::new(vec![path.clone()]) }, &clients).await.unwrap();
    let delivered = crate::support::drain_fifo(work.as_ref(), store.as_ref()).await;
    assert_eq!(delivered.len(), 6);
    assert!(delivered.iter().all(|d| d.group == format!("{}-{}", s.job_id, d.chunk)));

    // A standard queue keeps no order: refused, nothing stored.
    let standard = MemoryStore::new();
    let clients =
        Clients { work: MemoryQueue::new("work", Duration::from_secs(30)) as Arc<dyn Queue>, store: standard.clone() as Arc<dyn BlobStore>, ..clients };
    match initiator::submit::submit(SubmitOptions { grouping, ..SubmitOptions::new(vec![path]) }, &clients).await {
        Err(initiator::CliError::Input(e)) => assert!(e.contains("needs a FIFO work queue") && e.contains("work is a standard queue"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(standard.keys().is_empty());
}
