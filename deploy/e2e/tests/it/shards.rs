//! A work queue in shards (`--work-shards`) on real LocalStack and RabbitMQ: a job's work items spread
//! over every shard, a processor listens on each, the scaling agent's depth counts them all, and the
//! job bills exactly; on FIFO shards each message group stays on one shard, in order.

use std::time::Duration;

use crate::support::Fleet as _;
use crate::support::*;
use fleet_domain::model::JobStatus;
use fleet_io::call::Op;
use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_spreads_over_four_shards_and_bills_exactly() {
    let Some(st) = sharded_stack(4, false, QueueSettings::default()).await else { return };
    assert_eq!(st.shards.len(), 4);
    assert_eq!(st.shards[1].0.name(), format!("{}-1", st.names.work_queue));
    assert_eq!(st.shards[3].1.name(), format!("{}-3-dlq", st.names.work_queue));
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 12_000, 200, 11);

    // Before any processor runs: the items are on every shard, and the agent's depth is their sum.
    let s = st.submit(std::slice::from_ref(&f), 500).await;
    assert_eq!(s.total_chunks, 24);
    let mut per_shard = Vec::new();
    for (q, _) in &st.shards {
        st.wait_depth(q.as_ref(), 6, T).await;
        per_shard.push(q.depth().await.unwrap().visible);
    }
    assert_eq!(per_shard, vec![6; 4], "round-robin over the shards");
    let (work, _) = st.work_queues();
    assert_eq!(work.depth().await.unwrap().visible, 24);
    let snap = scaling_agent::snapshot(&scaling_agent::Watched {
        work: work.clone(),
        work_dlq: st.work_queues().1,
        results: st.results.clone(),
        results_dlq: st.results_dlq.clone(),
    })
    .await
    .unwrap();
    assert_eq!(snap.work.visible, 24, "the agent counts every shard");

    // One processor instance: a listener per shard drains them all; the job bills exactly.
    let p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let r = st.wait_report(&s, T).await;
    assert_eq!(r.status, JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.transactions.processed, 12_000);
    assert_eq!(report_accounts(&r), expected_accounts(std::slice::from_ref(&f)));
    for (q, _) in &st.shards {
        st.wait_depth(q.as_ref(), 0, T).await;
        assert!(q.calls().snapshot().calls(Op::SqsDeleteMessageBatch) > 0, "{} was listened to", q.name());
    }
    p.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifo_shards_keep_each_group_on_one_shard_in_order_and_bill_exactly() {
    use initiator::grouping::{GroupBy, Grouping};
    use initiator::submit::SubmitOptions;
    let Some(st) = sharded_stack(4, true, QueueSettings::default()).await else { return };
    assert!(st.shards.iter().all(|(q, d)| q.name().ends_with(".fifo") && d.name().ends_with("-dlq.fifo")));
    let dir = tempfile::tempdir().unwrap();
    let f = generated(dir.path(), "in.csv", 8_000, 60, 23);
    let grouping = Grouping::new(Some(GroupBy::Account), 8);
    let opts = |chunk_size| SubmitOptions { chunk_size, grouping, ..SubmitOptions::new(vec![f.clone()]) };

    let s = st.submit_with(opts(400)).await;
    let mut delivered = Vec::new();
    let mut groups_of_shard = Vec::new();
    for (q, _) in &st.shards {
        let got = drain_fifo(q.as_ref(), st.store.as_ref()).await;
        groups_of_shard.push(got.iter().map(|d| d.group.clone()).collect::<std::collections::BTreeSet<_>>());
        delivered.extend(got);
    }
    assert_eq!(delivered.len() as u32, s.total_chunks);
    let all: std::collections::BTreeSet<_> = groups_of_shard.iter().flatten().collect();
    assert_eq!(all.len(), 8, "8 message groups");
    assert_eq!(groups_of_shard.iter().map(|g| g.len()).sum::<usize>(), 8, "no group on two shards: {groups_of_shard:?}");
    assert!(groups_of_shard.iter().filter(|g| !g.is_empty()).count() >= 2, "groups spread over shards: {groups_of_shard:?}");
    assert_accounts_in_order(&delivered, std::slice::from_ref(&f));

    bills_exactly(&st, opts(500), 8_000).await;
}
