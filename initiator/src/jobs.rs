//! `initiator jobs`: the fleet's jobs as an operator looks for one, without knowing its id: the open
//! ones (the controllers' `open/` markers, written at a job's first checkpoint, with the progress its
//! checkpoint's metadata carries: one HEAD each) and the ones finished in the last days (the
//! warehouse's `jobs` table, one object per job under the day its ending was committed: one LIST per
//! day, newest first, then a HEAD each). A job submitted while no controller runs is not listed until
//! one begins it; `initiator status JOB` finds it by id. Each job's files and submit time come from
//! the metadata of its first object (`jobs/{job}/tariff.json`, a HEAD), or, for a job submitted
//! before that was kept (or whose blobs are purged), the time from its id (a UUIDv7). A quarantined
//! job is listed among the finished: its jobs-table row says so (it bills nothing).

use fleet_domain::layout::{checkpoint_keys, tariff_key, OPEN_PREFIX};
use fleet_domain::model::{JobStatus, Progress, Submission};
use fleet_io::blob::BlobStore;
use fleet_warehouse::Table;
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::CliError;

/// Most finished jobs of one day looked through for its newest.
const MAX_PER_DAY: usize = 100_000;

/// HEAD requests in flight at once.
const HEADS_AT_ONCE: usize = 16;

/// One job as listed.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct JobLine {
    pub job_id: String,
    /// From its checkpoint; `None` when it has none yet (or it cannot be read).
    pub status: Option<JobStatus>,
    pub accounted_chunks: u32,
    /// Known once the job is sealed.
    pub total_chunks: Option<u32>,
    pub failed_chunks: u32,
    pub processed: u64,
    /// The day the job's ending was committed (finished jobs only).
    pub billed_on: Option<String>,
    /// When it was submitted (RFC 3339, UTC), when known.
    pub submitted_at: Option<String>,
    /// Its input files (empty when unknown), and how many more there were than kept.
    pub files: Vec<String>,
    pub more_files: usize,
}

/// The open jobs and those finished in the last `days`.
#[derive(Debug, Clone, Serialize)]
pub struct JobList {
    pub open: Vec<JobLine>,
    /// More open jobs than the limit.
    pub open_more: bool,
    pub finished: Vec<JobLine>,
    /// The days looked at for finished jobs, newest first.
    pub days: Vec<String>,
}

/// The jobs of the bucket: at most `limit` open and `limit` finished, the finished ones from the
/// `days` days up to `today` (UTC), newest day first.
pub async fn list(store: &dyn BlobStore, today: time::Date, days: u16, limit: usize) -> Result<JobList, CliError> {
    let keys = store.list(OPEN_PREFIX, limit + 1).await?;
    let open_more = keys.len() > limit;
    let open_ids: Vec<(String, Option<String>)> =
        keys.iter().take(limit).filter_map(|k| k.strip_prefix(OPEN_PREFIX)).map(|id| (id.to_string(), None)).collect();
    let mut finished_ids = Vec::new();
    let mut looked = Vec::new();
    let mut day = today;
    for _ in 0..days {
        if finished_ids.len() >= limit {
            break;
        }
        let d = fleet_warehouse::day(day);
        // The whole day (a LIST per thousand jobs), for its newest: job ids are UUIDv7, time-ordered.
        let keys = store.list(&Table::Jobs.day_prefix(&d), MAX_PER_DAY).await?;
        let want = limit - finished_ids.len();
        finished_ids.extend(keys.iter().rev().filter_map(|k| Table::Jobs.job_of(k)).take(want).map(|id| (id.to_string(), Some(d.clone()))));
        looked.push(d);
        match day.previous_day() {
            Some(p) => day = p,
            None => break,
        }
    }
    Ok(JobList { open: lines(store, open_ids).await?, open_more, finished: lines(store, finished_ids).await?, days: looked })
}

