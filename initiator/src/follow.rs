//! Reading a job back: its status (from the controller's checkpoint), waiting for it to finish with a
//! progress bar, and its report from the warehouse.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use shared::blob::BlobStore;
use shared::codec::from_zstd_json;
use shared::layout::{check_job_id, checkpoint_key, manifest_key, report_key};
use shared::model::{Checkpoint, JobStatus, Manifest};
use shared::report::Report;

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
fn checked(job_id: &str) -> Result<(), CliError> {
    check_job_id(job_id).map_err(|e| match e {
        shared::Error::Corrupt(msg) => CliError::Input(msg),
        other => CliError::Input(other.to_string()),
    })
}

/// Reads the manifest and checkpoint of a job.
pub async fn progress(store: &dyn BlobStore, job_id: &str) -> Result<JobProgress, CliError> {
    checked(job_id)?;
    let manifest: Option<Manifest> = match store.get(&manifest_key(job_id)).await? {
        Some(b) => Some(serde_json::from_slice(&b).map_err(shared::Error::from)?),
        None => None,
    };
    let cp: Option<Checkpoint> = match store.get(&checkpoint_key(job_id)).await? {
        Some(b) => Some(from_zstd_json(&b, 1 << 30)?),
        None => None,
    };
    if manifest.is_none() && cp.is_none() {
        return Err(CliError::Input(format!("no job {job_id} in bucket {}", store.bucket())));
    }
    Ok(JobProgress {
        job_id: job_id.to_string(),
        status: cp.as_ref().map_or(JobStatus::Running, |c| c.status),
        total_chunks: manifest.as_ref().map(|m| m.total_chunks),
        accounted_chunks: cp.as_ref().map_or(0, |c| c.accounted.len() as u32),
        failed_chunks: cp.as_ref().map_or(0, |c| c.failed_chunks.len() as u32),
        accepted: manifest.as_ref().map(|m| m.accepted),
        processed: cp.as_ref().map_or(0, |c| c.processed_transactions),
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
        Some(b) => Ok(serde_json::from_slice(&b).map_err(shared::Error::from)?),
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
    /// The checkpoint's progress fields; the per-account totals in it are skipped, not built.
    #[derive(serde::Deserialize)]
    struct Progress {
        status: JobStatus,
        accounted: Vec<u32>,
        failed_chunks: Vec<serde::de::IgnoredAny>,
    }
    let start = Instant::now();
    loop {
        if let Some(b) = store.get(&checkpoint_key(job_id)).await? {
            let cp: Progress = from_zstd_json(&b, 1 << 30)?;
            bar.set_position(cp.accounted.len() as u64);
            if !cp.failed_chunks.is_empty() {
                bar.set_message(format!("{} failed", cp.failed_chunks.len()));
            }
            if cp.status.is_finished() {
                bar.finish();
                return report(store, job_id).await;
            }
        }
        if start.elapsed() > timeout {
            bar.abandon();
            return Err(CliError::Infra(shared::Error::Service {
                service: shared::error::Service::S3,
                operation: "wait",
                detail: format!("job {job_id} not finished after {} s; is the controller running? (`initiator status {job_id}`)", timeout.as_secs()),
                retryable: true,
            }));
        }
        let pause = if start.elapsed() < Duration::from_secs(10) { 100 } else { 500 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}
