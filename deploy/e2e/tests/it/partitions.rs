//! Partitioned results with real processes (seed 003's partitioned consumers): three `controller`
//! processes on a results queue in six partitions, on the LocalStack and RabbitMQ that deploy/test.sh
//! starts. They balance the partitions (two each), a calm run of six jobs receives each result once
//! and sends nothing to a dead-letter queue, a killed controller's partitions are taken over within a
//! lease and a round, and a job submitted after it completes exact.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::{Fleet as _, Procs};
use fleet_io::blob::BlobStore;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;

/// The ownership document as the test reads it: partition -> owner.
async fn owners(st: &fleet_test_support::Stack) -> BTreeMap<u16, String> {
    let Ok(Some(body)) = st.store.get(fleet_domain::layout::PARTITIONS_KEY).await else { return BTreeMap::new() };
    let t: controller::partitions::Table = serde_json::from_slice(&body).expect("a readable ownership document");
    t.owners.into_iter().filter_map(|(p, o)| Some((p, o.owner?))).collect()
}

/// Partitions per controller.
fn shares(owners: &BTreeMap<u16, String>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for o in owners.values() {
        *out.entry(o.clone()).or_insert(0) += 1;
    }
    out
}

/// The sum of a listener counter over the queues whose name `pick` accepts, from a controller's /state.
async fn received(addr: std::net::SocketAddr, pick: impl Fn(&str) -> bool) -> u64 {
    let state = crate::support::get_state(&addr.to_string()).await.expect("state endpoint");
    state.as_array().expect("a list of listeners").iter().filter(|s| pick(s["queue"].as_str().unwrap_or(""))).map(|s| s["received"].as_u64().unwrap_or(0)).sum()
}

