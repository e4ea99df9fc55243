//! End-to-end tests of the billing pipeline on real LocalStack (SQS, S3) and RabbitMQ.

use crate::support::Fleet as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use fleet_domain::layout::{accounts_key, chunk_key, report_key};
use fleet_domain::model::JobStatus;
use fleet_io::blob::BlobStore;
use fleet_io::call::Op;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_pipeline_bills_exactly() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let big = generated(dir.path(), "big.csv", 20_000, 300, 7);
    // A hand-checked file: rejects, a duplicate, a refund, quoting and CRLF.
    let small = write(
        dir.path(),
        "small.csv",
        "timestamp,txn_id,account_id,amount,currency,memo\r\n\
         2026-11-21T10:00:00Z,h1,HAND,100.00,EUR,a\r\n\
         2026-11-21T10:00:00Z,h2,HAND,15.00,EUR,\"x, y\"\r\n\
         2026-11-21T10:00:00Z,h3,HAND,-40.00,EUR,refund\r\n\
         2026-11-21T10:00:00Z,h1,HAND,5.00,EUR,dup\r\n\
         \r\n\
         2026-11-21T10:00:00Z,h4,HAND,1.234,EUR,bad amount\r\n\
         2026-11-21T10:00:00Z,h5,HAND,5.00,eur,bad currency\r\n",
    );
    let p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let files = vec![big.clone(), small.clone()];
    let s = st.submit(&files, 1000).await;
    assert_eq!(s.total_chunks, 21);
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.transactions.submitted, 20_006);
    assert_eq!(r.transactions.rejected, 3);
    assert_eq!(r.transactions.processed, 20_003);
    assert_eq!(report_accounts(&r), expected_accounts(&files));
    // HAND: 100.00 (fee 3.20) + 15.00 (fee 0.74, half away from zero of 0.735) - 40.00 (no fee)
    let hand = r.accounts.iter().find(|a| a.account_id == "HAND").unwrap();
    assert_eq!((hand.count, hand.gross.as_str(), hand.fees.as_str(), hand.net.as_str()), (3, "75.00", "3.94", "71.06"));
    let lines: Vec<(u64, &str)> = r.rejected.iter().map(|x| (x.line, x.reason.as_str())).collect();
    assert_eq!(lines[0].0, 5, "{lines:?}");
    assert!(lines[0].1.starts_with("txn_id: duplicate"), "{lines:?}");
    assert_eq!((lines[1].0, lines[2].0), (7, 8), "physical line numbers, blank line counted");
    assert!(lines[1].1.starts_with("amount:") && lines[2].1.starts_with("currency:"));
    // Request accounting: every part of the fleet counted its calls for this job.
    assert!(r.requests.s3.get("PutObject").copied().unwrap_or(0) >= 21 + 1 + 3, "{:?}", r.requests);
    assert!(r.requests.s3.get("GetObject").copied().unwrap_or(0) >= 21);
    assert!(r.requests.sqs.get("SendMessageBatch").copied().unwrap_or(0) >= 3);
    assert!(r.requests.sqs.get("DeleteMessageBatch").copied().unwrap_or(0) >= 3);
    // Their cost at the controller's (list) prices: every SQS call billed, S3 by class, DELETE free.
    let cost = r.requests.cost.clone().expect("the report prices its requests");
    let (sqs, s3_put, s3_get) = {
        let s3 = |ops: &[&str]| r.requests.s3.iter().filter(|(op, _)| ops.contains(&op.as_str())).map(|(_, n)| *n).sum::<u64>();
        (r.requests.sqs.values().sum::<u64>(), s3(&["PutObject", "ListObjectsV2"]), s3(&["GetObject", "HeadObject"]))
    };
    assert_eq!((cost.sqs_requests, cost.s3_put_requests, cost.s3_get_requests), (sqs, s3_put, s3_get), "{:?}", r.requests);
    let usd = |s: &str| s.parse::<rust_decimal::Decimal>().unwrap();
    let expected = rust_decimal::Decimal::from(sqs) * usd("0.40") / usd("1000000")
        + rust_decimal::Decimal::from(s3_put) * usd("0.005") / usd("1000")
        + rust_decimal::Decimal::from(s3_get) * usd("0.0004") / usd("1000");
    assert_eq!(usd(&cost.total_usd), expected.round_dp(8), "{cost:?}");
    assert_eq!(usd(cost.per_million_transactions_usd.as_deref().unwrap()), (expected * usd("1000000") / usd("20006")).round_dp(8), "{cost:?}");
    // The warehouse holds the report and accounts.csv.
    let csv = st.store.get(&accounts_key(&s.job_id)).await.unwrap().unwrap();
    assert_eq!(csv.iter().filter(|&&b| b == b'\n').count(), r.accounts.len() + 1);
    assert!(st.store.get(&report_key(&s.job_id)).await.unwrap().is_some());
    // Nothing left behind on the queues.
    st.wait_depth(st.work.as_ref(), 0, T).await;
    st.wait_depth(st.results.as_ref(), 0, T).await;
    // Nor transactions at rest: the finished job's chunk and result blobs are purged; the report,
    // accounts, manifest and checkpoint stay.
    let job_prefix = format!("jobs/{}/", s.job_id);
    let t = std::time::Instant::now();
    loop {
        let left: Vec<String> =
            st.store.list(&job_prefix, 1000).await.unwrap().into_iter().filter(|k| k.contains("/chunks/") || k.contains("/results/")).collect();
        if left.is_empty() {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "blobs of the finished job left: {left:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let kept = st.store.list(&job_prefix, 1000).await.unwrap();
    assert_eq!(
        kept,
        [fleet_domain::layout::manifest_key(&s.job_id), fleet_domain::layout::tariff_key(&s.job_id)],
        "only the manifest and the tariff (its metadata: the job's files, for `initiator jobs`) stay beside the job's blobs"
    );
    let state = st.store.list(&format!("{}{}/", fleet_domain::layout::CHECKPOINTS_PREFIX, s.job_id), 1000).await.unwrap();
    assert_eq!(state, [fleet_domain::layout::checkpoint_key(&s.job_id)], "the checkpoint stays, under the controllers' prefix");
    // The bucket's lifecycle rules are the backstop (provisioning put them there).
    let rules = st.aws.s3().get_bucket_lifecycle_configuration().bucket(&st.names.bucket).send().await.unwrap();
    for prefix in ["jobs/", "checkpoints/"] {
        let rule = rules.rules().iter().find(|r| r.filter().and_then(|f| f.prefix()) == Some(prefix)).expect("a lifecycle rule");
        assert_eq!(rule.expiration().and_then(|e| e.days()), Some(fleet_io::provision::JOBS_EXPIRE_DAYS), "{prefix}");
    }
    p.stop().await;
    c.stop().await;
}

/// Receive calls made on a queue so far (in these tests only the controller receives from the results
/// queue and the work dead-letter queue).
fn receives(q: &fleet_io::queue::SqsQueue) -> u64 {
    q.calls().snapshot().calls(Op::SqsReceiveMessage)
}

/// Waits until the controller's listeners have parked: no receive on the results queue or the work
/// dead-letter queue for two of its (1 s) polls in a row.
async fn parked(st: &Stack) {
    let t = std::time::Instant::now();
    let mut last = (receives(&st.results), receives(&st.work_dlq));
    let mut quiet_since = std::time::Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(2) {
        assert!(t.elapsed() < T, "the controller's listeners never parked");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = (receives(&st.results), receives(&st.work_dlq));
        if now != last {
            (last, quiet_since) = (now, std::time::Instant::now());
        }
    }
}

/// The controller idles at zero requests (its listeners park) and is woken by the triggers that
/// processors and the initiator publish: jobs finish in seconds, not at the 10-minute safety poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_controller_makes_no_requests_and_wakes_on_triggers() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    // A file of its own per round: the same ids twice are billed once.
    let files = [generated(dir.path(), "in.csv", 3_000, 30, 17), generated(dir.path(), "in2.csv", 3_000, 30, 18)];
    let p = st.start_processor(fast_processor());
    let c = st.start_controller();
    // Quick listener settings: 1 s polls, 1 s cap: parked after the first empty poll.
    parked(&st).await;
    let before = (receives(&st.results), receives(&st.work_dlq));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!((receives(&st.results), receives(&st.work_dlq)), before, "no receives while idle");
    for (round, f) in files.iter().enumerate() {
        let started = std::time::Instant::now();
        let s = st.submit(std::slice::from_ref(f), 1_000).await;
        let r = st.wait_report(&s, Duration::from_secs(30)).await;
        assert_eq!(r.status, JobStatus::Complete);
        assert_eq!(report_accounts(&r), expected_accounts(std::slice::from_ref(f)));
        assert!(started.elapsed() < Duration::from_secs(15), "round {round}: woken by triggers, took {:?}", started.elapsed());
        // Parked again before the next round.
        parked(&st).await;
    }
    p.stop().await;
    c.stop().await;
}

