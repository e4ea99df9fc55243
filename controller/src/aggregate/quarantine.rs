//! Jobs whose own state cannot be read: a corrupt checkpoint or checkpoint part (found when the job is
//! loaded), an unreadable or oversized manifest (found when it is finished). Such a job can never be
//! finished right, and trying again would only cycle its messages through the results dead-letter
//! queue until retention drops them. It is quarantined instead: a report with status `quarantined`
//! and the reason in its note is written where the initiator waits for one (no accounts: nothing in
//! it is billable); its open marker is removed; an unreadable checkpoint is kept as it was at
//! `checkpoints/{job}/quarantined.json.zst` and replaced by an empty one that says `quarantined` (so followers,
//! `initiator abandon` and a restarted controller read the status instead of the corrupt document);
//! when the manifest is the problem, the checkpoint is kept with its rows and the new status; each message
//! that arrives for it later is kept in the quarantine of unreadable messages (`initiator dlq list`),
//! then deleted. Nothing is lost and nothing cycles; an operator who repairs the state can redrive.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use fleet_domain::billing::CheckedTotals;
use fleet_domain::codec::to_zstd_json;
use fleet_domain::layout::{checkpoint_key, manifest_key, open_key, quarantined_checkpoint_key, report_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{JobStatus, Manifest, Progress};
use fleet_domain::report;
use fleet_engine::Kept;
use fleet_io::blob::BlobStore;
use fleet_io::blob::Cond;
use fleet_io::error::{Error, Result};

use super::books::Books;
use super::hold::Holding;
use super::item::Source;
use super::job::{Job, Phase};
use super::known::Known;
use super::take::{read_checkpoint, At};
use crate::lease::Lease;
use controller_core::decision::Commit;
use controller_core::job::{fresh_checkpoint, placeholder_manifest};

/// The quarantine of unreadable messages (`initiator dlq list`): where a message that can never
/// count is kept with the reason before it is deleted.
pub(super) struct Unreadable {
    pub(super) store: Arc<dyn BlobStore>,
    /// Each source's queue name (recorded with what is kept from it).
    pub(super) queues: HashMap<Source, String>,
}

impl Unreadable {
    /// Keeps a message with the reason; returns it for deletion once kept (held in `holding` when
    /// the store does not answer, else left to come back).
    pub(super) async fn keep(&self, source: Source, m: Kept, reason: &str, holding: &Holding) -> Option<Kept> {
        // The queue it came from (a partition's, so that a redrive sends it back to its job's owner).
        let queue = if m.queue().is_empty() { self.queues.get(&source).map_or("unknown", String::as_str) } else { m.queue() };
        match fleet_io::quarantine::put(self.store.as_ref(), queue, &m, reason).await {
            Ok(key) => {
                crate::events::MessageQuarantined { queue, message_id: &m.id, key: &key, reason }.emit();
                // The batch's span (`apply_results`) shows it: a message not applied.
                fleet_io::telemetry::fail(&tracing::Span::current(), format_args!("message {} of {queue} quarantined: {reason}", m.id));
                Some(m)
            }
            Err(qe) if qe.is_retryable() => {
                holding.hold(vec![(source, m)], &qe);
                None
            }
            Err(qe) => {
                tracing::warn!(queue, message_id = %m.id, error = %qe, "could not quarantine a message; it will be redelivered");
                None
            }
        }
    }

    /// Completes the messages of a finished job: deleted; a quarantined job's (as `known` says) are
    /// first kept here (held in `holding` when the store does not answer).
    pub(super) async fn complete_late(&self, known: &Known, holding: &Holding, job_id: &str, kept: Vec<(Source, Kept)>) -> Vec<Kept> {
        if known.status(job_id) != Some(JobStatus::Quarantined) {
            return kept.into_iter().map(|(_, k)| k).collect();
        }
        let reason = format!("job {job_id} is quarantined: its state cannot be read");
        let mut delete = Vec::with_capacity(kept.len());
        for (source, k) in kept {
            delete.extend(self.keep(source, k, &reason, holding).await);
        }
        delete
    }
}

impl Books {
    /// Quarantines a job whose checkpoint (the document with ETag `etag`) cannot be read, its lease
    /// held and given back here. The quarantined checkpoint replaces exactly the document that failed
    /// (If-Match its ETag) before anything else is said of the job: when another controller wrote the
    /// checkpoint since (it was not corrupt, only moving), nothing is written and the job is loaded
    /// again later. The report is written only where there is none: a report another controller
    /// wrote is never replaced.
    pub(super) async fn quarantine_unreadable(&self, job_id: &str, lease: &Lease, why: &Error, etag: &str) -> Result<()> {
        let manifest = match self.store.get_capped(&manifest_key(job_id), MAX_MANIFEST_BYTES).await {
            Ok(found) => found.and_then(|b| serde_json::from_slice::<Manifest>(&b).ok()),
            Err(e) if e.is_retryable() => return Err(e),
            Err(_) => None,
        };
        let kept_at = quarantined_checkpoint_key(job_id);
        let changed = || Error::Conflict(format!("the checkpoint of job {job_id} changed while it was being quarantined: it is loaded again"));
        let at = match read_checkpoint(self.store.as_ref(), job_id).await? {
            Some((data, now, at)) if now == etag || crate::undo::is(crate::undo::Fix::QuarantineSecondRead) => {
                self.store.put(&kept_at, data, "application/zstd").await?;
                at
            }
            _ => {
                let _ = self.leases.release(job_id, lease).await;
                return Err(changed());
            }
        };
        let mut cp = fresh_checkpoint(job_id, self.clock.rfc3339());
        cp.status = JobStatus::Quarantined;
        let meta = Progress::of(&cp).to_meta();
        let body = Bytes::from(to_zstd_json(&cp).map_err(Error::corrupt)?);
        // Where this release keeps it: in place of the one that failed, or, when that one is where an
        // earlier release kept it, where none is yet (the earlier one is read only when none is).
        let cond = if at == At::Current { Cond::Matches(etag.to_string()) } else { Cond::Absent };
        if fleet_io::blob::put_if_owned(self.store.as_ref(), &checkpoint_key(job_id), body, "application/zstd", &meta, &cond).await?.is_none() {
            let _ = self.leases.release(job_id, lease).await;
            return Err(changed());
        }
        tracing::error!(job = %job_id, error = %why, "the job's own state cannot be read: job quarantined");
        let note =
            format!("quarantined: the job's checkpoint cannot be read ({why}); it is kept as it was at {kept_at}, and the job's messages in the quarantine");
        self.write_quarantine_report(job_id, manifest, None, note, Cond::Absent).await?;
        self.close_quarantined(job_id, lease).await;
        Ok(())
    }

    /// Quarantines a job in memory that cannot be finished because its manifest cannot be read; its
    /// checkpoint keeps its rows. Returns its messages for deletion (the checkpoint covers them).
    pub(super) async fn quarantine_finishing(&self, job_id: &str, job: &mut Job, why: &Error) -> Result<Vec<Kept>> {
        tracing::error!(job = %job_id, error = %why, "the job's manifest cannot be read: job quarantined");
        // Committed once (a report write that failed leaves the job quarantined in memory).
        if job.phase() != &Phase::Finished(JobStatus::Quarantined) {
            self.commit(job, Commit::Quarantined, &Default::default()).await?;
        }
        let note = format!(
            "quarantined: the job's manifest cannot be read ({why}); its checkpoint keeps the {} chunks accounted for and their rows",
            job.tally().accounted()
        );
        self.write_quarantine_report(job_id, None, Some(job), note, Cond::Any).await?;
        self.close_quarantined(job_id, job.lease()).await;
        Ok(job.covered())
    }

    /// Writes a quarantined report if `cond` holds (`Absent`: never over another controller's report).
    async fn write_quarantine_report(&self, job_id: &str, manifest: Option<Manifest>, job: Option<&Job>, note: String, cond: Cond) -> Result<()> {
        let failed = job.map(|j| j.failed().to_vec()).unwrap_or_default();
        let manifest = manifest.unwrap_or_else(|| placeholder_manifest(job_id, job.map_or(0, |j| j.tally().accounted() as u32), 0));
        let totals = CheckedTotals::new();
        let requests = job.map(|j| j.tally().requests().clone()).unwrap_or_default();
        let mut r = report::build_borrowed(&manifest, &totals, failed, &requests);
        r.requests.set_cost(&self.prices, &requests, manifest.submitted);
        r.status = JobStatus::Quarantined;
        r.note = Some(note);
        r.finished_at = self.clock.rfc3339();
        // Its row in the warehouse's jobs table (none in the accounts table: it bills nothing), so
        // that `initiator jobs` and the analysts see it; only if absent, as every table object, and
        // only for a job without a report (one finished before its state turned unreadable keeps
        // its report and its rows).
        if self.store.head(&report_key(job_id)).await?.is_none() {
            match fleet_warehouse::billed_on(&r).and_then(|day| Ok((fleet_warehouse::Table::Jobs.key(&day, job_id), fleet_warehouse::Table::Jobs.encode(&r)?))) {
                Ok((key, body)) => {
                    self.store.put_if(&key, Bytes::from(body), fleet_warehouse::MEDIA_TYPE, &BTreeMap::new(), &Cond::Absent).await?;
                }
                Err(e) => tracing::error!(job = %job_id, error = %e, "the quarantined job's warehouse row cannot be encoded; its report is written without it"),
            }
        }
        let body = Bytes::from(report::to_json(&r)?);
        if fleet_io::blob::put_if_owned(self.store.as_ref(), &report_key(job_id), body, "application/json", &BTreeMap::new(), &cond).await?.is_none() {
            tracing::warn!(job = %job_id, "the job already has a report; it is kept");
        }
        Ok(())
    }

    async fn close_quarantined(&self, job_id: &str, lease: &Lease) {
        if let Err(e) = self.store.delete(&open_key(job_id)).await {
            tracing::warn!(job = %job_id, error = %e, "could not remove the open-job marker of a quarantined job");
        }
        let _ = self.leases.release(job_id, lease).await;
        self.remember_finished(job_id, JobStatus::Quarantined);
    }
}
