//! A job's books in the store: its lease, its checkpoint read and written, its report, its
//! quarantine, its open marker closed, and what this controller remembers of how it ended. Each
//! method acts on one job, under that job's lock (its slot's) where the job is in memory; the
//! aggregator decides when (a batch, a timer, a scan) and keeps the jobs in memory.
//!
//! Rooms: `take` (a lease taken and a job loaded), `checkpoint` (a checkpoint written), `finalize` (a
//! job finished), `quarantine` (a job whose own state cannot be read); this file holds the type and
//! what closes a finished job.

use std::sync::Arc;

use fleet_domain::layout::{manifest_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{JobStatus, Manifest};
use fleet_domain::prices::Prices;
use fleet_io::blob::BlobStore;
use fleet_io::error::Result;

use super::known::{Expiry, Known};
use super::memory::Memory;
use super::purging::Purging;
use super::records::Records;
use super::CheckpointStats;
use crate::clock::Clock;
use crate::lease::Leases;

/// The jobs' books in the store, and what is remembered of them here.
pub(super) struct Books {
    pub(super) store: Arc<dyn BlobStore>,
    pub(super) leases: Leases,
    /// Wall time: leases, checkpoint times, reports.
    pub(super) clock: Clock,
    /// The price table reports' request costs are computed with.
    pub(super) prices: Prices,
    /// What checkpoints have written.
    pub(super) stats: CheckpointStats,
    /// What this controller knows of jobs not in memory (finished lately, dormant).
    pub(super) known: Known,
    /// What the jobs' own records say (see `records`).
    pub(super) records: Records,
    /// Where the purge of each finished job's blobs is recorded (see `close_finished`).
    pub(super) purging: Purging,
    /// The expiry's clock (a loaded job's news is dated on it).
    pub(super) expiry: Arc<Expiry>,
    /// The jobs in memory (the aggregator's): a job taken holds its lease there, a loaded job counts
    /// its unsaved messages there, and a checkpoint records the partition its messages travel on.
    pub(super) memory: Arc<Memory>,
    /// Jobs whose claims failed for a lasting reason, waiting to be tried again (see `claims`).
    pub(super) claims_backoff: super::claims::ClaimsBackoff,
    /// Claim rows of open jobs' counted chunks, read ahead of their claims (see `claims`).
    pub(super) read_ahead: Arc<super::claims::ReadAhead>,
}

impl Books {
    /// Writes a job's `open/{job}` marker, before its first checkpoint or its report: until its purge
    /// is recorded, the marker is what brings the job back to a scan should this controller die.
    pub(super) async fn mark_open(&self, job_id: &str) -> Result<()> {
        self.store.put(&fleet_domain::layout::open_key(job_id), bytes::Bytes::new(), "application/octet-stream").await
    }

    /// Closes a finished job (its report written): its purge is recorded, then its open marker goes.
    /// The open marker is the purge's one trace should this controller die before the purger wrote
    /// its marker, so it stays when the purge is not recorded (a purger that failed, timed out or
    /// stopped): a later scan comes back here.
    pub(super) async fn close_finished(&self, job_id: &str) -> Result<()> {
        if !self.purging.recorded(job_id).await {
            return Ok(());
        }
        self.store.delete(&fleet_domain::layout::open_key(job_id)).await
    }

    /// Job `job_id` finished with `status`: remembered (its late messages dropped without a read),
    /// its records forgotten.
    pub(super) fn remember_finished(&self, job_id: &str, status: JobStatus) {
        self.records.forget(job_id);
        self.memory.carried().take(job_id, None);
        self.known.finished(job_id, status);
    }

    /// The results partition the job's manifest records (0 from an initiator before partitions,
    /// whose results go to the first partition's queue); `None` when there is no manifest to read.
    pub(super) async fn manifest_partition(&self, job_id: &str) -> Result<Option<u16>> {
        let found = self.store.get_capped(&manifest_key(job_id), MAX_MANIFEST_BYTES).await?;
        Ok(found.and_then(|b| serde_json::from_slice::<Manifest>(&b).ok()).filter(|m| m.job_id == job_id).map(|m| m.partition))
    }
}