/// `--group-by account` on a real SQS FIFO work queue: the queue delivers each account's rows in one
/// group, in file order; then a whole job on the FIFO fleet bills exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_by_account_on_a_fifo_queue_keeps_order_and_bills_exactly() {
    if !crate::support::stack_running() {
        return;
    }
    use initiator::grouping::{GroupBy, Grouping};
    use initiator::submit::SubmitOptions;
    let Some(st) = crate::support::fifo_stack(QueueSettings::default()).await else { return };
    assert!(st.names.work_queue.ends_with(".fifo") && st.names.work_dlq().ends_with("-dlq.fifo"), "{:?}", st.names);
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 8_000, 60, 21);
    let grouping = Grouping::new(Some(GroupBy::Account), 3);
    let opts = |chunk_size| SubmitOptions { chunk_size, grouping, ..SubmitOptions::new(vec![f.clone()]) };

    let s = st.submit_with(opts(400)).await;
    let delivered = drain_fifo(st.work.as_ref(), st.store.as_ref()).await;
    assert_eq!(delivered.len() as u32, s.total_chunks);
    assert_eq!(delivered.iter().map(|d| d.group.as_str()).collect::<std::collections::BTreeSet<_>>().len(), 3);
    assert_accounts_in_order(&delivered, std::slice::from_ref(&f));

    let r = bills_exactly(&st, opts(500), 8_000).await;
    st.wait_depth(st.work.as_ref(), 0, T).await;
    // The FIFO work queue's calls are counted apart and priced at SQS's FIFO price; the results
    // queue's at the standard one.
    assert!(r.requests.sqs.keys().any(|k| k.starts_with("fifo.")), "{:?}", r.requests.sqs);
    let cost = r.requests.cost.as_ref().expect("the report is priced");
    assert!(cost.sqs_fifo_requests > 0 && cost.sqs_requests > 0, "{cost:?}");
    assert_eq!(cost.prices.sqs_fifo_per_million.to_string(), "0.50");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_work_items_do_not_change_totals() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 3_000, 50, 11);
    let s = st.submit(std::slice::from_ref(&f), 500).await;
    assert_eq!(s.total_chunks, 6);
    // Deliver every work item twice: copy each body back onto the queue.
    let mut got = std::collections::BTreeMap::new();
    while got.len() < 6 {
        for m in st.work.receive(10, Duration::from_secs(1)).await.unwrap() {
            got.insert(m.id.clone(), m);
        }
    }
    let bodies: Vec<String> = got.values().map(|m| m.body.clone()).collect();
    st.work.release(got.into_values().collect(), Duration::ZERO).await.unwrap();
    st.work.send(bodies).await.unwrap();
    st.wait_depth(st.work.as_ref(), 12, T).await;
    let p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.transactions.processed, 3_000);
    assert_eq!(report_accounts(&r), expected_accounts(&[f]));
    st.wait_depth(st.work.as_ref(), 0, T).await;
    st.wait_depth(st.results.as_ref(), 0, T).await;
    p.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrupt_blob_fails_its_chunk_at_once_and_job_is_partial() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 2, visibility_timeout: std::time::Duration::from_secs(2) }).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 2_000, 40, 3);
    let s = st.submit(std::slice::from_ref(&f), 500).await;
    assert_eq!(s.total_chunks, 4);
    // Chunk 2's blob is damaged after submission.
    st.store.put(&chunk_key(&s.job_id, 2), Bytes::from_static(b"\x28\xb5\x2f\xfd garbage"), "application/zstd").await.unwrap();
    let p = st.start_processor(fast_processor());
    // A chunk that can never succeed is reported failed on its first receive and its work item
    // deleted: nothing cycles through the back-offs to the DLQ.
    st.wait_depth(st.work.as_ref(), 0, T).await;
    assert_eq!(st.work_dlq.depth().await.unwrap().visible, 0, "nothing dead-lettered");
    let c = st.start_controller();
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Partial);
    assert_consistent(&r);
    assert_eq!(r.transactions.failed, 500);
    assert_eq!(r.transactions.processed, 1_500);
    assert_eq!(r.failed_chunks.len(), 1);
    assert_eq!(r.failed_chunks[0].chunk, 2);
    let reason = &r.failed_chunks[0].reason;
    assert!(reason.starts_with("corrupt data: blob") && reason.contains("attempt 1; not retried"), "{reason}");
    st.wait_depth(st.work_dlq.as_ref(), 0, T).await;
    p.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_restarted_mid_job_keeps_totals_exact() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: std::time::Duration::from_secs(2) }).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 6_000, 80, 5);
    let s = st.submit(std::slice::from_ref(&f), 200).await;
    assert_eq!(s.total_chunks, 30);
    let p = st.start_processor(fast_processor());
    st.wait_depth(st.results.as_ref(), 31, T).await; // 30 chunk results and the seal
    p.stop().await;

    // First controller: applies and checkpoints two batches, then "crashes" before deleting them.
    // (The same controller as the ones started below: a crash and restart, not a second replica.)
    let agg = controller::Aggregator::with(st.store.clone(), controller::aggregate::Options { owner: TEST_CONTROLLER.into(), ..Default::default() });
    let done = fleet_engine::Completions::start(st.results.clone(), Default::default());
    for _ in 0..2 {
        let msgs = st.results.receive(10, Duration::from_secs(1)).await.unwrap();
        assert!(!msgs.is_empty());
        agg.apply(controller::Source::Results, msgs.into_iter().map(|d| done.keep(d)).collect()).await;
    }
    agg.flush().await;
    drop(agg);
    // A second controller, a process of its own, is killed (SIGKILL) while it works: once it holds
    // results it has received and not deleted.
    // (The first one's undeleted results are visible again first: in flight, they would look like
    // the second one's.)
    let t = std::time::Instant::now();
    while st.results.depth().await.unwrap().in_flight > 0 {
        assert!(t.elapsed() < T, "the first controller's results never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut c1 = controller_process(&st, TEST_CONTROLLER, &[]);
    let t = std::time::Instant::now();
    while st.results.depth().await.unwrap().in_flight == 0 {
        assert!(t.elapsed() < T, "the controller process never received a result");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c1.kill().unwrap();
    let status = c1.wait().unwrap();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "killed by SIGKILL: {status:?}");
    // The last one finishes the job: the results the killed one held come back after their
    // visibility timeout, which nobody announces; the scaling agent sees the queue turn non-empty and
    // wakes it (a fleet without the agent waits for the park poll).
    let agent = st.start_agent();
    let c2 = st.start_controller();
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.transactions.processed, 6_000);
    assert_eq!(report_accounts(&r), expected_accounts(&[f]));
    c2.stop().await;
    agent.stop().await;
}