/// Each job's line, its progress read from its checkpoint's metadata.
async fn lines(store: &dyn BlobStore, ids: Vec<(String, Option<String>)>) -> Result<Vec<JobLine>, CliError> {
    futures::stream::iter(ids)
        .map(|(job_id, billed_on)| async move {
            let (checkpoints, tariff) = (checkpoint_keys(&job_id), tariff_key(&job_id));
            let (p, sub) = tokio::join!(fleet_io::blob::head_first(store, &checkpoints), store.head(&tariff));
            let p: Option<Progress> = p?.as_ref().and_then(Progress::from_meta);
            let sub = sub?.as_ref().and_then(Submission::from_meta);
            Ok::<_, CliError>(JobLine {
                submitted_at: sub.as_ref().map(|s| s.submitted_at.clone()).or_else(|| time_of_id(&job_id)),
                more_files: sub.as_ref().map_or(0, |s| s.more_files),
                files: sub.map(|s| s.files).unwrap_or_default(),
                status: p.map(|p| p.status),
                accounted_chunks: p.map_or(0, |p| p.accounted),
                total_chunks: p.and_then(|p| p.total),
                failed_chunks: p.map_or(0, |p| p.failed),
                processed: p.map_or(0, |p| p.processed),
                job_id,
                billed_on,
            })
        })
        .buffered(HEADS_AT_ONCE)
        .try_collect()
        .await
}

/// The time in a UUIDv7 job id (every job id this fleet makes), to the second, UTC.
fn time_of_id(job_id: &str) -> Option<String> {
    let (secs, _) = uuid::Uuid::parse_str(job_id).ok()?.get_timestamp()?.to_unix();
    let t = time::OffsetDateTime::from_unix_timestamp(i64::try_from(secs).ok()?).ok()?;
    t.format(&time::format_description::well_known::Rfc3339).ok()
}

/// A submit time as listed: `2026-12-07 21:04:05` (UTC), `-` unknown.
fn shown_time(t: Option<&str>) -> String {
    t.map_or("-".into(), |t| t.get(..19).unwrap_or(t).replace('T', " "))
}

/// The files as listed: the names, then how many more.
fn shown_files(j: &JobLine) -> String {
    let more = j.more_files + j.files.len().saturating_sub(3);
    let mut s = j.files.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
    if more > 0 {
        s.push_str(&format!(" and {more} more"));
    }
    if s.is_empty() {
        s.push('-');
    }
    s
}

fn status_word(s: Option<JobStatus>) -> &'static str {
    match s {
        None => "-",
        Some(JobStatus::Running) => "running",
        Some(JobStatus::Complete) => "complete",
        Some(JobStatus::Partial) => "partial",
        Some(JobStatus::Abandoned) => "abandoned",
        Some(JobStatus::Quarantined) => "quarantined",
    }
}

