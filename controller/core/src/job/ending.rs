//! How a job ends: its ending decided from its manifest (the chunks it ends with as failed, its
//! status, its note), and the manifest that stands in for one never written.

use fleet_domain::model::{Checkpoint, FailedChunk, JobStatus, Manifest};
use fleet_domain::requests::RequestCounts;

use super::{Job, Phase};
use crate::decision::Decision;

impl<H> Job<H> {
    /// Decides how it ends, from its manifest (a placeholder when the submission never finished): the
    /// chunks it ends with as failed (for an abandoned or stalled job also those its manifest names
    /// without a result; each counting the transactions its manifest gives it, not what a result
    /// declared), its status and its note. Nothing changes until a checkpoint commits the decision
    /// ([`Commit::Ending`](crate::decision::Commit::Ending)); an ending already committed is that decision again. `wall`: the time it
    /// is decided at (RFC 3339), committed with it.
    pub fn decide(&self, manifest: &Manifest, wall: &str) -> Decision {
        let (abandon, stall) = match &self.phase {
            Phase::Open { abandon, stall } => (abandon, stall),
            Phase::Ending(d) => return d.clone(),
            Phase::Finished(status) => {
                return Decision {
                    status: *status,
                    failed: self.tally.cp.failed_chunks.clone(),
                    note: self.tally.cp.note.clone(),
                    at: self.tally.cp.ending_time().to_string(),
                }
            }
        };
        let placeholder = manifest.created_at.is_empty();
        let mut failed = self.tally.cp.failed_chunks.clone();
        let note = match (abandon, stall) {
            (None, None) => None,
            (None, Some(reason)) => {
                let missing = fail_missing(&self.tally.cp, manifest, &mut failed, &format!("no result: {reason}"));
                let shown: Vec<String> = missing.iter().take(20).map(u32::to_string).collect();
                let more = if missing.len() > shown.len() { ", ..." } else { "" };
                Some(format!("finished without {} of its {} chunks ({}{more}): {reason}", missing.len(), manifest.total_chunks, shown.join(", ")))
            }
            (Some(reason), _) if placeholder => Some(format!(
                "abandoned: {reason}; the submission never finished (no manifest): submitted and accepted count only the transactions of chunks that reported; files, rejected rows and tariff are unknown"
            )),
            (Some(reason), _) => {
                fail_missing(&self.tally.cp, manifest, &mut failed, &format!("no result before the job was abandoned: {reason}"));
                Some(format!("abandoned: {reason}"))
            }
        };
        for f in &mut failed {
            if let Some(&n) = manifest.chunk_transactions.get(f.chunk as usize) {
                f.transactions = n;
            }
        }
        let mut note = note;
        let status = match (abandon, failed.is_empty()) {
            (Some(_), _) => JobStatus::Abandoned,
            (None, true) => JobStatus::Complete,
            (None, false) => JobStatus::Partial,
        };
        // Never `complete` unless every accepted transaction is accounted for, billed or failed: the
        // results disagree with the manifest (the report says so; the operator looks).
        let processed = self.tally.totals.transactions();
        let failed_n = failed.iter().fold(0u64, |n, f| n.saturating_add(f.transactions));
        let counted = processed.checked_add(failed_n);
        let status = if status == JobStatus::Complete && counted != Some(manifest.accepted) && !crate::undo::is(crate::undo::Fix::CompleteOnlyWhenCounted) {
            let why = format!(
                "not complete: {processed} transactions processed and {failed_n} failed, but the manifest accepted {}: the results disagree with the job's records",
                manifest.accepted
            );
            note = Some(match note {
                Some(n) => format!("{n}; {why}"),
                None => why,
            });
            JobStatus::Partial
        } else {
            status
        };
        Decision { status, failed, note, at: wall.to_string() }
    }
}

/// The manifest of a job whose submission never finished (none was written, or it cannot be read):
/// `known` transactions submitted and accepted, no files, no tariff. Its empty `created_at` marks it
/// (see [`Job::decide`]).
pub fn placeholder_manifest(job_id: &str, total_chunks: u32, known: u64) -> Manifest {
    Manifest {
        chunk_lines: Vec::new(),
        completes: None,
        partition: 0,
        v: fleet_domain::model::WIRE_VERSION,
        job_id: job_id.to_string(),
        created_at: String::new(),
        files: Vec::new(),
        submitted: known,
        accepted: known,
        rejected: Vec::new(),
        total_chunks,
        chunk_transactions: Vec::new(),
        tariff: fleet_domain::billing::Tariff::default(),
        requests: RequestCounts::default(),
    }
}

/// Lists every chunk the manifest names that the checkpoint has not accounted for as failed with
/// `reason`; returns those chunks.
fn fail_missing(cp: &Checkpoint, m: &Manifest, failed: &mut Vec<FailedChunk>, reason: &str) -> Vec<u32> {
    let missing: Vec<u32> = (0..m.total_chunks).filter(|c| !cp.accounted.contains(c)).collect();
    for &chunk in &missing {
        let transactions = m.chunk_transactions.get(chunk as usize).copied().unwrap_or(0);
        failed.push(FailedChunk { lines: Vec::new(), chunk, transactions, reason: reason.to_string() });
    }
    missing
}
