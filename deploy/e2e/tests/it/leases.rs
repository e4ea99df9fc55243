//! Several controllers on one results queue (seed 003's leases, per job), on the LocalStack and
//! RabbitMQ that deploy/test.sh starts: S3 conditional writes behave as the leases need, and two
//! `controller` processes share a job's results while the one that owns the job is killed with
//! SIGKILL mid-job; the survivor takes the job over when the lease expires and the totals are exact;
//! three `controller` processes, the owner of a job larger than one checkpoint document stopped
//! (SIGSTOP) past its lease mid-job and again while it finishes, the others killed and restarted:
//! every job complete and exact.

use crate::support::{Fleet as _, Procs};
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

fn signal(child: &std::process::Child, sig: &str) {
    let ok = std::process::Command::new("kill").args([sig, &child.id().to_string()]).status().expect("kill").success();
    assert!(ok, "kill {sig} {}", child.id());
}

/// The owner of `job` now (from its lease).
async fn owner_of(st: &fleet_test_support::Stack, job: &str) -> Option<String> {
    let lease = st.store.get(&fleet_domain::layout::lease_key(job)).await.ok()??;
    let v: serde_json::Value = serde_json::from_slice(&lease).ok()?;
    Some(v["owner"].as_str()?.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_controllers_one_stopped_past_its_lease_while_finishing_others_restarted_exact() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 10, visibility_timeout: Duration::from_secs(5) }).await else { return };
    let lease = Duration::from_secs(3);
    let lease_env = [("CONTROLLER_LEASE_SECS", "3")];
    let ids = ["ctl-1", "ctl-2", "ctl-3"];
    let mut ctl = Procs(ids.iter().map(|id| crate::support::controller_process(&st, id, &lease_env)).collect());
    let ctl = &mut ctl.0;
    let p = st.start_processor(crate::support::fast_processor());
    // As in production: the agent wakes the controllers' parked dead-letter listeners when results
    // reach the results dead-letter queue (a message handed back between controllers spends a
    // receive each time, and a job's owner stopped for three leases makes that likelier).
    let agent = st.start_agent();
    let dir = tempfile::tempdir().unwrap();
    // More (account, currency) rows than a checkpoint document holds inline (4,096): its rows live in parts.
    let big = vec![crate::support::generated(dir.path(), "big.csv", 60_000, 6_000, 41)];
    let small: Vec<Vec<std::path::PathBuf>> = (0..2).map(|i| vec![crate::support::generated(dir.path(), &format!("s{i}.csv"), 8_000, 300, 50 + i)]).collect();
    let job = st.submit(&big, 500).await;
    let others = [st.submit(&small[0], 1_000).await, st.submit(&small[1], 1_000).await];
    let index = |owner: &str| ids.iter().position(|i| *i == owner).expect("a known controller");
    // Mid-job: the big job's owner is stopped past its lease; another controller is killed and restarted.
    let t = Instant::now();
    let owner = loop {
        let progress = initiator::follow::progress(st.store.as_ref(), &job.job_id).await;
        if let (Some(o), Ok(p)) = (owner_of(&st, &job.job_id).await, progress) {
            if p.accounted_chunks >= 5 && p.accounted_chunks < job.total_chunks {
                break o;
            }
        }
        assert!(t.elapsed() < Duration::from_secs(90), "the job did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let o = index(&owner);
    signal(&ctl[o], "-STOP");
    let bystander = (o + 1) % 3;
    ctl[bystander].kill().unwrap();
    ctl[bystander].wait().unwrap();
    ctl[bystander] = crate::support::controller_process(&st, ids[bystander], &lease_env);
    tokio::time::sleep(lease * 2).await;
    signal(&ctl[o], "-CONT");
    eprintln!("{owner} stopped {} s mid-job; {} killed and restarted", (lease * 2).as_secs(), ids[bystander]);
    // As it finishes (its last chunks coming in, or its ending committed and its report not yet
    // written): its owner is stopped past its lease again, so another controller finishes it (or
    // writes the report of the committed ending) and the stopped one is fenced when it wakes.
    let t = Instant::now();
    let mut caught = None;
    while t.elapsed() < Duration::from_secs(120) {
        if let Ok(Some(p)) = initiator::follow::checkpoint_progress(st.store.as_ref(), &job.job_id).await {
            if p.status.is_finished() {
                break;
            }
            if p.accounted * 4 >= job.total_chunks * 3 {
                if let Some(owner) = owner_of(&st, &job.job_id).await {
                    let i = index(&owner);
                    signal(&ctl[i], "-STOP");
                    caught = Some(i);
                    tokio::time::sleep(lease * 3).await;
                    signal(&ctl[i], "-CONT");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    eprintln!("owner stopped as it finished: {}", caught.map_or("missed (it finished first)".to_string(), |i| ids[i].to_string()));
    let report = st.wait_report(&job, Duration::from_secs(120)).await;
    crate::support::assert_consistent(&report);
    assert_eq!(report.status, fleet_domain::model::JobStatus::Complete, "{:?}", report.failed_chunks);
    assert_eq!(crate::support::report_accounts(&report), crate::support::expected_accounts(&big), "exact totals after two stops and a restart");
    for (s, files) in others.iter().zip(&small) {
        let r = st.wait_report(s, Duration::from_secs(60)).await;
        assert_eq!(r.status, fleet_domain::model::JobStatus::Complete);
        assert_eq!(crate::support::report_accounts(&r), crate::support::expected_accounts(files));
    }
    agent.stop().await;
    p.stop().await;
}
