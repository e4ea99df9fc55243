//! `initiator warehouse backfill`: the warehouse tables' objects (`fleet_warehouse`) of jobs that
//! finished before the controller wrote them, made from the jobs' reports. Each job's report is read
//! (`warehouse/{job}/report.json`), its two objects' keys found from its ending's day, and each one
//! missing is encoded and created only if absent: the same bytes the controller writes, so a job the
//! controller files meanwhile, or a rerun after an interruption, writes nothing twice. A report that
//! cannot be read (not a report, another job's, a time that is not one) is named with its key and
//! the reason, and the other jobs go on; an S3 error stops the run (a rerun resumes: what is written
//! is skipped by a HEAD, no encoding).

use std::collections::BTreeMap;

use bytes::Bytes;
use fleet_domain::layout::{report_key, WAREHOUSE_PREFIX};
use fleet_domain::report::Report;
use fleet_io::blob::{BlobStore, Cond};
use futures::{StreamExt, TryStreamExt};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::CliError;

/// What a backfill did.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Backfilled {
    /// Jobs with a report.
    pub jobs: u64,
    /// Jobs that had an object written (one or both tables).
    pub filled: u64,
    /// Objects written.
    pub written: u64,
    /// Jobs whose objects were all there.
    pub present: u64,
    /// Reports that could not be made into rows: key, then why.
    pub unreadable: BTreeMap<String, String>,
}

impl std::fmt::Display for Backfilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} job(s) with a report: {} filled ({} object(s) written), {} already there", self.jobs, self.filled, self.written, self.present)?;
        if !self.unreadable.is_empty() {
            write!(f, ", {} unreadable (nothing written for them):", self.unreadable.len())?;
            for (key, why) in &self.unreadable {
                write!(f, "\n  {key}: {why}")?;
            }
        }
        Ok(())
    }
}

/// One job's outcome.
enum Outcome {
    Written(u64),
    Present,
    Unreadable(String, String),
}