/// The controller (a real process) comes back after being down for longer than its short
/// `--abandon-after`, while the job's checkpoint says it is unsealed and its seal waits on the results
/// queue: it reads the seal and finishes the job complete; it does not abandon it at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_down_longer_than_abandon_after_finishes_the_job_whose_seal_waits() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 2_000, 40, 7);
    let s = st.submit(std::slice::from_ref(&f), 200).await;
    let p = st.start_processor(fast_processor());
    st.wait_depth(st.results.as_ref(), u64::from(s.total_chunks) + 1, T).await;
    p.stop().await;
    // The controller that ran before applied some results, never the seal, checkpointed them (the
    // job's checkpoint says it is unsealed), deleted them, and stopped.
    let agg = controller::Aggregator::with(st.store.clone(), controller::aggregate::Options { owner: TEST_CONTROLLER.into(), ..Default::default() });
    let done = fleet_engine::Completions::start(st.results.clone(), Default::default());
    let msgs = st.results.receive(10, Duration::from_secs(1)).await.unwrap();
    let (seals, results): (Vec<_>, Vec<_>) = msgs.into_iter().partition(|d| d.body.contains("\"kind\":\"sealed\""));
    for d in seals {
        done.release(d, Duration::ZERO);
    }
    assert!(!results.is_empty());
    let applied = agg.apply(controller::Source::Results, results.into_iter().map(|d| done.keep(d)).collect()).await;
    for k in applied.delete.into_iter().chain(agg.flush().await) {
        k.delete();
    }
    agg.release_leases(|_| true).await;
    drop(agg);
    done.finish(true).await;
    // Down for longer than the restarted controller's --abandon-after.
    let abandon_after = 5;
    tokio::time::sleep(Duration::from_secs(abandon_after + 2)).await;
    let mut c = controller_process(&st, TEST_CONTROLLER, &[("CONTROLLER_ABANDON_AFTER", &abandon_after.to_string())]);
    let r = st.wait_report(&s, T).await;
    c.kill().unwrap();
    c.wait().unwrap();
    assert_eq!(r.status, JobStatus::Complete, "{:?}", r.note);
    assert_consistent(&r);
    assert_eq!(r.transactions.processed, 2_000);
    assert_eq!(report_accounts(&r), expected_accounts(&[f]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_with_nothing_accepted_still_finishes() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = write(dir.path(), "bad.csv", "txn_id,account_id,amount,currency,timestamp\nt1,a,0,EUR,2026-11-21T10:00:00Z\nt2,,1,EUR,2026-11-21T10:00:00Z\n");
    let c = st.start_controller();
    let s = st.submit(std::slice::from_ref(&f), 100).await;
    assert_eq!(s.total_chunks, 0);
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!((r.transactions.submitted, r.transactions.accepted, r.transactions.rejected), (2, 0, 2));
    assert!(r.accounts.is_empty() && r.totals.is_empty());
    c.stop().await;
}

/// A job with more accounts than a checkpoint keeps inline: its checkpoints on S3 are a base part and
/// parts with only the changed rows; a controller that crashes after writing some is succeeded by one
/// that restores them, finishes with exact totals and leaves no part behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_job_checkpoints_in_parts_and_a_restart_restores_them() {
    if !crate::support::stack_running() {
        return;
    }
    use fleet_domain::codec::from_zstd_json;
    use fleet_domain::layout::{checkpoint_key, checkpoint_parts_prefix};
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 5, visibility_timeout: std::time::Duration::from_secs(2) }).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 30_000, 20_000, 11);
    let s = st.submit(std::slice::from_ref(&f), 1_000).await;
    assert_eq!(s.total_chunks, 30);
    let p = st.start_processor(fast_processor());
    st.wait_depth(st.results.as_ref(), 31, T).await;
    p.stop().await;

    let agg = controller::Aggregator::with(st.store.clone(), controller::aggregate::Options { owner: TEST_CONTROLLER.into(), ..Default::default() });
    let done = fleet_engine::Completions::start(st.results.clone(), Default::default());
    // Two batches of the 31 messages: a base, then a part with the rows they changed.
    for _ in 0..2 {
        let msgs = st.results.receive(10, Duration::from_secs(1)).await.unwrap();
        agg.apply(controller::Source::Results, msgs.into_iter().map(|d| done.keep(d)).collect()).await;
        agg.flush().await;
    }
    let stats = agg.stats();
    let (bases, changes) = (stats.full_parts.load(Ordering::Relaxed), stats.delta_parts.load(Ordering::Relaxed));
    assert!(bases >= 1 && bases + changes >= 2, "bases {bases}, change parts {changes}");
    drop(agg);
    let cp: fleet_domain::model::Checkpoint = from_zstd_json(&st.store.get(&checkpoint_key(&s.job_id)).await.unwrap().unwrap(), 1 << 30).unwrap();
    assert!(cp.accounts.is_empty() && !cp.parts.is_empty() && cp.parts[0].full, "parts: {:?}", cp.parts);
    assert!(!cp.accounted.is_empty());

    let c = st.start_controller();
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.transactions.processed, 30_000);
    assert_eq!(report_accounts(&r), expected_accounts(&[f]));
    c.stop().await;
    assert!(st.store.list(&checkpoint_parts_prefix(&s.job_id), 100).await.unwrap().is_empty(), "no part outlives the job");
}