impl std::fmt::Display for JobList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |f: &mut std::fmt::Formatter<'_>, j: &JobLine| {
            let chunks = format!("{}/{}", j.accounted_chunks, j.total_chunks.map_or("?".to_string(), |t| t.to_string()));
            writeln!(
                f,
                "{:<38} {:<19} {:<11} {:>11} {:>7} {:>12} {:<10} {}",
                j.job_id,
                shown_time(j.submitted_at.as_deref()),
                status_word(j.status),
                chunks,
                j.failed_chunks,
                j.processed,
                j.billed_on.as_deref().unwrap_or("-"),
                shown_files(j)
            )
        };
        writeln!(
            f,
            "{:<38} {:<19} {:<11} {:>11} {:>7} {:>12} {:<10} files",
            "job", "submitted (UTC)", "status", "chunks", "failed", "processed", "billed_on"
        )?;
        for j in &self.open {
            row(f, j)?;
        }
        if self.open_more {
            writeln!(f, "... more open jobs than shown (--limit)")?;
        }
        for j in &self.finished {
            row(f, j)?;
        }
        let span = match (self.days.first(), self.days.last()) {
            (Some(a), Some(b)) if a != b => format!("{b} to {a}"),
            (Some(a), _) => a.clone(),
            _ => "no day".into(),
        };
        write!(f, "{} open, {} finished ({span}, UTC)", self.open.len(), self.finished.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use fleet_io::blob::memory::MemoryStore;
    use fleet_io::blob::Cond;

    async fn checkpoint(store: &MemoryStore, job: &str, status: JobStatus, accounted: u32) {
        let p =
            Progress { status, sealed: true, total: Some(4), accounted, failed: 0, processed: u64::from(accounted) * 10, updated_unix: 1, partition: Some(0) };
        // An older job's where releases before `checkpoints/` kept it (read where none is under it).
        let key = if job == "j-c" { fleet_domain::layout::legacy_checkpoint_key(job) } else { fleet_domain::layout::checkpoint_key(job) };
        store.put_if(&key, Bytes::from_static(b"{}"), "application/json", &p.to_meta(), &Cond::Any).await.unwrap();
    }

    #[tokio::test]
    async fn open_jobs_and_the_last_days_finished_newest_first() {
        let store = MemoryStore::new();
        let today = time::Date::from_calendar_date(2026, time::Month::November, 29).unwrap();
        store.put("open/j-open", Bytes::new(), "application/octet-stream").await.unwrap();
        checkpoint(&store, "j-open", JobStatus::Running, 1).await;
        for (day, job, status) in [
            ("2026-11-29", "j-a", JobStatus::Complete),
            ("2026-11-29", "j-b", JobStatus::Partial),
            ("2026-11-27", "j-c", JobStatus::Abandoned),
            ("2026-11-20", "j-old", JobStatus::Complete),
        ] {
            store.put(&Table::Jobs.key(day, job), Bytes::from_static(b"PAR1"), "application/vnd.apache.parquet").await.unwrap();
            store.put(&Table::Accounts.key(day, job), Bytes::from_static(b"PAR1"), "application/vnd.apache.parquet").await.unwrap();
            checkpoint(&store, job, status, 4).await;
        }
        let sub = Submission::new(&["nov.csv".to_string(), "dec.csv".to_string()], "2026-11-29T08:15:00Z".into());
        store.put_if(&tariff_key("j-a"), Bytes::from_static(b"{}"), "application/json", &sub.to_meta(), &Cond::Absent).await.unwrap();
        let uuid_job = "019af4f2-6a00-7000-8000-000000000000";
        store.put("open/019af4f2-6a00-7000-8000-000000000000", Bytes::new(), "application/octet-stream").await.unwrap();
        checkpoint(&store, uuid_job, JobStatus::Running, 0).await;
        let l = list(store.as_ref(), today, 7, 10).await.unwrap();
        let by_id = |id: &str| l.open.iter().chain(&l.finished).find(|j| j.job_id == id).unwrap().clone();
        assert_eq!((by_id("j-a").submitted_at.as_deref(), by_id("j-a").files.clone()), (Some("2026-11-29T08:15:00Z"), vec!["nov.csv".to_string(), "dec.csv".to_string()]));
        assert_eq!(by_id(uuid_job).submitted_at.as_deref(), Some("2025-12-06T18:35:18Z"), "the time in its UUIDv7 id");
        assert_eq!((by_id("j-b").submitted_at.as_deref(), by_id("j-b").files.len()), (None, 0), "unknown: shown as -");
        let l = JobList { open: l.open.into_iter().filter(|j| j.job_id != uuid_job).collect(), ..l };
        assert_eq!(l.open.iter().map(|j| (j.job_id.as_str(), j.status, j.accounted_chunks)).collect::<Vec<_>>(), [("j-open", Some(JobStatus::Running), 1)]);
        let finished: Vec<(&str, Option<JobStatus>, Option<&str>)> = l.finished.iter().map(|j| (j.job_id.as_str(), j.status, j.billed_on.as_deref())).collect();
        assert_eq!(
            finished,
            [
                ("j-b", Some(JobStatus::Partial), Some("2026-11-29")),
                ("j-a", Some(JobStatus::Complete), Some("2026-11-29")),
                ("j-c", Some(JobStatus::Abandoned), Some("2026-11-27"))
            ],
            "a week back, newest first; a job ten days old is not listed"
        );
        assert_eq!(l.days.len(), 7);
        let text = l.to_string();
        assert!(text.contains("j-open") && text.contains("partial") && text.contains("1 open, 3 finished (2026-11-23 to 2026-11-29, UTC)"), "{text}");
        assert!(text.contains("2026-11-29 08:15:00") && text.contains("nov.csv, dec.csv"), "{text}");

        // The limit holds, and stops the days looked at once reached.
        let l = list(store.as_ref(), today, 7, 1).await.unwrap();
        assert_eq!((l.finished.len(), l.days.len()), (1, 1));
        assert_eq!(l.finished[0].job_id, "j-b");
    }
}