/// Backfills every job with a report, `concurrency` at a time, with a progress bar on standard error
/// when `show`.
pub async fn backfill(store: &dyn BlobStore, concurrency: usize, show: bool) -> Result<Backfilled, CliError> {
    let jobs: Vec<String> = store
        .list(WAREHOUSE_PREFIX, usize::MAX)
        .await?
        .into_iter()
        .filter_map(|k| k.strip_prefix(WAREHOUSE_PREFIX)?.strip_suffix("/report.json").map(str::to_string))
        .collect();
    let bar = ProgressBar::with_draw_target(Some(jobs.len() as u64), if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    bar.set_style(ProgressStyle::with_template("backfill  [{bar:30}] {pos}/{len} jobs {msg} ({elapsed})").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let mut done = Backfilled { jobs: jobs.len() as u64, ..Backfilled::default() };
    let mut outcomes = futures::stream::iter(jobs.iter().map(|job| one(store, job))).buffer_unordered(concurrency.max(1));
    while let Some(outcome) = outcomes.try_next().await? {
        match outcome {
            Outcome::Written(n) => {
                done.filled += 1;
                done.written += n;
            }
            Outcome::Present => done.present += 1,
            Outcome::Unreadable(key, why) => {
                bar.suspend(|| eprintln!("{key}: {why}; skipped"));
                done.unreadable.insert(key, why);
            }
        }
        bar.set_message(format!("{} written", done.written));
        bar.inc(1);
    }
    bar.finish();
    Ok(done)
}

/// One job: its report read, its missing objects written.
async fn one(store: &dyn BlobStore, job: &str) -> Result<Outcome, CliError> {
    let key = report_key(job);
    let unreadable = |why: String| Ok(Outcome::Unreadable(key.clone(), why));
    let Some(body) = store.get(&key).await? else {
        // Gone since the listing (a retention rule): nothing to file.
        return Ok(Outcome::Present);
    };
    let report: Report = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return unreadable(format!("not a report: {e}")),
    };
    drop(body);
    if report.job_id != job {
        return unreadable(format!("the report is job {:?}'s, not {job:?}'s", report.job_id));
    }
    if !report.status.is_finished() {
        return unreadable(format!("the report's status {:?} is not a finished job's", report.status));
    }
    let keys = match fleet_warehouse::keys(&report) {
        Ok(k) => k,
        Err(e) => return unreadable(e.to_string()),
    };
    let mut missing = Vec::new();
    for (table, object) in keys {
        if store.head(&object).await?.is_none() {
            missing.push((table, object));
        }
    }
    if missing.is_empty() {
        return Ok(Outcome::Present);
    }
    // Encoding a million accounts takes a second or two: off the runtime's threads.
    let report = std::sync::Arc::new(report);
    let mut written = 0;
    for (table, object) in missing {
        let r = report.clone();
        let encoded = tokio::task::spawn_blocking(move || table.encode(r.as_ref())).await.map_err(|e| CliError::Input(format!("encoding {object}: {e}")))?;
        let bytes = match encoded {
            Ok(b) => b,
            Err(e) => return unreadable(e.to_string()),
        };
        if store.put_if(&object, Bytes::from(bytes), fleet_warehouse::MEDIA_TYPE, &BTreeMap::new(), &Cond::Absent).await?.is_some() {
            written += 1;
        }
    }
    Ok(if written == 0 { Outcome::Present } else { Outcome::Written(written) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet_io::memory::MemoryStore;

    /// A finished job's report, as the controller writes it.
    fn report(job: &str, finished_at: &str) -> Report {
        use fleet_domain::billing::{AccountTotals, Tariff, Totals};
        let manifest = fleet_domain::model::Manifest {
            chunk_lines: Vec::new(),
            completes: None,
            partition: 0,
            v: 1,
            job_id: job.into(),
            created_at: "2026-11-27T23:59:00Z".into(),
            files: vec!["a.csv".into()],
            submitted: 2,
            accepted: 2,
            rejected: vec![],
            total_chunks: 1,
            chunk_transactions: vec![2],
            tariff: Tariff::default(),
            requests: Default::default(),
        };
        let mut totals = Totals::new();
        let (gross, fees) = (rust_decimal::Decimal::new(1_000, 2), rust_decimal::Decimal::new(89, 2));
        totals.add(&AccountTotals { account_id: "A1".into(), currency: "EUR".into(), count: 2, gross, fees });
        let mut r = fleet_domain::report::build(&manifest, &totals, vec![], &Default::default());
        r.status = fleet_domain::model::JobStatus::Complete;
        r.finished_at = finished_at.into();
        r
    }

    #[tokio::test]
    async fn a_backfill_fills_what_is_missing_once_and_names_what_it_cannot_read() {
        let store = MemoryStore::new();
        for (job, at) in [("j1", "2026-11-28T00:00:01Z"), ("j2", "2026-11-27T12:00:00Z")] {
            store.put(&report_key(job), Bytes::from(serde_json::to_vec(&report(job, at)).unwrap()), "application/json").await.unwrap();
        }
        store.put(&report_key("j3"), Bytes::from_static(b"{\"job_id\": 3"), "application/json").await.unwrap();
        store.put(&report_key("j4"), Bytes::from(serde_json::to_vec(&report("j1", "2026-11-28T00:00:01Z")).unwrap()), "application/json").await.unwrap();
        // j2's jobs object is there already (its finish was cut short before the accounts one).
        let j2 = report("j2", "2026-11-27T12:00:00Z");
        let [_, (jobs_table, jobs_key)] = fleet_warehouse::keys(&j2).unwrap();
        store.put(&jobs_key, Bytes::from(jobs_table.encode(&j2).unwrap()), fleet_warehouse::MEDIA_TYPE).await.unwrap();

        let done = backfill(store.as_ref(), 2, false).await.unwrap();
        assert_eq!((done.jobs, done.filled, done.written, done.present), (4, 2, 3, 0), "{done}");
        assert_eq!(done.unreadable.keys().cloned().collect::<Vec<_>>(), [report_key("j3"), report_key("j4")]);
        assert!(done.unreadable[&report_key("j4")].contains("job \"j1\"'s"), "{done}");
        // Filed under the day of the ending, in both tables; the same bytes the controller writes.
        let j1 = report("j1", "2026-11-28T00:00:01Z");
        for (table, key) in fleet_warehouse::keys(&j1).unwrap() {
            assert!(key.contains("billed_on=2026-11-28/j1.parquet"), "{key}");
            assert_eq!(store.get(&key).await.unwrap().expect("written").as_ref(), table.encode(&j1).unwrap().as_slice());
        }
        // A rerun writes nothing.
        let again = backfill(store.as_ref(), 2, false).await.unwrap();
        assert_eq!((again.filled, again.written, again.present), (0, 0, 2));
    }
}