async fn dead_letters(st: &fleet_test_support::Stack) -> u64 {
    let mut n = 0;
    for (_, dlq) in st.partitions.iter().chain(&st.shards) {
        let d = dlq.depth().await.unwrap();
        n += d.visible + d.in_flight + d.delayed;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_controllers_balance_six_partitions_a_calm_run_dead_letters_nothing_and_a_killed_one_is_taken_over() {
    let Some(st) = crate::support::partitioned_stack(6, QueueSettings::default()).await else { return };
    let lease = Duration::from_secs(5);
    let ids = ["ctl-1", "ctl-2", "ctl-3"];
    let addrs: Vec<std::net::SocketAddr> = ids.iter().map(|_| crate::support::free_addr()).collect();
    let addr_env: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    let mut ctl = Procs(ids.iter().zip(&addr_env).map(|(id, a)| crate::support::controller_process(&st, id, &[("LISTENER_HTTP_ADDR", a)])).collect());
    // Balanced: two partitions each.
    let t = Instant::now();
    loop {
        let o = owners(&st).await;
        if o.len() == 6 && shares(&o).values().all(|n| *n == 2) && shares(&o).len() == 3 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "not balanced within a minute: {:?}", shares(&o));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let balanced_in = t.elapsed();
    let p = st.start_processor(crate::support::fast_processor());
    let dir = tempfile::tempdir().unwrap();
    // FLEET_PARTITION_TEST_ROWS=300000 runs the measurement (six jobs of 300,000 rows).
    let rows: u64 = std::env::var("FLEET_PARTITION_TEST_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(25_000);
    let files: Vec<Vec<std::path::PathBuf>> = (0..6).map(|i| vec![crate::support::generated(dir.path(), &format!("j{i}.csv"), rows, 500, 300 + i)]).collect();
    let t = Instant::now();
    let mut jobs = Vec::new();
    for f in &files {
        jobs.push(st.submit(f, 250).await);
    }
    let parts: std::collections::BTreeSet<u16> = jobs.iter().map(|j| fleet_domain::layout::partition_of(&j.job_id, 6)).collect();
    for (job, f) in jobs.iter().zip(&files) {
        let r = st.wait_report(job, Duration::from_secs(600)).await;
        crate::support::assert_consistent(&r);
        assert_eq!(r.status, fleet_domain::model::JobStatus::Complete, "{:?}", r.failed_chunks);
        assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(f), "exact totals");
    }
    let took = t.elapsed();
    let sent: u64 = jobs.iter().map(|j| u64::from(j.total_chunks) + 1).sum();
    let mut results_received = 0;
    let mut dlq_received = 0;
    for a in &addrs {
        results_received += received(*a, |q| q.contains("results") && !q.ends_with("-dlq")).await;
        dlq_received += received(*a, |q| q.ends_with("-dlq")).await;
    }
    let left = dead_letters(&st).await;
    println!(
        "== partitions: 3 controllers balanced 6 partitions in {:.1} s; 6 jobs ({} results and seals, on partitions {parts:?}) in {:.1} s: \
         {results_received} received from the results partitions, {dlq_received} from dead-letter queues, {left} left in them",
        balanced_in.as_secs_f64(),
        sent,
        took.as_secs_f64()
    );
    assert_eq!(dlq_received + left, 0, "a calm run sends nothing to a dead-letter queue");
    // Each result and seal received once (nothing handed back between controllers); a redelivery after
    // a slow delete may add a few.
    assert!(results_received >= sent && results_received <= sent + sent / 100, "{results_received} receives for {sent} messages");
    // One controller killed: its partitions are taken over within a lease (its membership runs out)
    // and a balancing round (a third of a lease).
    let before = owners(&st).await;
    ctl.0[2].kill().unwrap();
    ctl.0[2].wait().unwrap();
    let killed = Instant::now();
    loop {
        let o = owners(&st).await;
        if o.len() == 6 && !o.values().any(|w| w == ids[2]) {
            break;
        }
        assert!(killed.elapsed() < lease * 3, "{}'s partitions not taken over: {o:?}", ids[2]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let taken_over = killed.elapsed();
    let after = owners(&st).await;
    println!(
        "== partitions: {} killed ({:?} of {before:?}); taken over in {:.1} s (lease {} s): {after:?}",
        ids[2],
        before.iter().filter(|(_, w)| *w == ids[2]).map(|(p, _)| *p).collect::<Vec<_>>(),
        taken_over.as_secs_f64(),
        lease.as_secs()
    );
    assert!(taken_over < lease + lease / 3 + Duration::from_secs(2), "taken over in {taken_over:?}");
    assert_eq!(shares(&after).values().copied().collect::<Vec<_>>(), [3, 3]);
    // The fleet goes on: a job on any partition completes exact.
    let more = vec![crate::support::generated(dir.path(), "after.csv", 10_000, 200, 399)];
    let next = st.submit(&more, 250).await;
    let r = st.wait_report(&next, Duration::from_secs(120)).await;
    assert_eq!(r.status, fleet_domain::model::JobStatus::Complete);
    assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(&more));
    assert_eq!(dead_letters(&st).await, 0);
    p.stop().await;
}

/// A partition taken over from a controller that died holding its messages: they are invisible when
/// the heir starts reading (its first receive is empty and its listener parks), and nobody announces
/// them when they are visible again (the processor sent everything long before, and no scaling agent
/// runs here). The heir looks again when they come back, instead of waiting for its hourly safety poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_heir_reads_what_its_dead_predecessor_held_without_a_trigger() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 10, visibility_timeout: Duration::from_secs(5) }).await else { return };
    let p = st.start_processor(crate::support::fast_processor());
    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "held.csv", 3_000, 50, 77)];
    let job = st.submit(&files, 500).await;
    // Every result and the seal on the queue (their triggers went to nobody).
    let all = u64::from(job.total_chunks) + 1;
    let t = Instant::now();
    while st.results.depth().await.unwrap().visible < all {
        assert!(t.elapsed() < Duration::from_secs(60), "the results were not sent");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    p.stop().await;
    // The predecessor: it owned the partition (its membership runs out in a second) and had received
    // every message when it died (they come back after the 5 s visibility timeout).
    let now_ms = controller::clock::Clock::System.now_ms();
    let mut table = controller::partitions::Table::default();
    table.members.insert("ghost".into(), now_ms + 1_000);
    table.owners.insert(0, controller::partitions::Owned { owner: Some("ghost".into()), epoch: 1, wanted_by: None });
    st.store.put(fleet_domain::layout::PARTITIONS_KEY, bytes::Bytes::from(serde_json::to_vec(&table).unwrap()), "application/json").await.unwrap();
    let mut held = 0;
    while held < all {
        let got = st.results.receive(10, Duration::from_secs(1)).await.unwrap();
        assert!(!got.is_empty() || t.elapsed() < Duration::from_secs(60), "could not receive every message");
        held += got.len() as u64;
    }
    let died = Instant::now();
    // The heir: a 3 s lease (a round a second), triggers on (its idle listener parks).
    let stop = tokio_util::sync::CancellationToken::new();
    let deps = st.controller_deps(&stop);
    let settings = controller::Settings {
        listener: fleet_engine::args::ListenerArgs::quick(),
        lease_secs: 3,
        settle_secs: 3,
        id: Some("heir".into()),
        ..Default::default()
    };
    let heir = tokio::spawn(controller::run(settings, deps, stop.clone()));
    let r = st.wait_report(&job, Duration::from_secs(40)).await;
    println!("== partitions: the heir finished the job {:.1} s after its predecessor died holding every message", died.elapsed().as_secs_f64());
    assert_eq!(r.status, fleet_domain::model::JobStatus::Complete);
    assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(&files));
    assert_eq!(owners(&st).await.get(&0).map(String::as_str), Some("heir"));
    stop.cancel();
    heir.await.unwrap().unwrap();
}
