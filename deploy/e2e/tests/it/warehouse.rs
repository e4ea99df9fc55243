//! The warehouse's tables read by readers no one here wrote: pyarrow's dataset API and DuckDB (over
//! S3, Hive partitioning), from PyPI (`deploy/warehouse/venv.sh`), after real jobs on LocalStack, two of
//! them with objects made by `initiator warehouse backfill` from their reports.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::Fleet as _;
use crate::support::*;
use bytes::Bytes;
use fleet_domain::layout::{accounts_key, chunk_key};
use fleet_domain::model::JobStatus;
use fleet_io::blob::BlobStore;
use fleet_io::provision::QueueSettings;
use rust_decimal::Decimal;
use serde_json::Value;

const T: Duration = Duration::from_secs(90);

/// The readers' python, made by `deploy/warehouse/venv.sh` (`None`, with the reason, when it cannot
/// be made here: no PyPI).
fn reader_python() -> Result<String, String> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../warehouse/venv.sh");
    let out = std::process::Command::new(&script).output().map_err(|e| format!("{}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed: {}", script.display(), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Per (account, currency): transactions, gross, fees, net, as the readers print them.
type Sums = BTreeMap<(String, String), (u64, Decimal, Decimal, Decimal)>;

fn sums_of(rows: &Value) -> Sums {
    rows.as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            let s = |i: usize| r[i].as_str().expect("a string").to_string();
            let d = |i: usize| s(i).parse::<Decimal>().expect("a decimal");
            ((s(0), s(1)), (s(2).parse().expect("a count"), d(3), d(4), d(5)))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tables_read_by_pyarrow_and_duckdb_equal_the_jobs_accounts_and_reports() {
    let Some(st) = crate::support::stack(QueueSettings { max_receive_count: 2, visibility_timeout: Duration::from_secs(2) }).await else { return };
    let python = match reader_python() {
        Ok(p) => p,
        Err(why) if std::env::var_os("FLEET_REQUIRE_STACK").is_none() => {
            eprintln!("skipped: the warehouse's readers cannot be installed here: {why}");
            return;
        }
        Err(why) => panic!("the warehouse's readers: {why}"),
    };
    let dir = tempfile::tempdir().unwrap();
    // Three jobs over overlapping accounts; the third partial (a chunk's blob damaged).
    let a = generated(dir.path(), "a.csv", 3_000, 40, 11);
    let b = generated(dir.path(), "b.csv", 2_000, 60, 12);
    let c = generated(dir.path(), "c.csv", 2_000, 40, 13);
    let sa = st.submit(std::slice::from_ref(&a), 1_000).await;
    let sb = st.submit(std::slice::from_ref(&b), 1_000).await;
    let sc = st.submit(std::slice::from_ref(&c), 500).await;
    st.store.put(&chunk_key(&sc.job_id, 1), Bytes::from_static(b"\x28\xb5\x2f\xfd garbage"), "application/zstd").await.unwrap();
    let p = st.start_processor(fast_processor());
    let ctl = st.start_controller();
    let mut reports = Vec::new();
    for s in [&sa, &sb, &sc] {
        reports.push(st.wait_report(s, T).await);
    }
    assert_eq!(reports.iter().map(|r| r.status).collect::<Vec<_>>(), [JobStatus::Complete, JobStatus::Complete, JobStatus::Partial]);
    // Jobs finished before the controller wrote tables: b's objects gone, c's jobs object gone (a
    // finish cut short between the two); `initiator warehouse backfill` writes them from the
    // reports, the bytes the controller wrote, and names a report it cannot read.
    let (rb, rc) = (&reports[1], &reports[2]);
    let [(_, b_accounts), (_, b_jobs)] = fleet_warehouse::keys(rb).unwrap();
    let [_, (_, c_jobs)] = fleet_warehouse::keys(rc).unwrap();
    let written_by_controller = st.store.get(&b_accounts).await.unwrap().expect("the controller wrote b's accounts");
    for key in [&b_accounts, &b_jobs, &c_jobs] {
        st.store.delete(key).await.unwrap();
    }
    st.store.put(&fleet_domain::layout::report_key("not-a-job"), Bytes::from_static(b"<html>"), "text/html").await.unwrap();
    let done = initiator::warehouse::backfill(st.store.as_ref(), 2, false).await.unwrap();
    eprintln!("backfill: {done}");
    assert_eq!((done.jobs, done.filled, done.written, done.present), (4, 2, 3, 1), "{done}");
    assert_eq!(done.unreadable.keys().cloned().collect::<Vec<_>>(), [fleet_domain::layout::report_key("not-a-job")]);
    assert_eq!(st.store.get(&b_accounts).await.unwrap().expect("backfilled"), written_by_controller);
    let again = initiator::warehouse::backfill(st.store.as_ref(), 2, false).await.unwrap();
    assert_eq!((again.written, again.present), (0, 3), "a rerun writes nothing: {again}");
    // What the jobs' accounts.csv say, summed over the jobs.
    let mut expected = Sums::new();
    for s in [&sa, &sb, &sc] {
        let csv = st.store.get(&accounts_key(&s.job_id)).await.unwrap().expect("accounts.csv");
        for line in std::str::from_utf8(&csv).unwrap().lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            let e = expected.entry((f[0].to_string(), f[1].to_string())).or_default();
            e.0 += f[2].parse::<u64>().unwrap();
            e.1 += f[3].parse::<Decimal>().unwrap();
            e.2 += f[4].parse::<Decimal>().unwrap();
            e.3 += f[5].parse::<Decimal>().unwrap();
        }
    }
    let jobs = [&sa, &sb, &sc].iter().map(|s| s.job_id.clone()).collect::<Vec<_>>().join(",");
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(&python)
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../warehouse/read_tables.py"))
        .args(["--bucket", &st.names.bucket, "--jobs", &jobs])
        .env("AWS_ENDPOINT_URL", std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| fleet_test_support::LOCALSTACK.to_string()))
        .env("AWS_REGION", std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into()))
        .env("AWS_ACCESS_KEY_ID", std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".into()))
        .env("AWS_SECRET_ACCESS_KEY", std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".into()))
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "read_tables.py: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("read_tables.py read {} account rows in {:.1} s", v["pyarrow"]["rows"], started.elapsed().as_secs_f64());

    // Both readers: per account and currency over the three jobs, exactly the accounts.csv rows' sums.
    assert_eq!(sums_of(&v["pyarrow"]["accounts"]), expected, "pyarrow");
    assert_eq!(sums_of(&v["duckdb"]["accounts"]), expected, "duckdb");
    let rows: usize = reports.iter().map(|r| r.accounts.len()).sum();
    assert_eq!(v["pyarrow"]["rows"].as_u64(), Some(rows as u64), "one row per job, account and currency");
    // The recipe's query per day: the same in both.
    assert_eq!(v["pyarrow"]["per_day"], v["duckdb"]["per_day"]);
    // Typed: money a decimal, never a string or a float; times in UTC.
    assert_eq!(v["pyarrow"]["schema"]["gross"], "decimal128(38, 4)");
    assert_eq!(v["pyarrow"]["schema"]["finished_at"], "timestamp[ms, tz=UTC]");
    assert_eq!(v["duckdb"]["types"]["net"], "DECIMAL(38,4)");
    // The jobs table: one row per job, as its report says, under the day of its ending.
    let got = v["pyarrow"]["jobs"].as_array().unwrap();
    assert_eq!(got.len(), 3);
    for r in &reports {
        let row = got.iter().find(|j| j["job_id"] == r.job_id.as_str()).expect("the job's row");
        let t = &r.transactions;
        assert_eq!(row["status"], serde_json::to_value(r.status).unwrap(), "{}", r.job_id);
        assert_eq!(row["counts"], serde_json::json!([t.submitted, t.accepted, t.rejected, t.processed, t.failed, t.duplicates]));
        assert_eq!(row["failed_chunks"], serde_json::json!(r.failed_chunks.iter().map(|f| f.chunk).collect::<Vec<_>>()));
        assert_eq!(row["billed_on"], &r.finished_at[..10]);
        assert_eq!(row["requests"], r.requests.total);
        let cost = r.requests.cost.as_ref().map(|c| c.total_usd.parse::<Decimal>().unwrap());
        assert_eq!(row["cost_usd"].as_str().map(|c| c.parse::<Decimal>().unwrap()), cost);
        assert_eq!(row["files"], serde_json::json!(r.files));
    }
    p.stop().await;
    ctl.stop().await;
}
