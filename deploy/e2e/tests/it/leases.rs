//! Several controllers on one results queue (seed 003's leases, per job), on the LocalStack and
//! RabbitMQ that deploy/test.sh starts: S3 conditional writes behave as the leases need, and two
//! `controller` processes share a job's results while the one that owns the job is killed with
//! SIGKILL mid-job; the survivor takes the job over when the lease expires and the totals are exact.

use crate::support::Fleet as _;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::provision::QueueSettings;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_writes_on_localstack() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let s = st.store.as_ref();
    let meta = Default::default();
    let e1 = s.put_if("leases/t.json", Bytes::from_static(b"1"), "application/json", &meta, &Cond::Absent).await.unwrap().expect("created");
    assert_eq!(s.put_if("leases/t.json", Bytes::from_static(b"2"), "application/json", &meta, &Cond::Absent).await.unwrap(), None, "If-None-Match: *");
    let e2 = s.put_if("leases/t.json", Bytes::from_static(b"3"), "application/json", &meta, &Cond::Matches(e1.clone())).await.unwrap().expect("If-Match");
    assert_ne!(e1, e2);
    assert_eq!(s.put_if("leases/t.json", Bytes::from_static(b"4"), "application/json", &meta, &Cond::Matches(e1)).await.unwrap(), None, "stale ETag");
    let (body, etag) = s.get_tagged("leases/t.json").await.unwrap().unwrap();
    assert_eq!((body.as_ref(), etag), (&b"3"[..], e2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_controllers_one_killed_mid_job_the_other_takes_over_exact() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 10, visibility_timeout: Duration::from_secs(5) }).await else { return };
    let mut a = crate::support::controller_process(&st, "ctl-a", &[]);
    let mut b = crate::support::controller_process(&st, "ctl-b", &[]);
    let p = st.start_processor(crate::support::fast_processor());
    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "shared.csv", 150_000, 700, 17)];
    let job = st.submit(&files, 1_500).await;
    // Mid-job: the owner has checkpointed part of it.
    let t = Instant::now();
    let owner = loop {
        let lease = st.store.get(&fleet_domain::layout::lease_key(&job.job_id)).await.unwrap();
        let progress = initiator::follow::progress(st.store.as_ref(), &job.job_id).await;
        if let (Some(l), Ok(p)) = (lease, progress) {
            if p.accounted_chunks >= 10 && p.accounted_chunks < job.total_chunks {
                let v: serde_json::Value = serde_json::from_slice(&l).unwrap();
                break v["owner"].as_str().unwrap().to_string();
            }
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the job did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (victim, survivor) = if owner == "ctl-a" { (&mut a, "ctl-b") } else { (&mut b, "ctl-a") };
    victim.kill().unwrap();
    victim.wait().unwrap();
    let killed_at = Instant::now();
    let report = st.wait_report(&job, Duration::from_secs(120)).await;
    eprintln!("owner {owner} SIGKILLed mid-job; report {:.1} s later", killed_at.elapsed().as_secs_f64());
    crate::support::assert_consistent(&report);
    assert_eq!(report.status, fleet_domain::model::JobStatus::Complete, "{:?}", report.failed_chunks);
    assert_eq!(crate::support::report_accounts(&report), crate::support::expected_accounts(&files), "exact totals after the takeover");
    // The survivor finished it (the lease records the last owner).
    let lease: serde_json::Value = serde_json::from_slice(&st.store.get(&fleet_domain::layout::lease_key(&job.job_id)).await.unwrap().unwrap()).unwrap();
    assert_eq!(lease["owner"], survivor);
    // A second job with both... one controller left: completes too.
    let more = vec![crate::support::generated(dir.path(), "more.csv", 20_000, 100, 18)];
    let next = st.submit(&more, 1_000).await;
    let r = st.wait_report(&next, Duration::from_secs(60)).await;
    assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(&more));
    for c in [&mut a, &mut b] {
        let _ = c.kill();
        let _ = c.wait();
    }
    p.stop().await;
}
