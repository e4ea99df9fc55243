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
    if manifest.is_none() && cp.is_none() {
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

/// Polls the job's checkpoint until the controller has finished it, then returns the report.
/// Polls every 100 ms for the first 10 s, then every 500 ms.
pub async fn wait(store: &dyn BlobStore, job_id: &str, total_chunks: u32, timeout: Duration, show: bool) -> Result<Report, CliError> {
    let bar = ProgressBar::with_draw_target(Some(u64::from(total_chunks)), if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    bar.set_style(ProgressStyle::with_template("billing   [{bar:30}] {pos}/{len} chunks {msg} ({elapsed})").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let start = Instant::now();
    loop {
        // A HEAD request: the progress is in the checkpoint's metadata, not its (large) body.
        if let Some(cp) = checkpoint_progress(store, job_id).await? {
            bar.set_position(u64::from(cp.accounted));
            if cp.failed > 0 {
                bar.set_message(format!("{} failed", cp.failed));
            }
            if cp.status.is_finished() {
                bar.finish();
                return report(store, job_id).await;
            }
        }
        if start.elapsed() > timeout {
            bar.abandon();
            return Err(CliError::WaitTimedOut { job_id: job_id.to_string(), after: timeout });
        }
        let pause = if start.elapsed() < Duration::from_secs(10) { 100 } else { 500 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}
