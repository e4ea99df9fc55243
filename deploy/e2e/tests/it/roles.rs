//! Authority by role and strays, with real `controller` processes on the LocalStack and RabbitMQ that
//! deploy/test.sh starts (issue 58): a forged abandon and a forged result sent with a processor's
//! credentials (its role key) are quarantined and the job bills exactly what its own processor
//! reported; a stray copy of a job's result on another partition, read during a rolling restart of
//! three controllers, is forwarded to the job's partition and the job finishes exact, not hung.

use std::time::{Duration, Instant};

use crate::support::{Fleet as _, Procs};
use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, JobStatus, ResultMessage};
use fleet_io::auth::Role;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::{Attrs, Outgoing, Queue};

/// Waits until `f` holds, at most `timeout`.
async fn until(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let t = Instant::now();
    while !f().await {
        assert!(t.elapsed() < timeout, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The quarantine's reasons.
async fn quarantined(st: &fleet_test_support::Stack) -> Vec<String> {
    let mut out = Vec::new();
    for key in fleet_io::quarantine::list(st.store.as_ref(), 100).await.unwrap() {
        if let Ok(Some(q)) = fleet_io::quarantine::read(st.store.as_ref(), &key).await {
            out.push(q.reason);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forged_abandon_and_result_from_a_processors_credentials_leave_the_job_exact() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let keys = crate::support::role_keys();
    let http = crate::support::free_addr();
    let _ctl = Procs(vec![crate::support::controller_process(&st, "ctl-roles", &[("LISTENER_HTTP_ADDR", &http.to_string())])]);
    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "roles.csv", 3_000, 40, 58)];
    // Submitted whole (its work items wait: no processor runs yet).
    let job = st.submit(&files, 1_000).await;
    assert_eq!(job.total_chunks, 3);
    // A rogue processor knows the job's id (the status page lists it) and holds a processor's key:
    // it abandons the job, and bills chunk 0 first with the recorded count and an account of its own.
    let processor = keys.key(Role::Processor);
    let forged = |m: ResultMessage| {
        let body = serde_json::to_string(&m).unwrap();
        Outgoing { attrs: Attrs { auth: Some(processor.sign(&body)), ..Attrs::default() }, body, dedup: None }
    };
    let mallory = fleet_domain::billing::AccountTotals {
        account_id: "mallory".into(),
        currency: "EUR".into(),
        count: 1_000,
        gross: rust_decimal::Decimal::new(99_999_999_999, 2),
        fees: rust_decimal::Decimal::ZERO,
    };
    let result = ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: job.job_id.clone(),
        chunk: 0,
        transactions: 1_000,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![mallory] } },
        requests: Default::default(),
    });
    let abandon = ResultMessage::Abandon { v: 1, job_id: job.job_id.clone(), reason: "forged".into() };
    st.results.send_messages(&[forged(abandon), forged(result)]).await.unwrap();
    until("both forgeries quarantined", Duration::from_secs(30), async || quarantined(&st).await.len() == 2).await;
    let why = quarantined(&st).await;
    assert!(why.iter().any(|w| w.contains("an abandon of job") && w.contains("signed by a processor, which may not send one")), "{why:?}");
    assert!(why.iter().any(|w| w.contains("no valid token of its chunk")), "{why:?}");
    // The job's own processor: the job finishes exact, as if nothing had been forged.
    let p = st.start_processor(crate::support::fast_processor());
    let r = st.wait_report(&job, Duration::from_secs(120)).await;
    assert_eq!(r.status, JobStatus::Complete, "{:?}", r.note);
    assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(&files), "exact totals, no mallory");
    let metrics = crate::support::get(&http.to_string(), "/metrics").await.expect("the controller's metrics");
    assert!(
        metrics.lines().any(|l| l == "controller_messages_refused_total{why=\"role\"} 2"),
        "{}",
        metrics.lines().filter(|l| l.contains("refused")).collect::<Vec<_>>().join("\n")
    );
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stray_copy_on_another_partition_during_a_rolling_restart_of_three_controllers_leaves_the_job_exact() {
    let Some(st) = crate::support::partitioned_stack(3, QueueSettings { max_receive_count: 10, visibility_timeout: Duration::from_secs(5) }).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "stray.csv", 4_000, 60, 59)];
    // Every result and the seal on the job's partition, no controller running yet.
    let p = st.start_processor(crate::support::fast_processor());
    let job = st.submit(&files, 1_000).await;
    let home = usize::from(fleet_domain::layout::partition_of(&job.job_id, 3));
    let (queue, _) = &st.partitions[home];
    let all = u64::from(job.total_chunks) + 1;
    until("every result and the seal sent", Duration::from_secs(60), async || queue.depth().await.unwrap().visible >= all).await;
    p.stop().await;
    // A copy of one result, signature and chunk token as its processor sent them, on the next partition.
    let got = queue.receive(1, Duration::from_secs(1)).await.unwrap();
    let original = got.into_iter().next().expect("a result");
    let copy = Outgoing { body: original.body.clone(), attrs: original.attrs.clone(), dedup: None };
    let (elsewhere, _) = &st.partitions[(home + 1) % 3];
    elsewhere.send_messages(&[copy]).await.unwrap();
    original.release(queue.as_ref(), Duration::ZERO).await.map_err(|(e, _)| e).unwrap();
    // Three controllers, restarted one after another (each stop graceful, its partitions handed on).
    let ids = ["roll-1", "roll-2", "roll-3"];
    let mut ctl = Procs(ids.iter().map(|id| crate::support::controller_process(&st, id, &[])).collect());
    for (i, id) in ids.iter().enumerate() {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let c = &mut ctl.0[i];
        let _ = std::process::Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        let _ = c.wait();
        ctl.0[i] = crate::support::controller_process(&st, id, &[]);
    }
    let t = Instant::now();
    let r = st.wait_report(&job, Duration::from_secs(120)).await;
    println!(
        "== roles: a stray copy during a rolling restart of three controllers; the job finished {:.1} s after the last restart",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(r.status, JobStatus::Complete, "{:?}", r.note);
    assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(&files), "exact totals");
    // The stray was forwarded (a duplicate at its job's reader), not quarantined, and nothing is left.
    assert!(quarantined(&st).await.is_empty(), "{:?}", quarantined(&st).await);
    until("the stray's partition emptied", Duration::from_secs(30), async || {
        let d = elsewhere.depth().await.unwrap();
        d.visible + d.in_flight == 0
    })
    .await;
    drop(ctl);
}
