//! Reading a job back: its status (from the controller's checkpoint), waiting for it to finish with a
//! progress bar, and its report from the warehouse.

use std::time::{Duration, Instant};

use fleet_domain::codec::from_zstd_json;
use fleet_domain::layout::{check_job_id, checkpoint_keys, manifest_key, report_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{Checkpoint, JobStatus, Manifest, Progress};
use fleet_domain::report::Report;
use fleet_io::blob::BlobStore;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::CliError;

/// A job's progress.
#[derive(Debug, Clone, Serialize)]
pub struct JobProgress {
    pub job_id: String,
    pub status: JobStatus,
    /// Unknown while the job is still being submitted.
    pub total_chunks: Option<u32>,
    pub accounted_chunks: u32,
    pub failed_chunks: u32,
    pub accepted: Option<u64>,
    pub processed: u64,
    pub rejected: Option<u64>,
}

/// A job id from the command line, checked before it becomes part of a key.
pub fn checked(job_id: &str) -> Result<(), CliError> {
    check_job_id(job_id).map_err(|fleet_domain::Error::Corrupt(msg)| CliError::Input(msg))
}

/// The progress in a job's checkpoint: from its metadata (a HEAD request), or from its body when it has
/// none (written by an older controller).
pub async fn checkpoint_progress(store: &dyn BlobStore, job_id: &str) -> Result<Option<Progress>, CliError> {
    // Where this release's controllers keep it, else where an earlier release did (a job begun
    // before the upgrade: moved at its next save, never if it had finished).
    let mut found = None;
    for key in checkpoint_keys(job_id) {
        if let Some(meta) = store.head(&key).await? {
            found = Some((key, meta));
            break;
        }
    }
    let Some((key, meta)) = found else { return Ok(None) };
    if let Some(p) = Progress::from_meta(&meta) {
        return Ok(Some(p));
    }
    Ok(match store.get(&key).await? {
        Some(b) => match from_zstd_json::<Checkpoint>(&b, 1 << 30) {
            Ok(cp) => Some(Progress::of(&cp)),
            // The controller quarantines such a job when it next hears of it (and puts a readable
            // checkpoint saying so in its place): until then its progress is unknown.
            Err(e) => {
                tracing::warn!(job = %job_id, error = %e, "the job's checkpoint cannot be read; the controller quarantines the job");
                None
            }
        },
        None => None,
    })
}

/// Reads the manifest and checkpoint progress of a job.
pub async fn progress(store: &dyn BlobStore, job_id: &str) -> Result<JobProgress, CliError> {
    checked(job_id)?;
    let manifest: Option<Manifest> = match store.get_capped(&manifest_key(job_id), MAX_MANIFEST_BYTES).await? {
        Some(b) => Some(serde_json::from_slice(&b).map_err(fleet_io::Error::from)?),
        None => None,
    };
    let cp = checkpoint_progress(store, job_id).await?;
    // A job being submitted has neither until its seal or its first checkpoint: its tariff, its
    // first object, says it was begun.
    if manifest.is_none() && cp.is_none() && store.head(&fleet_domain::layout::tariff_key(job_id)).await?.is_none() {
        return Err(CliError::Input(format!("no job {job_id} in bucket {}", store.bucket())));
    }
    Ok(JobProgress {
        job_id: job_id.to_string(),
        status: cp.map_or(JobStatus::Running, |c| c.status),
        total_chunks: manifest.as_ref().map(|m| m.total_chunks),
        accounted_chunks: cp.map_or(0, |c| c.accounted),
        failed_chunks: cp.map_or(0, |c| c.failed),
        accepted: manifest.as_ref().map(|m| m.accepted),
        processed: cp.map_or(0, |c| c.processed),
        rejected: manifest.as_ref().map(|m| m.rejected.len() as u64),
    })
}

impl std::fmt::Display for JobProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(total) = self.total_chunks else {
            return write!(
                f,
                "job {}: being submitted, {} chunks accounted for so far, {} transactions processed",
                self.job_id, self.accounted_chunks, self.processed
            );
        };
        let status = match self.status {
            JobStatus::Running => "running",
            JobStatus::Complete => "complete",
            JobStatus::Partial => "partial",
            JobStatus::Abandoned => "abandoned",
            JobStatus::Quarantined => "quarantined",
        };
        write!(
            f,
            "job {}: {status}, {}/{} chunks accounted for ({} failed), {}/{} accepted transactions processed, {} rows rejected",
            self.job_id,
            self.accounted_chunks,
            total,
            self.failed_chunks,
            self.processed,
            self.accepted.unwrap_or(0),
            self.rejected.unwrap_or(0)
        )
    }
}

/// Reads the report of a finished job.
pub async fn report(store: &dyn BlobStore, job_id: &str) -> Result<Report, CliError> {
    checked(job_id)?;
    match store.get(&report_key(job_id)).await? {
        Some(b) => Ok(serde_json::from_slice(&b).map_err(fleet_io::Error::from)?),
        None => {
            let p = progress(store, job_id).await?;
            Err(CliError::Input(format!("job {job_id} has no report yet: {p}")))
        }
    }
}

/// How often `wait` looks at a job, and when it says where the job is without a terminal: decided
/// here from what the last look saw, performed by [`wait`]. Fast at first (a small job reports within
/// a second or two), then backing off while nothing moves (a long job is not asked ten times a
/// second for hours), and quick again while chunks are being accounted for.
#[derive(Debug, Clone)]
pub struct WaitPace {
    pause: Duration,
    last_seen: Option<(u32, u32)>,
    next_line: Duration,
}