/// An oracle that shares no code with `billing`: twelve rows whose fees were worked out by hand
/// (0.30 + 2.9% per charge, refunds free, rounded to cents half away from zero), billed through the
/// fleet on the real stack in chunks of 3 and by `initiator local`; every figure is a literal.
///
/// | account | amount | fee | by hand |
/// |---|---|---|---|
/// | A | 10.00 EUR | 0.59 | 0.30 + 0.29 |
/// | A | 0.50 EUR | 0.31 | 0.30 + 0.0145 = 0.3145 |
/// | A | 12.50 EUR | 0.66 | 0.30 + 0.3625 = 0.6625 |
/// | A | -5.00 EUR | 0.00 | refund |
/// | B | 1.50 EUR | 0.34 | 0.30 + 0.0435 = 0.3435 |
/// | B | 0.05 EUR | 0.30 | 0.30 + 0.00145 |
/// | B | 100.00 USD | 3.20 | 0.30 + 2.90 |
/// | B | 0.25 USD | 0.31 | 0.30 + 0.00725 = 0.30725 |
/// | C | 17.24 EUR | 0.80 | 0.30 + 0.49996 = 0.79996 |
/// | C | 8.62 EUR | 0.55 | 0.30 + 0.24998 = 0.54998 |
/// | D | 5.00 EUR | 0.45 | 0.30 + 0.145 = 0.445: half away from zero (half to even: 0.44) |
/// | D | 25.00 EUR | 1.03 | 0.30 + 0.725 = 1.025: half away from zero (half to even: 1.02) |
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oracle_computed_by_hand_agrees_with_the_fleet_and_initiator_local() {
    const CSV: &str = "txn_id,account_id,amount,currency,timestamp\n\
        o1,A,10.00,EUR,2026-11-24T08:00:00Z\n\
        o2,A,0.50,EUR,2026-11-24T08:00:01Z\n\
        o3,A,12.50,EUR,2026-11-24T08:00:02Z\n\
        o4,A,-5.00,EUR,2026-11-24T08:00:03Z\n\
        o5,B,1.50,EUR,2026-11-24T08:00:04Z\n\
        o6,B,0.05,EUR,2026-11-24T08:00:05Z\n\
        o7,B,100.00,USD,2026-11-24T08:00:06Z\n\
        o8,B,0.25,USD,2026-11-24T08:00:07Z\n\
        o9,C,17.24,EUR,2026-11-24T08:00:08Z\n\
        o10,C,8.62,EUR,2026-11-24T08:00:09Z\n\
        o11,D,5.00,EUR,2026-11-24T08:00:10Z\n\
        o12,D,25.00,EUR,2026-11-24T08:00:11Z\n";
    // (account, currency, count, gross, fees, net), by hand.
    let accounts = [
        ("A", "EUR", 4, "18.00", "1.56", "16.44"),
        ("B", "EUR", 2, "1.55", "0.64", "0.91"),
        ("B", "USD", 2, "100.25", "3.51", "96.74"),
        ("C", "EUR", 2, "25.86", "1.35", "24.51"),
        ("D", "EUR", 2, "30.00", "1.48", "28.52"),
    ];
    let totals = [("EUR", 10, "75.41", "5.03", "70.38"), ("USD", 2, "100.25", "3.51", "96.74")];
    let check = |r: &fleet_domain::report::Report, how: &str| {
        assert_eq!((r.transactions.processed, r.transactions.failed, r.transactions.rejected), (12, 0, 0), "{how}");
    };
    by_local_and_by_the_fleet("oracle.csv", CSV, 3, &accounts, &totals, check).await;
}

