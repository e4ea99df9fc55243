//! Each transaction billed once across jobs (issue 60), on real LocalStack and RabbitMQ: the same
//! file twice, a rerun after Ctrl-C, two jobs sharing ids at once, and claims left by a controller
//! that died between claiming and its report, and a partial job finished by `initiator retry`. Every total is checked against an independent
//! reference (the files read and billed in this process, `expected_accounts`), summed over the jobs.

use std::time::Duration;

use crate::support::*;
use fleet_domain::claim_rows::{day_of, fingerprint};
use fleet_domain::layout::claims_key;
use fleet_domain::model::JobStatus;
use fleet_io::blob::BlobStore;
use fleet_io::provision::QueueSettings;

const T: Duration = Duration::from_secs(120);

async fn until(timeout: Duration, mut f: impl AsyncFnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !f().await {
        assert!(t0.elapsed() < timeout, "not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn duplicates_by(r: &fleet_domain::report::Report) -> Vec<&str> {
    r.rejected.iter().filter_map(|x| x.reason.strip_prefix("txn_id: already billed by job ").map(|s| s.split(' ').next().unwrap_or(""))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_file_twice_is_billed_once() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = generated(dir.path(), "day.csv", 6_000, 50, 11);
    let _p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let first = st.submit(std::slice::from_ref(&file), 1000).await;
    let r1 = st.wait_report(&first, T).await;
    assert_eq!((r1.status, r1.transactions.processed, r1.transactions.duplicates), (JobStatus::Complete, 6_000, 0));
    let second = st.submit(std::slice::from_ref(&file), 1000).await;
    let r2 = st.wait_report(&second, T).await;
    assert_consistent(&r1);
    assert_consistent(&r2);
    // Nothing billed again; every row named, with the job that billed it.
    assert_eq!((r2.status, r2.transactions.processed, r2.transactions.duplicates), (JobStatus::Complete, 0, 6_000));
    assert!(r2.accounts.is_empty(), "{:?}", &r2.accounts[..r2.accounts.len().min(3)]);
    assert!(duplicates_by(&r2).iter().all(|j| *j == first.job_id), "{:?}", &r2.rejected[..3]);
    assert!(r2.rejected.iter().all(|x| x.file.ends_with("day.csv") && x.line >= 2), "{:?}", &r2.rejected[..3]);
    assert_eq!(summed_accounts(&[&r1, &r2]), expected_accounts(std::slice::from_ref(&file)));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rerun_after_ctrl_c_bills_exactly_what_was_not_billed() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let _p = st.start_processor(fast_processor());
    let c = st.start_controller();
    let dir = tempfile::tempdir().unwrap();
    let big = generated(dir.path(), "big.csv", 100_000, 500, 3);
    let child = fleet_command(&st, "initiator")
        .args(["submit", big.to_str().unwrap(), "--chunk-size", "2000", "--upload-concurrency", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupted once 30 of its 50 chunks are stored (one at a time; work items go in tens).
    let stored = async || st.store.list(fleet_domain::layout::JOBS_PREFIX, 100).await.is_ok_and(|k| k.iter().filter(|k| k.contains("/chunks/")).count() >= 30);
    until(Duration::from_secs(60), stored).await;
    assert!(std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("rerun"), "the Ctrl-C line says what to do: {err}");
    let job = err.split("interrupted: job ").nth(1).and_then(|s| s.split_once(" abandoned")).map(|(id, _)| id.to_string()).unwrap_or_else(|| panic!("{err}"));
    let out = fleet_command(&st, "initiator").args(["wait", &job, "--json", "--timeout-secs", "120"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let abandoned: fleet_domain::report::Report = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(abandoned.status, JobStatus::Abandoned);
    let billed = abandoned.transactions.processed;
    assert!(billed > 0 && billed < 100_000, "the interrupted job billed part of the file: {billed}");
    // The obvious rerun of the same command, waited for.
    let out = fleet_command(&st, "initiator").args(["submit", big.to_str().unwrap(), "--chunk-size", "2000", "--wait", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let rerun: fleet_domain::report::Report = serde_json::from_slice(&out.stdout).unwrap();
    assert_consistent(&rerun);
    assert_eq!((rerun.transactions.duplicates, rerun.transactions.processed), (billed, 100_000 - billed));
    assert!(duplicates_by(&rerun).iter().all(|j| *j == job));
    assert_eq!(summed_accounts(&[&abandoned, &rerun]), expected_accounts(std::slice::from_ref(&big)));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_jobs_sharing_ids_at_once_bill_each_id_once() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    // a: ids 0..8,000; b: ids 4,000..8,000 of a (the same rows) and 4,000 of its own.
    let all = generated(dir.path(), "all.csv", 12_000, 80, 5);
    let text = std::fs::read_to_string(&all).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    let rows: Vec<&str> = lines.collect();
    let a = write(dir.path(), "a.csv", &format!("{header}\n{}\n", rows[..8_000].join("\n")));
    let b = write(dir.path(), "b.csv", &format!("{header}\n{}\n", rows[4_000..].join("\n")));
    let _p1 = st.start_processor(fast_processor());
    let _p2 = st.start_processor(fast_processor());
    let c1 = st.start_controller();
    let c2 = st.start_controller();
    let (ja, jb) = tokio::join!(st.submit(std::slice::from_ref(&a), 500), st.submit(std::slice::from_ref(&b), 500));
    let (ra, rb) = tokio::join!(st.wait_report(&ja, T), st.wait_report(&jb, T));
    assert_consistent(&ra);
    assert_consistent(&rb);
    // The 4,000 shared ids billed once, whichever job won each.
    assert_eq!(ra.transactions.duplicates + rb.transactions.duplicates, 4_000, "{:?} {:?}", ra.transactions, rb.transactions);
    assert_eq!(ra.transactions.processed + rb.transactions.processed, 12_000);
    assert_eq!(summed_accounts(&[&ra, &rb]), expected_accounts(std::slice::from_ref(&all)));
    c1.stop().await;
    c2.stop().await;
}

/// A controller that died between claiming a job's transactions and writing its report left claims
/// naming the job: its next owner finds them its own (none a duplicate). Claims naming another job
/// are that job's: those rows are duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_left_by_a_crash_are_the_jobs_own_and_anothers_are_duplicates() {
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = generated(dir.path(), "f.csv", 3_000, 40, 9);
    // Submitted with no controller running: the job waits, sealed, its chunks billed.
    let p = st.start_processor(fast_processor());
    let s = st.submit(std::slice::from_ref(&file), 500).await;
    // Its rows' claims as a crashed owner left them: the first 1,000 ids its own, the last 500 those
    // of a job that billed them before.
    let text = std::fs::read_to_string(&file).unwrap();
    let rows: Vec<(String, String)> = text
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].to_string(), f[4].to_string())
        })
        .collect();
    let mut segs: std::collections::BTreeMap<String, controller_core::claims::Segment> = Default::default();
    for (i, (id, ts)) in rows.iter().enumerate() {
        let who = if i < 1_000 {
            0
        } else if i >= 2_500 {
            1
        } else {
            continue;
        };
        let row = controller_core::claims::Row { day: day_of(ts.as_bytes()).unwrap(), fp: fingerprint(id.as_bytes()), chunk: 0, row: 0 };
        let seg = segs.entry(claims_key(row.day, row.shard(), 0)).or_insert_with(|| controller_core::claims::Segment {
            cap: controller_core::claims::SEGMENT_ENTRIES as u32,
            jobs: vec![s.job_id.clone(), "earlier-job".into()],
            entries: vec![],
        });
        seg.entries.push((row.fp, who));
    }
    for (key, mut seg) in segs {
        seg.entries.sort();
        st.store.put(&key, seg.encode(), "application/octet-stream").await.unwrap();
    }
    let c = st.start_controller();
    let r = st.wait_report(&s, T).await;
    assert_consistent(&r);
    assert_eq!((r.transactions.processed, r.transactions.duplicates), (2_500, 500), "{:?}", r.transactions);
    assert!(duplicates_by(&r).iter().all(|j| *j == "earlier-job"));
    let dup_ids: std::collections::BTreeSet<&str> = r.rejected.iter().filter_map(|x| x.txn_id.as_deref()).collect();
    let want: std::collections::BTreeSet<&str> = rows[2_500..].iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(dup_ids, want);
    // The reference: the file without the rows the earlier job billed.
    let kept =
        write(dir.path(), "kept.csv", &format!("{}\n{}\n", text.lines().next().unwrap(), text.lines().skip(1).take(2_500).collect::<Vec<_>>().join("\n")));
    assert_eq!(report_accounts(&r), expected_accounts(std::slice::from_ref(&kept)));
    c.stop().await;
    p.stop().await;
}

/// A `partial` job finished later: its failed chunk's blob is kept through the purge, `initiator
/// retry` (a real process) bills that chunk as a new job naming the one it completes, a second retry
/// bills nothing again (each row a duplicate of the first retry), and `--give-up` lets the kept
/// chunk go. Together the jobs bill the file exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partial_job_is_finished_by_retry_once_whatever_is_run_twice() {
    use fleet_domain::layout::{chunk_key, kept_key};
    let Some(st) = crate::support::stack(QueueSettings::default()).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = generated(dir.path(), "month.csv", 3_000, 40, 21);
    let c = st.start_controller();
    // No processor yet: chunk 2's blob is taken away before any is read (the cause), so that chunk
    // fails at once; then put back (the cause fixed).
    let s = st.submit(std::slice::from_ref(&file), 500).await;
    let key = chunk_key(&s.job_id, 2);
    let blob = st.store.get(&key).await.unwrap().expect("chunk 2 stored");
    st.store.delete(&key).await.unwrap();
    let p = st.start_processor(fast_processor());
    let r1 = st.wait_report(&s, T).await;
    assert_eq!((r1.status, r1.failed_chunks.iter().map(|f| f.chunk).collect::<Vec<_>>()), (JobStatus::Partial, vec![2]));
    assert_eq!(r1.transactions.failed, 500);
    st.store.put(&key, blob, "application/zstd").await.unwrap();
    // The purge keeps the failed chunk (and says which), the others go.
    until(Duration::from_secs(30), async || {
        st.store.list(&format!("jobs/{}/chunks/", s.job_id), 100).await.is_ok_and(|k| k == [key.clone()])
    })
    .await;
    let kept: fleet_domain::model::Kept = serde_json::from_slice(&st.store.get(&kept_key(&s.job_id)).await.unwrap().expect("kept.json")).unwrap();
    assert_eq!(kept.chunks, [2]);

    let retry = |what: &str| {
        let out = fleet_command(&st, "initiator").args(["retry", &s.job_id, "--json", "--wait-timeout-secs", "120"]).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{what}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<fleet_domain::report::Report>(&out.stdout).unwrap()
    };
    let r2 = retry("retry");
    assert_consistent(&r2);
    assert_eq!((r2.completes.as_deref(), r2.transactions.processed, r2.transactions.duplicates), (Some(s.job_id.as_str()), 500, 0));
    assert_eq!(summed_accounts(&[&r1, &r2]), expected_accounts(std::slice::from_ref(&file)), "the partial job and its retry bill the file once");
    // Run twice: nothing billed again, each row named with the first retry.
    let r3 = retry("retry again");
    assert_eq!((r3.completes.as_deref(), r3.transactions.processed, r3.transactions.duplicates), (Some(s.job_id.as_str()), 0, 500));
    assert!(duplicates_by(&r3).iter().all(|j| *j == r2.job_id), "{:?}", &r3.rejected[..3]);
    assert_eq!(summed_accounts(&[&r1, &r2, &r3]), expected_accounts(std::slice::from_ref(&file)));
    // Given up: the kept chunk goes, and a retry says there is nothing to retry.
    let out = fleet_command(&st, "initiator").args(["retry", &s.job_id, "--give-up"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(st.store.get(&key).await.unwrap().is_none() && st.store.get(&kept_key(&s.job_id)).await.unwrap().is_none());
    let out = fleet_command(&st, "initiator").args(["retry", &s.job_id]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("keeps no failed chunks"), "{}", String::from_utf8_lossy(&out.stderr));
    p.stop().await;
    c.stop().await;
}