impl WaitPace {
    /// Looks every 100 ms this long after the start.
    pub const EAGER: Duration = Duration::from_secs(2);
    /// The pause after a look that saw chunks accounted for.
    pub const MOVING: Duration = Duration::from_secs(1);
    /// The longest pause, reached while nothing moves.
    pub const MAX: Duration = Duration::from_secs(5);
    /// A line on standard error this often when no progress bar is drawn.
    pub const LINE_EVERY: Duration = Duration::from_secs(60);

    pub fn new() -> WaitPace {
        WaitPace { pause: Duration::from_millis(100), last_seen: None, next_line: Self::LINE_EVERY }
    }

    /// The pause before the next look, given how long the wait has run and the (accounted, failed)
    /// chunks the last look saw.
    pub fn after_look(&mut self, elapsed: Duration, seen: Option<(u32, u32)>) -> Duration {
        let moved = seen.is_some() && seen != self.last_seen && self.last_seen.is_some();
        self.last_seen = seen.or(self.last_seen);
        self.pause = if elapsed < Self::EAGER {
            Duration::from_millis(100)
        } else if moved {
            Self::MOVING
        } else {
            (self.pause.max(Duration::from_millis(250)) * 2).min(Self::MAX)
        };
        self.pause
    }

    /// Whether a progress line is due (once per [`Self::LINE_EVERY`]).
    pub fn line_due(&mut self, elapsed: Duration) -> bool {
        if elapsed < self.next_line {
            return false;
        }
        while self.next_line <= elapsed {
            self.next_line += Self::LINE_EVERY;
        }
        true
    }
}

impl Default for WaitPace {
    fn default() -> Self {
        WaitPace::new()
    }
}

/// Polls the job's checkpoint until the controller has finished it, then returns the report, at the
/// pace [`WaitPace`] sets; without a progress bar (`show` false: no terminal), a line a minute on
/// standard error says where the job is.
pub async fn wait(store: &dyn BlobStore, job_id: &str, total_chunks: u32, timeout: Duration, show: bool) -> Result<Report, CliError> {
    let bar = ProgressBar::with_draw_target(Some(u64::from(total_chunks)), if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    bar.set_style(ProgressStyle::with_template("billing   [{bar:30}] {pos}/{len} chunks {msg} ({elapsed})").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let start = Instant::now();
    let mut pace = WaitPace::new();
    loop {
        // A HEAD request: the progress is in the checkpoint's metadata, not its (large) body.
        let cp = checkpoint_progress(store, job_id).await?;
        if let Some(cp) = &cp {
            bar.set_position(u64::from(cp.accounted));
            if cp.failed > 0 {
                bar.set_message(format!("{} failed", cp.failed));
            }
            if cp.status.is_finished() {
                bar.finish();
                return report(store, job_id).await;
            }
        }
        let elapsed = start.elapsed();
        if elapsed > timeout {
            bar.abandon();
            return Err(CliError::WaitTimedOut { job_id: job_id.to_string(), after: timeout });
        }
        if !show && pace.line_due(elapsed) {
            let (accounted, failed, processed) = cp.as_ref().map_or((0, 0, 0), |c| (c.accounted, c.failed, c.processed));
            eprintln!(
                "job {job_id}: {accounted}/{total_chunks} chunks accounted for ({failed} failed), {processed} transactions processed, waiting {}s",
                elapsed.as_secs()
            );
        }
        let pause = pace.after_look(elapsed, cp.as_ref().map(|c| (c.accounted, c.failed)));
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eager_at_first_then_backing_off_while_nothing_moves_and_quick_again_when_chunks_come() {
        let mut p = WaitPace::new();
        let s = Duration::from_secs;
        assert_eq!(p.after_look(Duration::ZERO, None), Duration::from_millis(100));
        assert_eq!(p.after_look(Duration::from_millis(1_900), Some((0, 0))), Duration::from_millis(100), "eager for the first two seconds");
        let pauses: Vec<Duration> = (0..6).map(|i| p.after_look(s(3 + i), Some((0, 0)))).collect();
        assert_eq!(pauses, [Duration::from_millis(500), s(1), s(2), s(4), s(5), s(5)], "doubling to five seconds while nothing moves");
        assert_eq!(p.after_look(s(20), Some((3, 0))), s(1), "a chunk accounted for: quick again");
        assert_eq!(p.after_look(s(21), Some((3, 1))), s(1), "a chunk failed moves it too");
        assert_eq!(p.after_look(s(22), Some((3, 1))), s(2));
        assert_eq!(p.after_look(s(24), None), s(4), "a look that saw nothing is not movement");
        // An hour's wait of a job that never moves: about 720 looks, not 7,200.
        let mut p = WaitPace::new();
        let (mut t, mut looks) = (Duration::ZERO, 0);
        while t < s(3_600) {
            t += p.after_look(t, Some((0, 0)));
            looks += 1;
        }
        assert!(looks < 750, "{looks} looks an hour");
    }

    #[test]
    fn a_line_a_minute() {
        let mut p = WaitPace::new();
        let s = Duration::from_secs;
        assert!(!p.line_due(s(59)));
        assert!(p.line_due(s(60)));
        assert!(!p.line_due(s(61)));
        assert!(p.line_due(s(185)), "late: one line, not three");
        assert!(!p.line_due(s(239)));
        assert!(p.line_due(s(240)));
    }
}