/// An account row and a currency total as the oracles write them: (account, currency, count, gross,
/// fees, net) and (currency, count, gross, fees, net).
type AccountLine<'a> = (&'a str, &'a str, u64, &'a str, &'a str, &'a str);
type TotalLine<'a> = (&'a str, u64, &'a str, &'a str, &'a str);

/// Bills `csv` by `initiator local` and through the fleet on the real stack (in chunks of
/// `chunk`), and checks each report's account rows and totals against the oracle's, then `check`.
async fn by_local_and_by_the_fleet(
    name: &str,
    csv: &str,
    chunk: u64,
    accounts: &[AccountLine<'_>],
    totals: &[TotalLine<'_>],
    more: impl Fn(&fleet_domain::report::Report, &str),
) {
    let check = |r: &fleet_domain::report::Report, how: &str| {
        let got: Vec<AccountLine<'_>> =
            r.accounts.iter().map(|a| (a.account_id.as_str(), a.currency.as_str(), a.count, a.gross.as_str(), a.fees.as_str(), a.net.as_str())).collect();
        assert_eq!(got, accounts, "{how}: accounts");
        let got: Vec<TotalLine<'_>> = r.totals.iter().map(|t| (t.currency.as_str(), t.count, t.gross.as_str(), t.fees.as_str(), t.net.as_str())).collect();
        assert_eq!(got, totals, "{how}: totals");
        more(r, how);
    };
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), name, csv);
    let out = std::process::Command::new(bin("initiator")).arg("local").arg(&file).arg("--json").output().unwrap();
    assert!(matches!(out.status.code(), Some(0 | 1)), "initiator local: {}", String::from_utf8_lossy(&out.stderr));
    check(&serde_json::from_slice(&out.stdout).unwrap(), "initiator local");
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let s = st.submit(&[file], chunk).await;
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    check(&r, "the fleet");
    p.stop().await;
    c.stop().await;
}

