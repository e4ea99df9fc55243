//! The reliability suite (part of `cargo test`, so CI runs it), on the LocalStack and RabbitMQ that
//! deploy/test.sh starts:
//! - the whole AWS stack frozen for 10 s mid-job under processor, controller and agent (every SQS and
//!   S3 connection of the fleet through a TCP proxy the test freezes, as SIGSTOP on LocalStack would):
//!   exact totals afterwards, every service still running;
//! - poison work items in one run: a chunk whose blob is missing, a zstd bomb, a duplicated work item,
//!   garbage bodies: the jobs end partial naming exactly the failed chunks, the duplicate changes
//!   nothing, the garbage is quarantined, every other transaction is billed exactly, every service
//!   keeps running.
//!
//! Processor SIGKILL (`processor/tests/localstack.rs`), controller restart and crash
//! (`pipeline.rs`, the container scenarios), RabbitMQ down (`processor/tests/broker_down.rs`, container
//! scenario) and S3 frozen for 3 minutes (`faults.rs`) complete the suite.

use crate::support::Fleet as _;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::proxy::Proxy;
use crate::support::*;
use bytes::Bytes;
use fleet_domain::layout::chunk_key;
use fleet_domain::model::{BlobRef, JobStatus, WorkItem};
use fleet_io::blob::BlobStore;
use fleet_io::call::CallPolicy;
use fleet_io::config::Aws;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::{Delivery, Queue};
use rust_decimal::Decimal;