/// Yen, euros and dinars, each at its ISO 4217 places, against an oracle worked by hand (no code of
/// `billing` or `iso_currency`): the shipped tariff (0.30 + 2.9% per charge, refunds free), each fee
/// rounded once to its currency's unit, half away from zero, through the fleet on the real stack and
/// by `initiator local`; rows with more places than their currency, or a code that is not a
/// currency, are refused with file, line and reason.
///
/// | txn | account | amount | fee | by hand |
/// |---|---|---|---|---|
/// | j1 | K | 1500 JPY | 44 | 0.30 + 43.5 = 43.80 |
/// | j2 | K | 50 JPY | 2 | 0.30 + 1.45 = 1.75 |
/// | j3 | K | -300 JPY | 0 | refund |
/// | j4 | K | 3000 JPY | 87 | 0.30 + 87 = 87.30 |
/// | j5 | K | 1800 JPY | 53 | 0.30 + 52.2 = 52.50: half away from zero (half to even: 52) |
/// | b1 | L | 12.345 BHD | 0.658 | 0.30 + 0.358005 |
/// | b2 | L | 0.5 BHD | 0.315 | 0.30 + 0.0145 = 0.3145 (half to even: 0.314) |
/// | b3 | L | -1.250 BHD | 0.000 | refund |
/// | b4 | L | 100 BHD | 3.200 | 0.30 + 2.90 |
/// | e1 | L | 10.00 EUR | 0.59 | 0.30 + 0.29 |
/// | e2 | M | 5.00 EUR | 0.45 | 0.30 + 0.145 = 0.445 |
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn yen_euros_and_dinars_each_at_its_places_agree_with_an_oracle_by_hand() {
    const CSV: &str = "txn_id,account_id,amount,currency,timestamp\n\
        j1,K,1500,JPY,2026-11-24T08:00:00Z\n\
        j2,K,50,JPY,2026-11-24T08:00:01Z\n\
        j3,K,-300,JPY,2026-11-24T08:00:02Z\n\
        j4,K,3000,JPY,2026-11-24T08:00:03Z\n\
        j5,K,1800,JPY,2026-11-24T08:00:04Z\n\
        b1,L,12.345,BHD,2026-11-24T08:00:05Z\n\
        b2,L,0.5,BHD,2026-11-24T08:00:06Z\n\
        b3,L,-1.250,BHD,2026-11-24T08:00:07Z\n\
        b4,L,100,BHD,2026-11-24T08:00:08Z\n\
        e1,L,10.00,EUR,2026-11-24T08:00:09Z\n\
        e2,M,5.00,EUR,2026-11-24T08:00:10Z\n\
        r1,M,1.5,JPY,2026-11-24T08:00:11Z\n\
        r2,M,1.0005,BHD,2026-11-24T08:00:12Z\n\
        r3,M,12.345,EUR,2026-11-24T08:00:13Z\n\
        r4,M,10,ABC,2026-11-24T08:00:14Z\n\
        r5,M,10,XAU,2026-11-24T08:00:15Z\n";
    let accounts = [
        ("K", "JPY", 5, "6050", "186", "5864"),
        ("L", "BHD", 4, "111.595", "4.173", "107.422"),
        ("L", "EUR", 1, "10.00", "0.59", "9.41"),
        ("M", "EUR", 1, "5.00", "0.45", "4.55"),
    ];
    let totals = [("BHD", 4, "111.595", "4.173", "107.422"), ("EUR", 2, "15.00", "1.04", "13.96"), ("JPY", 5, "6050", "186", "5864")];
    let rejected = [
        (13, "amount: \"1.5\" has 1 decimals; JPY allows 0 (its ISO 4217 minor unit)"),
        (14, "amount: \"1.0005\" has 4 decimals; BHD allows 3 (its ISO 4217 minor unit)"),
        (15, "amount: \"12.345\" has 3 decimals; EUR allows 2 (its ISO 4217 minor unit)"),
        (16, "currency: \"ABC\" is not an ISO 4217 currency code"),
        (17, "currency: \"XAU\" has no minor unit in ISO 4217 (a metal, fund or \"no currency\" code, not billed)"),
    ];
    let check = |r: &fleet_domain::report::Report, how: &str| {
        let got: Vec<(u64, &str)> = r.rejected.iter().map(|x| (x.line, x.reason.as_str())).collect();
        assert_eq!(got, rejected, "{how}: rejected rows");
        assert!(r.rejected.iter().all(|x| x.file.ends_with("money.csv")), "{how}");
        assert_eq!((r.transactions.processed, r.transactions.failed, r.transactions.rejected), (11, 0, 5), "{how}");
    };
    by_local_and_by_the_fleet("money.csv", CSV, 4, &accounts, &totals, check).await;
}