const T: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_stack_frozen_for_10_s_mid_job_totals_exact_services_alive() {
    let Some(s) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(10) }).await else { return };
    let proxy = Proxy::start(0, "127.0.0.1:4566").await;
    let via = Aws::local(&proxy.endpoint()).await.with_policy(CallPolicy {
        attempt_timeout: Duration::from_secs(3),
        deadline: Duration::from_secs(8),
        ..CallPolicy::default()
    });
    let n = &s.names;
    let (work, work_dlq, results, results_dlq) = (
        via.queue(&n.work_queue).await.unwrap(),
        via.queue(&n.work_dlq()).await.unwrap(),
        via.queue(&n.results_queue).await.unwrap(),
        via.queue(&n.results_dlq()).await.unwrap(),
    );
    let store = via.store(&n.bucket);
    let stop = tokio_util::sync::CancellationToken::new();
    let queues = Queues { work: work.clone(), work_dlq: work_dlq.clone(), results: results.clone(), results_dlq: results_dlq.clone(), store: store.clone() };
    let (processor, controller, _) = start_processor_and_controller(n, &queues, &stop, fast_processor());
    let agent = tokio::spawn(scaling_agent::run(
        scaling_agent::Settings::quick(),
        scaling_agent::Deps {
            watched: scaling_agent::Watched { work: work.clone(), work_dlq: work_dlq.clone(), results: results.clone(), results_dlq: results_dlq.clone() },
            publish: n.trigger_bus(),
            subscription: None,
            backend: std::sync::Arc::new(scaling_agent::backend::NoneBackend::new(0)),
        },
        stop.clone(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "frozen.csv", 200_000, 800, 21)];
    let job = s.submit(&files, 2_000).await;
    let t = Instant::now();
    loop {
        let p = initiator::follow::progress(s.store.as_ref(), &job.job_id).await;
        if p.is_ok_and(|p| p.accounted_chunks > 5) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the job did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = initiator::follow::progress(s.store.as_ref(), &job.job_id).await.unwrap();
    assert!(before.accounted_chunks < job.total_chunks, "frozen mid-job");
    proxy.freeze();
    tokio::time::sleep(Duration::from_secs(10)).await;
    proxy.thaw();
    let thawed = Instant::now();
    let report = s.wait_report(&job, T).await;
    eprintln!("stack frozen 10 s at {}/{} chunks; report {:.1} s after the thaw", before.accounted_chunks, job.total_chunks, thawed.elapsed().as_secs_f64());
    assert_consistent(&report);
    assert_eq!(report.status, JobStatus::Complete, "{:?}", report.failed_chunks);
    assert_eq!(report_accounts(&report), expected_accounts(&files), "exact totals after the freeze");
    for (name, h) in [("processor", &processor), ("controller", &controller), ("agent", &agent)] {
        assert!(!h.is_finished(), "the {name} is still running");
    }
    stop.cancel();
    processor.await.unwrap().unwrap();
    controller.await.unwrap().unwrap();
    agent.await.unwrap().unwrap();
}

/// Per-account (count, gross) of the rows of one stored chunk.
async fn chunk_rows(store: &dyn BlobStore, job: &str, chunk: u32, item: &WorkItem) -> BTreeMap<String, (u64, Decimal)> {
    let data = store.get(&chunk_key(job, chunk)).await.unwrap().unwrap();
    let mut out: BTreeMap<String, (u64, Decimal)> = BTreeMap::new();
    fleet_domain::codec::decode_chunk(&data, &item.blob, item.transactions, 1 << 30, |t| {
        let e = out.entry(t.account_id.to_string()).or_default();
        e.0 += 1;
        e.1 += t.amount;
    })
    .unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_work_items_fail_their_chunks_and_nothing_else() {
    let Some(s) = crate::support::stack(QueueSettings { max_receive_count: 2, visibility_timeout: Duration::from_secs(2) }).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "poison.csv", 20_000, 60, 5)];
    // Submitted with no processor running; then the queue is tampered with.
    let job = s.submit(&files, 2_000).await;
    assert_eq!(job.total_chunks, 10);
    let mut items: Vec<(WorkItem, Delivery)> = Vec::new();
    loop {
        let got = s.work.receive(10, Duration::from_secs(1)).await.unwrap();
        if got.is_empty() {
            break;
        }
        for m in got {
            items.push((serde_json::from_str(&m.body).unwrap(), m));
        }
    }
    assert_eq!(items.len(), 10);
    let item = |c: u32| items.iter().find(|(w, _)| w.chunk == c).unwrap().0.clone();
    // Chunk 3's blob disappears (its rows are remembered first, to check the totals without them).
    let missing = chunk_rows(s.store.as_ref(), &job.job_id, 3, &item(3)).await;
    s.store.delete(&chunk_key(&job.job_id, 3)).await.unwrap();
    // Chunk 7 becomes a zstd bomb: a valid frame that expands to 256 MiB, with a matching checksum and
    // a work item claiming a small raw size.
    let bomb = zstd::encode_all(std::io::Read::take(std::io::repeat(b'0'), 256 << 20), 19).unwrap();
    let bombed = chunk_rows(s.store.as_ref(), &job.job_id, 7, &item(7)).await;
    s.store.put(&chunk_key(&job.job_id, 7), Bytes::from(bomb.clone()), "application/zstd").await.unwrap();
    let mut bomb_item = item(7);
    bomb_item.blob =
        BlobRef { key: chunk_key(&job.job_id, 7), sha256: fleet_domain::codec::sha256_hex(&bomb), compressed_bytes: bomb.len() as u64, raw_bytes: 4096 };
    // Back on the queue: every item (chunk 7 as the bomb), chunk 5 twice, and two garbage bodies.
    // Signed, with their chunks' tokens, as the initiator sends them (the garbage is not).
    let submitter = crate::support::role_keys().key(fleet_io::auth::Role::Submitter);
    let signed = |w: &WorkItem| {
        let body = serde_json::to_string(w).unwrap();
        let attrs =
            fleet_io::queue::Attrs { auth: Some(submitter.sign(&body)), chunk_token: Some(submitter.chunk_token(&w.job_id, w.chunk)), ..Default::default() };
        fleet_io::queue::Outgoing { body, attrs, dedup: None }
    };
    let mut bodies: Vec<fleet_io::queue::Outgoing> = (0..10u32).filter(|c| *c != 7).map(|c| signed(&item(c))).collect();
    bodies.push(signed(&bomb_item));
    bodies.push(signed(&item(5)));
    bodies.push(fleet_io::queue::Outgoing::plain("garbage, not JSON".into()));
    bodies.push(fleet_io::queue::Outgoing::plain("{\"v\":1,\"job_id\":\"../../etc\"}".into()));
    s.work.send_messages(&bodies).await.unwrap();
    s.work.delete(items.into_iter().map(|(_, d)| d).collect()).await.unwrap();

    let p = s.start_processor(fast_processor());
    let c = s.start_controller();
    let agent = s.start_agent();
    let report = s.wait_report(&job, T).await;
    assert_consistent(&report);
    assert_eq!(report.status, JobStatus::Partial);
    let failed: Vec<u32> = report.failed_chunks.iter().map(|f| f.chunk).collect();
    assert_eq!(failed, vec![3, 7], "exactly the poisoned chunks fail: {:?}", report.failed_chunks);
    let by_chunk = |c: u32| report.failed_chunks.iter().find(|f| f.chunk == c).unwrap().reason.clone();
    eprintln!("chunk 3: {}\nchunk 7: {}", by_chunk(3), by_chunk(7));
    assert!(by_chunk(3).contains("does not exist") || by_chunk(3) == controller::aggregate::DEAD_LETTER_REASON, "{}", by_chunk(3));
    assert!(by_chunk(7).contains("decompress") || by_chunk(7).contains("cap") || by_chunk(7) == controller::aggregate::DEAD_LETTER_REASON, "{}", by_chunk(7));
    assert_eq!(report.transactions.processed, 16_000, "the duplicate of chunk 5 counted once");
    // Every other transaction billed exactly: the report plus the two failed chunks' rows is the file.
    let mut got: BTreeMap<String, (u64, Decimal)> = BTreeMap::new();
    for a in &report.accounts {
        let e = got.entry(a.account_id.clone()).or_default();
        e.0 += a.count;
        e.1 += a.gross.parse::<Decimal>().unwrap();
    }
    for lost in [&missing, &bombed] {
        for (a, (n, g)) in lost {
            let e = got.entry(a.clone()).or_default();
            e.0 += n;
            e.1 += g;
        }
    }
    // Per account over its currencies (the chunk rows above are summed the same way).
    let mut want: BTreeMap<String, (u64, Decimal)> = BTreeMap::new();
    for (a, _, n, g, _, _) in expected_accounts(&files) {
        let e = want.entry(a).or_default();
        e.0 += n;
        e.1 += g.parse::<Decimal>().unwrap();
    }
    assert_eq!(got, want, "exact totals for every chunk that could be billed");
    // The garbage bodies went work queue -> dead-letter queue -> quarantine, and nothing is left.
    let t = Instant::now();
    while s.store.list("quarantine/", 10).await.unwrap().len() < 2 {
        assert!(t.elapsed() < T, "garbage quarantined");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for q in [s.work.as_ref(), s.work_dlq.as_ref(), s.results.as_ref(), s.results_dlq.as_ref()] {
        s.wait_depth(q, 0, Duration::from_secs(60)).await;
    }
    for (name, r) in [("processor", &p), ("controller", &c), ("agent", &agent)] {
        assert!(!r.handle.is_finished(), "the {name} is still running");
    }
    // A job submitted now still runs to an exact report: nothing is stuck.
    let more = vec![generated(dir.path(), "after.csv", 3_000, 10, 6)];
    let next = s.submit(&more, 1_000).await;
    let r = s.wait_report(&next, T).await;
    assert_eq!((r.status, report_accounts(&r)), (JobStatus::Complete, expected_accounts(&more)));
    p.stop().await;
    c.stop().await;
    agent.stop().await;
}

/// A flood of hostile messages on the real results queue, ahead of a real job's results, against a
/// real controller on LocalStack: a seal smaller than the manifest, results whose counts differ from
/// their chunks', well-formed bombs (the chunk's count, 200,000 rows inside), results and seals for
/// jobs nobody submitted. The real job ends complete and exact; every forgery is quarantined with its
/// reason (none counted, none cycling), and no forged job gets a lease, checkpoint or report.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_forged_results_is_quarantined_and_the_real_job_stays_exact() {
    use fleet_domain::billing::AccountTotals;
    use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, ResultMessage};
    use fleet_domain::requests::RequestCounts;
    let Some(s) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: Duration::from_secs(5) }).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let files = vec![generated(dir.path(), "real.csv", 6_000, 40, 11)];
    let job = s.submit(&files, 1_000).await;
    assert_eq!(job.total_chunks, 6);
    let chunk = |job: &str, c: u32, n: u64, payload: AccountsPayload| {
        serde_json::to_string(&ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: job.into(),
            chunk: c,
            transactions: n,
            outcome: ChunkOutcome::Processed { payload },
            requests: RequestCounts::default(),
        }))
        .unwrap()
    };
    let row = |a: &str, n: u64| AccountTotals { account_id: a.into(), currency: "EUR".into(), count: n, gross: Decimal::new(100, 0), fees: Decimal::ZERO };
    let bomb_rows: Vec<AccountTotals> = (0..200_000).map(|i| row(&format!("bomb{i}"), 1)).collect();
    let bomb = fleet_domain::codec::base64_encode(&fleet_domain::codec::accounts_to_zstd_csv(bomb_rows.iter().map(AccountTotals::borrowed)));
    let mut forged = vec![serde_json::to_string(&ResultMessage::Sealed { v: 1, job_id: job.job_id.clone(), total_chunks: 1 }).unwrap()];
    for c in 0..6 {
        forged.push(chunk(&job.job_id, c, 11_000, AccountsPayload::Inline { accounts: vec![row("evil", 11_000)] }));
        forged.push(chunk(&job.job_id, c, 1_000, AccountsPayload::ZstdCsv { data: bomb.clone() }));
    }
    let nobody: Vec<String> = (0..20).map(|i| format!("{}-forged{i}", job.job_id)).collect();
    for id in &nobody {
        forged.push(chunk(id, 0, 1, AccountsPayload::Inline { accounts: vec![row("evil", 1)] }));
    }
    forged.push(serde_json::to_string(&ResultMessage::Sealed { v: 1, job_id: nobody[0].clone(), total_chunks: 1 }).unwrap());
    let n_forged = forged.len();
    // Sent with every credential a participant could hold (a processor's key and its chunks' tokens, a
    // submitter's key for the seals), so that only the jobs' own records stand between them and the
    // bill (the role check has its own tests: roles.rs).
    let keys = crate::support::role_keys();
    let (processor, submitter) = (keys.key(fleet_io::auth::Role::Processor), keys.key(fleet_io::auth::Role::Submitter));
    let forged: Vec<fleet_io::queue::Outgoing> = forged
        .into_iter()
        .map(|body| {
            let m: ResultMessage = serde_json::from_str(&body).unwrap();
            let (auth, chunk_token) = match &m {
                ResultMessage::Chunk(c) => (processor.sign(&body), Some(submitter.chunk_token(&c.job_id, c.chunk))),
                _ => (submitter.sign(&body), None),
            };
            fleet_io::queue::Outgoing { attrs: fleet_io::queue::Attrs { auth: Some(auth), chunk_token, ..Default::default() }, body, dedup: None }
        })
        .collect();
    for batch in forged.chunks(10) {
        s.results.send_messages(batch).await.unwrap();
    }
    // A bomb fails its chunk until the chunk's real result replaces the failure, which the real
    // processor sends seconds later: a job whose chunks are all failed is finished a settle time after
    // its last news, so this controller settles for 60 s, not the tests' 3 s (CI once lost that race).
    let c = s.start_controller_settling(60);
    // The forgeries are ahead of the real results: the processor starts once the controller had them.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = s.start_processor(fast_processor());
    let report = s.wait_report(&job, T).await;
    assert_consistent(&report);
    // The bombs are decoded within their chunk's figures, so a chunk may be failed by its bomb first and
    // counted from its real result after (a real result replaces a failure until the job finishes).
    assert_eq!((report.status, report_accounts(&report)), (JobStatus::Complete, expected_accounts(&files)), "exact, nothing forged counted");
    let t = Instant::now();
    // Forged counts and seals are refused at once; the rest wait a few receives.
    let quarantined = loop {
        let keys = s.store.list("quarantine/", 1000).await.unwrap();
        if keys.len() >= n_forged - 6 || t.elapsed() > T {
            break keys;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let mut reasons = Vec::new();
    for k in &quarantined {
        reasons.push(fleet_io::quarantine::read(s.store.as_ref(), k).await.unwrap().unwrap().reason);
    }
    let with = |what: &str| reasons.iter().filter(|r| r.contains(what)).count();
    assert_eq!(with("says 1 chunks, its manifest 6"), 1, "{reasons:#?}");
    assert_eq!(with("declares 11000 transactions"), 6, "{reasons:#?}");
    assert_eq!(with("the job has no records"), 20, "{reasons:#?}");
    assert_eq!(with("has no manifest"), 1, "{reasons:#?}");
    for id in &nobody {
        for key in [fleet_domain::layout::lease_key(id), fleet_domain::layout::checkpoint_key(id), fleet_domain::layout::report_key(id)] {
            assert!(s.store.head(&key).await.unwrap().is_none(), "{key} exists for a job nobody submitted");
        }
    }
    for q in [s.results.as_ref(), s.results_dlq.as_ref()] {
        s.wait_depth(q, 0, Duration::from_secs(60)).await;
    }
    p.stop().await;
    c.stop().await;
}
