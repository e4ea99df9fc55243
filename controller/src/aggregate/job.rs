//! Long because the job is one state machine and its transitions belong together (with their unit
//! tests at the end): a newcomer reads `Phase`, then `impl Job`.
//!
//! A job in memory as a state machine, sans-I/O: its fields are its own, its transitions are methods
//! that take what happened (an item applied, a manifest read, a checkpoint written) and return what to
//! do (finish it, save it, the document to write, the messages to complete); the aggregator does the
//! I/O and reports back. Nothing is set before a write and rolled back after it fails: a checkpoint
//! is planned from the job as it is ([`Job::plan`]), and only a written one changes it
//! ([`Job::saved`]), its phase included.
//!
//! `Unsaved` holds the deliveries applied but not yet covered by a checkpoint.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet_domain::billing::CheckedTotals;
use fleet_domain::model::{Checkpoint, ChunkOutcome, ChunkResult, FailedChunk, JobStatus, Manifest, ResultMessage};
use fleet_domain::requests::RequestCounts;
use fleet_engine::{Kept, Visibility};
use fleet_io::error::Result;
use tokio::time::Instant;

use super::decision::{Commit, Decision};
use super::item::Source;
use super::item::{Item, Ready};
use super::limits::{DEAD_LETTER_REASON, FLUSH_INTERVAL, FLUSH_MESSAGES};
use super::save::{self, Rows, Save};
use crate::clock::Clock;
use crate::lease::Lease;

/// Where a job is in its life.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Phase {
    /// Taking results. An ending asked for (an `Abandon` message, the expiry's stall rule) is kept
    /// here until it is decided; an abandon outranks a stall.
    Open { abandon: Option<String>, stall: Option<String> },
    /// Its ending decided and committed in its checkpoint (rows kept): it takes nothing more, only
    /// its report is left to write, always of this decision (whichever controller writes it).
    Ending(Decision),
    /// Its report written and its checkpoint without rows (or quarantined): it leaves memory.
    Finished(JobStatus),
}

/// What a job asks for after a batch or a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// Finish it now (its ending is committed or asked for, or every chunk is in).
    Finish,
    /// Write its checkpoint (the messages it covers are then deleted).
    Save,
    /// Nothing yet.
    Wait,
}

/// Who asks: the job's own batch (saving once enough is unsaved or it has waited long enough) or the
/// timer (saving whatever is unsaved).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asker {
    Batch,
    Timer,
}

pub(super) struct Job {
    /// What it has counted, in its checkpoint's form (without rows: those are `totals`). While the job
    /// is open its `status`, `note` and `finishing` are not read: the phase says them.
    cp: Checkpoint,
    phase: Phase,
    totals: CheckedTotals,
    /// Applied in memory, not yet covered by a checkpoint: completed after the next one.
    unsaved: Unsaved,
    /// When it was last checkpointed (or loaded).
    saved: Instant,
    /// Its last news: the last message that changed it (a first result or failure of a chunk, its
    /// seal, an abandon; never a duplicate), or when it was resumed less its checkpoint's age.
    news: Instant,
    /// It has had news since its last checkpoint: the next one carries a new `updated_at` (a
    /// checkpoint that only covers duplicates keeps the time, so a reader that dates the job's news
    /// by when it saw that time change is not misled either).
    changed: bool,
    /// Its `open/{job}` marker is known to exist.
    marked_open: bool,
    /// This controller's lease on the job.
    lease: Lease,
    /// ETag of the checkpoint as last read or written (`None`: there is none yet where this release
    /// writes it, a new job's or one read where an earlier release kept it): checkpoints are written
    /// only if it still matches (fencing), or only where none is.
    etag: Option<String>,
    /// The digests of its checkpoint writes since the last confirmed one whose outcome is unknown (no
    /// answer, or an answer lost and not read back): one may have landed, and a later write fenced
    /// by `etag` then finds it in place (see `fleet_io::blob::put_if_owned_after`).
    unconfirmed: Vec<[u8; 32]>,
    /// The aggregator's clock (a checkpoint's `updated_at`).
    clock: Clock,
}

/// How many checkpoint writes of unknown outcome a job remembers (each failed one may have landed,
/// and at most one did: they are all fenced on the job's last confirmed ETag, so it may be the
/// first). Digests, 32 bytes each: enough for minutes of failed tries at a finish's pace. (It was
/// the last 4 bodies until seed 168173223: a finish whose first ending write landed unanswered,
/// then four more tries without an answer, took its own first write for another controller's.)
const MAX_UNCONFIRMED: usize = 1024;

impl Job {
    /// A job nothing is known of yet (no checkpoint).
    pub(super) fn new(job_id: &str, lease: Lease, clock: Clock, unsaved: Unsaved) -> Job {
        let now = Instant::now();
        Job {
            cp: fresh_checkpoint(job_id, &clock),
            phase: Phase::Open { abandon: None, stall: None },
            totals: CheckedTotals::new(),
            unsaved,
            saved: now,
            news: now,
            changed: true,
            marked_open: false,
            lease,
            etag: None,
            unconfirmed: Vec::new(),
            clock,
        }
    }

    /// A job resumed from its checkpoint (`etag`), its rows restored into `totals`: open, or ending
    /// with the decision the checkpoint committed. Its last news is `news` (when the caller first saw
    /// the checkpoint's time).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn resume(mut cp: Checkpoint, totals: CheckedTotals, etag: Option<String>, lease: Lease, news: Instant, clock: Clock, unsaved: Unsaved) -> Job {
        let phase = if cp.finishing {
            let at = cp.ending_time().to_string();
            Phase::Ending(Decision { status: cp.status, failed: std::mem::take(&mut cp.failed_chunks), note: cp.note.take(), at })
        } else {
            Phase::Open { abandon: None, stall: None }
        };
        cp.accounts = Vec::new();
        Job { cp, phase, totals, unsaved, saved: Instant::now(), news, changed: false, marked_open: true, lease, etag, unconfirmed: Vec::new(), clock }
    }

    pub(super) fn id(&self) -> &str {
        &self.cp.job_id
    }

    /// The results partition its messages travel on, as its checkpoint recorded it.
    pub(super) fn partition(&self) -> Option<u16> {
        self.cp.partition
    }

    /// Its messages came from results partition `p`: recorded with its next checkpoint (the first
    /// partition seen stays: a job keeps its partition).
    pub(super) fn travels_on(&mut self, p: u16) {
        self.cp.partition.get_or_insert(p);
    }

    pub(super) fn phase(&self) -> &Phase {
        &self.phase
    }

    /// It still takes results (its ending is not committed).
    pub(super) fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open { .. })
    }

    pub(super) fn lease(&self) -> &Lease {
        &self.lease
    }

    pub(super) fn total_chunks(&self) -> Option<u32> {
        self.cp.total_chunks
    }

    /// Chunks accounted for (processed or failed).
    pub(super) fn accounted(&self) -> usize {
        self.cp.accounted.len()
    }

    /// The chunks failed so far (or those its committed ending has).
    pub(super) fn failed(&self) -> &[FailedChunk] {
        match &self.phase {
            Phase::Ending(d) => &d.failed,
            _ => &self.cp.failed_chunks,
        }
    }

    /// Checkpoint parts its last checkpoint names (a large job's rows).
    pub(super) fn parts(&self) -> usize {
        self.cp.parts.len()
    }

    #[cfg(test)]
    fn processed(&self) -> u64 {
        self.cp.processed_transactions
    }

    pub(super) fn totals(&self) -> &CheckedTotals {
        &self.totals
    }

    /// The calls counted for it so far (by processors and the controller).
    pub(super) fn requests(&self) -> &RequestCounts {
        &self.cp.requests
    }

    /// Counts calls made for it.
    pub(super) fn count(&mut self, calls: &RequestCounts) {
        self.cp.requests.merge(calls);
    }

    /// Messages applied and not yet covered by a checkpoint.
    pub(super) fn unsaved(&self) -> &Unsaved {
        &self.unsaved
    }

    /// Whether its open marker must be written before its checkpoint.
    pub(super) fn needs_marker(&self) -> bool {
        !self.marked_open
    }

    /// Its open marker was written.
    pub(super) fn marked(&mut self) {
        self.marked_open = true;
    }

    /// Sealed, with every chunk accounted for (processed or failed).
    pub(super) fn all_in(&self) -> bool {
        self.cp.total_chunks == Some(self.cp.accounted.len() as u32)
    }

    /// When it last had news.
    pub(super) fn news(&self) -> Instant {
        self.news
    }

    /// Its last news is now `at` (a batch applied; the expiry's scan when a fix is undone).
    pub(super) fn heard(&mut self, at: Instant) {
        self.news = at;
    }

    /// How long the job has had no news at `now` (never counted from before `floor`).
    pub(super) fn quiet_for(&self, now: Instant, floor: Instant) -> Duration {
        now.saturating_duration_since(self.news.max(floor))
    }

    /// Whether it is to be finished now from memory: its ending is committed or asked for, or every
    /// chunk is in and none failed, or some failed and nothing came for `settle` (no real result is
    /// coming any more).
    pub(super) fn due_to_finish(&self, now: Instant, floor: Instant, settle: Duration) -> bool {
        match &self.phase {
            Phase::Ending(_) => true,
            Phase::Open { abandon: Some(_), .. } | Phase::Open { stall: Some(_), .. } => true,
            Phase::Open { .. } => self.all_in() && (self.cp.failed_chunks.is_empty() || self.quiet_for(now, floor) >= settle),
            // Still in memory: what finishing it left undone (a quarantined job's report) is done again.
            Phase::Finished(_) => true,
        }
    }

    /// What it asks for at `now`: to be finished, saved, or nothing yet.
    pub(super) fn next(&self, now: Instant, floor: Instant, settle: Duration, asker: Asker) -> Next {
        if self.due_to_finish(now, floor, settle) {
            return Next::Finish;
        }
        let save = match asker {
            Asker::Timer => self.unsaved.len() > 0,
            // Under a steady stream the job is rarely idle when the timer looks: its own batches save it.
            Asker::Batch => self.unsaved.len() >= FLUSH_MESSAGES || now.saturating_duration_since(self.saved) >= FLUSH_INTERVAL,
        };
        if save {
            Next::Save
        } else {
            Next::Wait
        }
    }

    /// Asks it to end as abandoned for `reason` (an abandon asked before keeps its reason).
    pub(super) fn abandon(&mut self, reason: String) {
        if let Phase::Open { abandon, .. } = &mut self.phase {
            abandon.get_or_insert(reason);
        }
    }

    /// Asks it to end as stalled for `reason`: its missing chunks fail (the first reason is kept).
    pub(super) fn stall(&mut self, reason: String) {
        if let Phase::Open { stall, .. } = &mut self.phase {
            stall.get_or_insert(reason);
        }
    }

    /// Whether it may end without a manifest (the submission never finished): only abandoned, asked
    /// now or committed so before.
    pub(super) fn may_end_without_manifest(&self) -> bool {
        matches!(&self.phase, Phase::Open { abandon: Some(_), .. } | Phase::Ending(_))
    }

    /// The transactions it knows of without a manifest: processed, and those of its failed chunks.
    pub(super) fn known_transactions(&self) -> u64 {
        self.cp.processed_transactions.saturating_add(self.failed().iter().fold(0u64, |n, f| n.saturating_add(f.transactions)))
    }

    /// Hands it over to the controller that owns it now (fenced, or its lease lost): what it had applied
    /// since its last checkpoint, to go back to the queue for the owner.
    pub(super) fn hand_over(mut self) -> Vec<Kept> {
        self.unsaved.take()
    }

    /// Drops it after a failure: the messages it had applied since its last checkpoint, with the
    /// queue each came from (held, to be applied again to the job reloaded from that checkpoint, or
    /// left to come back after their visibility timeout).
    pub(super) fn drop_unsaved(mut self) -> Vec<(Source, Kept)> {
        self.unsaved.take_all()
    }

    /// The messages its last checkpoint covers (all it had unsaved: its lock was held across the
    /// write): to delete.
    pub(super) fn covered(&mut self) -> Vec<Kept> {
        self.unsaved.take()
    }

    /// Its messages once it is finished (its last checkpoint covers them): to delete.
    pub(super) fn done(mut self) -> Vec<Kept> {
        debug_assert!(matches!(self.phase, Phase::Finished(_)), "only a finished job's messages are done");
        self.unsaved.take()
    }

    /// Applies a batch's items to it, a seal first (its size, checked against the manifest, is a fact
    /// whatever the order): each delivery is taken in as unsaved. A job whose ending is committed takes
    /// nothing more (what arrives then is a late duplicate or comes too late): its deliveries are only
    /// kept for the finish. On an error (a payload S3 could not give) the items not applied and their
    /// deliveries are returned with it, the job keeping what it applied.
    pub(super) fn apply_batch(
        &mut self,
        items: Vec<(Ready, (Source, Kept))>,
        now: Instant,
        ctl: &mut RequestCounts,
    ) -> std::result::Result<(), (fleet_io::error::Error, Vec<(Source, Kept)>)> {
        let mut pairs = items;
        pairs.sort_by_key(|(r, _)| !r.is_seal());
        let mut applied = Vec::with_capacity(pairs.len());
        let mut pairs = pairs.into_iter();
        let mut failed = None;
        let mut news = false;
        while let Some((item, k)) = pairs.next() {
            if self.is_open() {
                match self.apply(item, ctl) {
                    Ok(changed) => news |= changed,
                    Err(e) => {
                        applied.push(k);
                        applied.extend(pairs.by_ref().map(|(_, k)| k));
                        failed = Some(e);
                        break;
                    }
                }
            }
            applied.push(k);
        }
        if crate::undo::is(crate::undo::Fix::DuplicatesNotNews) {
            news = !applied.is_empty();
        }
        if news {
            self.news = now;
            self.changed = true;
        }
        if let Some(e) = failed {
            return Err((e, applied));
        }
        self.unsaved.extend(applied);
        Ok(())
    }

    /// Applies one item (the transition every message makes); returns whether it changed the job
    /// (its news): a duplicate, a conflicting seal, a chunk beyond its size does not.
    fn apply(&mut self, ready: Ready, ctl: &mut RequestCounts) -> Result<bool> {
        ctl.add("s3.GetObject", ready.gets);
        let Ready { item, accounts, .. } = ready;
        let cp = &mut self.cp;
        let (chunk, transactions) = match &item {
            Item::Result(ResultMessage::Sealed { total_chunks, .. }) => {
                let total = *total_chunks;
                return Ok(match cp.total_chunks {
                    Some(t) if t != total => {
                        tracing::error!(job = %cp.job_id, total, sealed_before = t, "conflicting seal ignored");
                        false
                    }
                    Some(_) => false,
                    None => {
                        if let Some(c) = cp.accounted.iter().find(|&&c| c >= total) {
                            tracing::error!(job = %cp.job_id, chunk = c, total, "a counted chunk lies beyond the sealed size");
                        }
                        cp.total_chunks = Some(total);
                        true
                    }
                });
            }
            Item::Result(ResultMessage::Abandon { reason, .. }) => {
                tracing::warn!(job = %cp.job_id, %reason, accounted = cp.accounted.len(), "job abandoned on request");
                return Ok(match &mut self.phase {
                    Phase::Open { abandon: abandon @ None, .. } => {
                        *abandon = Some(reason.clone());
                        true
                    }
                    _ => false,
                });
            }
            Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions),
            Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => (item.chunk, item.transactions),
        };
        if cp.total_chunks.is_some_and(|t| chunk >= t) {
            // Not from this job as we know it: drop it loudly rather than corrupt the totals.
            tracing::error!(job = %cp.job_id, chunk, total = ?cp.total_chunks, "chunk beyond the job's size; ignored");
            return Ok(false);
        }
        if cp.accounted.contains(&chunk) {
            let real = matches!(&item, Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Processed { .. }, .. })));
            match cp.failed_chunks.iter().position(|f| f.chunk == chunk) {
                // A real result beats a dead letter or a failure report (a work item dead-lettered after
                // it was billed, a processor that died between sending a result and deleting its item):
                // the chunk is counted from it instead, as the job is not finished yet.
                Some(i) if real => {
                    let failed = cp.failed_chunks.remove(i);
                    cp.accounted.remove(&chunk);
                    tracing::warn!(job = %cp.job_id, chunk, was = %failed.reason, "a chunk recorded as failed has its real result: counted from it");
                }
                failed => {
                    // The processor's own failure report says more than the dead letter: keep its reason.
                    if let (Some(i), Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Failed { reason }, .. }))) = (failed, &item) {
                        if cp.failed_chunks[i].reason == DEAD_LETTER_REASON {
                            cp.failed_chunks[i].reason = reason.clone();
                        }
                    }
                    tracing::debug!(job = %cp.job_id, chunk, "duplicate; already counted");
                    return Ok(false);
                }
            }
        }
        match item {
            Item::Result(ResultMessage::Chunk(c)) => {
                match c.outcome {
                    ChunkOutcome::Processed { .. } => match accounts.expect("prepared with its payload") {
                        Ok(accounts) => match accounts.transactions() {
                            Some(counted) if counted == c.transactions => match self.totals.try_add_all(accounts.iter()) {
                                Ok(()) => cp.processed_transactions = cp.processed_transactions.saturating_add(counted),
                                Err(e) => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: format!("result not added: {e}") }),
                            },
                            counted => cp.failed_chunks.push(FailedChunk {
                                chunk,
                                transactions,
                                reason: match counted {
                                    Some(n) => format!("result counts {n} transactions, the chunk has {}", c.transactions),
                                    None => "result counts more transactions than a count can hold".to_string(),
                                },
                            }),
                        },
                        // S3 unreachable: leave the message; it comes back.
                        Err(e) if e.is_retryable() => return Err(e),
                        // Missing or corrupt payload: it never becomes readable; the chunk failed.
                        Err(e) => {
                            tracing::error!(job = %cp.job_id, chunk, error = %e, "result payload unreadable; chunk recorded as failed");
                            cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: format!("result unreadable: {e}") })
                        }
                    },
                    ChunkOutcome::Failed { reason } => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason }),
                }
                cp.requests.merge(&c.requests);
            }
            Item::Dead { receives, reason, .. } | Item::Result(ResultMessage::DeadLettered { receives, reason, .. }) => {
                tracing::warn!(job = %cp.job_id, chunk, receives, ?reason, "work item dead-lettered; chunk recorded as failed");
                cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: reason.unwrap_or_else(|| DEAD_LETTER_REASON.to_string()) });
            }
            Item::Result(ResultMessage::Sealed { .. } | ResultMessage::Abandon { .. }) => {}
        }
        cp.accounted.insert(chunk);
        Ok(true)
    }

    /// Decides how it ends, from its manifest (a placeholder when the submission never finished): the
    /// chunks it ends with as failed (for an abandoned or stalled job also those its manifest names
    /// without a result; each counting the transactions its manifest gives it, not what a result
    /// declared), its status and its note. Nothing changes until a checkpoint commits the decision
    /// ([`Commit::Ending`]); an ending already committed is that decision again.
    pub(super) fn decide(&self, manifest: &Manifest) -> Decision {
        let (abandon, stall) = match &self.phase {
            Phase::Open { abandon, stall } => (abandon, stall),
            Phase::Ending(d) => return d.clone(),
            Phase::Finished(status) => {
                return Decision { status: *status, failed: self.cp.failed_chunks.clone(), note: self.cp.note.clone(), at: self.cp.ending_time().to_string() }
            }
        };
        let placeholder = manifest.created_at.is_empty();
        let mut failed = self.cp.failed_chunks.clone();
        let note = match (abandon, stall) {
            (None, None) => None,
            (None, Some(reason)) => {
                let missing = fail_missing(&self.cp, manifest, &mut failed, &format!("no result: {reason}"));
                let shown: Vec<String> = missing.iter().take(20).map(u32::to_string).collect();
                let more = if missing.len() > shown.len() { ", ..." } else { "" };
                Some(format!("finished without {} of its {} chunks ({}{more}): {reason}", missing.len(), manifest.total_chunks, shown.join(", ")))
            }
            (Some(reason), _) if placeholder => Some(format!(
                "abandoned: {reason}; the submission never finished (no manifest): submitted and accepted count only the transactions of chunks that reported; files, rejected rows and tariff are unknown"
            )),
            (Some(reason), _) => {
                fail_missing(&self.cp, manifest, &mut failed, &format!("no result before the job was abandoned: {reason}"));
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
        let processed = self.totals.transactions();
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
        Decision { status, failed, note, at: self.clock.rfc3339() }
    }

    /// Plans the checkpoint that commits `commit`, with `calls` counted in it (the calls the commit
    /// itself makes): the document and, for a large job, the part to write before it. The job is
    /// unchanged until [`saved`](Self::saved) says the document was written.
    pub(super) fn plan(&self, commit: Commit, calls: &RequestCounts) -> Result<Save> {
        let mut doc = self.cp.clone();
        doc.requests.merge(calls);
        if self.changed || !matches!(commit, Commit::Progress) {
            doc.updated_at = self.clock.rfc3339();
        }
        let (status, finishing, rows) = match (&commit, &self.phase) {
            (Commit::Progress, Phase::Open { .. }) => (JobStatus::Running, false, Rows::Keep),
            (Commit::Progress | Commit::Final, Phase::Ending(d)) => {
                doc.failed_chunks = d.failed.clone();
                doc.note = d.note.clone();
                doc.ended_at = Some(d.at.clone());
                let finished = matches!(commit, Commit::Final);
                (d.status, !finished, if finished { Rows::Drop } else { Rows::Keep })
            }
            (Commit::Ending(d), Phase::Open { .. }) => {
                doc.failed_chunks = d.failed.clone();
                doc.note = d.note.clone();
                doc.ended_at = Some(d.at.clone());
                (d.status, true, Rows::Keep)
            }
            (Commit::Quarantined, Phase::Open { .. } | Phase::Ending(_)) => {
                doc.failed_chunks = self.failed().to_vec();
                if let Phase::Ending(d) = &self.phase {
                    doc.note = d.note.clone();
                }
                (JobStatus::Quarantined, false, Rows::Keep)
            }
            (commit, phase) => unreachable!("no checkpoint commits {commit:?} from {phase:?}"),
        };
        doc.status = status;
        doc.finishing = finishing;
        save::plan(doc, &self.totals, rows, commit, self.etag.clone())
    }

    /// The digests of its checkpoint writes since the last one confirmed whose outcome is unknown
    /// (up to [`MAX_UNCONFIRMED`], the latest).
    pub(super) fn unconfirmed(&self) -> &[[u8; 32]] {
        &self.unconfirmed
    }

    /// A checkpoint write of `body` failed without saying whether it landed (any such write since
    /// the last confirmed one may be the one in place).
    pub(super) fn write_unconfirmed(&mut self, body: &[u8]) {
        if self.unconfirmed.len() >= MAX_UNCONFIRMED {
            self.unconfirmed.remove(0);
        }
        self.unconfirmed.push(fleet_io::blob::digest(body));
    }

    /// The checkpoint planned was written (its ETag `etag`): the job takes what it committed (its
    /// calls, parts, phase). Returns the parts the document no longer names (to delete).
    pub(super) fn saved(&mut self, save: Save, etag: String) -> Vec<String> {
        self.unconfirmed.clear();
        let (doc, commit, stale) = save.into_parts();
        let rows_kept = !matches!(commit, Commit::Final);
        let failed = doc.failed_chunks;
        self.cp.requests = doc.requests;
        self.cp.parts = doc.parts;
        self.cp.updated_at = doc.updated_at;
        self.etag = Some(etag);
        self.saved = Instant::now();
        self.changed = false;
        match commit {
            Commit::Progress => {}
            Commit::Ending(d) => self.phase = Phase::Ending(d),
            Commit::Final => {
                let Phase::Ending(d) = std::mem::replace(&mut self.phase, Phase::Finished(JobStatus::Running)) else {
                    unreachable!("only an ending job finishes")
                };
                (self.cp.status, self.cp.failed_chunks, self.cp.note, self.cp.ended_at) = (d.status, d.failed, d.note, Some(d.at));
                self.phase = Phase::Finished(d.status);
            }
            Commit::Quarantined => {
                (self.cp.status, self.cp.failed_chunks) = (JobStatus::Quarantined, failed);
                self.phase = Phase::Finished(JobStatus::Quarantined);
            }
        }
        if rows_kept {
            self.totals.clear_changed();
        }
        stale
    }
}

/// The checkpoint of a job nothing is known of yet.
pub(super) fn fresh_checkpoint(job_id: &str, clock: &Clock) -> Checkpoint {
    Checkpoint {
        v: fleet_domain::model::WIRE_VERSION,
        job_id: job_id.to_string(),
        status: JobStatus::Running,
        total_chunks: None,
        accounted: Default::default(),
        processed_transactions: 0,
        failed_chunks: Vec::new(),
        accounts: Vec::new(),
        parts: Vec::new(),
        requests: RequestCounts::default(),
        updated_at: clock.rfc3339(),
        finishing: false,
        note: None,
        partition: None,
        ended_at: None,
    }
}

/// Deliveries applied in memory and waiting for a checkpoint, counted for the whole aggregator (also
/// when a job is dropped with them: they come back after their visibility timeout).
pub(super) struct Unsaved {
    list: Vec<(Source, Kept)>,
    count: Arc<AtomicUsize>,
}

impl Unsaved {
    pub(super) fn new(count: Arc<AtomicUsize>) -> Unsaved {
        Unsaved { list: Vec::new(), count }
    }

    fn extend(&mut self, kept: Vec<(Source, Kept)>) {
        self.count.fetch_add(kept.len(), Ordering::Relaxed);
        self.list.extend(kept);
    }

    /// Handles that make each message visible again, even once the message itself is gone (a stop
    /// whose last checkpoint does not finish in time).
    pub(super) fn visibility(&self) -> Vec<Visibility> {
        self.list.iter().map(|(_, k)| k.visibility()).collect()
    }

    /// The messages, for their completion.
    fn take(&mut self) -> Vec<Kept> {
        self.take_all().into_iter().map(|(_, k)| k).collect()
    }

    /// The messages with the queue each came from (to apply them again).
    fn take_all(&mut self) -> Vec<(Source, Kept)> {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
        std::mem::take(&mut self.list)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Kept> {
        self.list.iter().map(|(_, k)| k)
    }

    pub(super) fn len(&self) -> usize {
        self.list.len()
    }
}

impl Drop for Unsaved {
    fn drop(&mut self) {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
    }
}

/// Lists every chunk the manifest names that the checkpoint has not accounted for as failed with
/// `reason`; returns those chunks.
fn fail_missing(cp: &Checkpoint, m: &Manifest, failed: &mut Vec<FailedChunk>, reason: &str) -> Vec<u32> {
    let missing: Vec<u32> = (0..m.total_chunks).filter(|c| !cp.accounted.contains(c)).collect();
    for &chunk in &missing {
        let transactions = m.chunk_transactions.get(chunk as usize).copied().unwrap_or(0);
        failed.push(FailedChunk { chunk, transactions, reason: reason.to_string() });
    }
    missing
}

#[cfg(test)]
mod tests {
    //! The job's transitions alone: no store, no queue, no clock but the instants given.
    use super::*;
    use fleet_domain::billing::AccountTotals;
    use fleet_domain::model::AccountsPayload;
    use rust_decimal::Decimal;

    fn job() -> Job {
        Job::new("j", Lease::detached(), Clock::System, Unsaved::new(Arc::default()))
    }

    fn ready(msg: ResultMessage) -> Ready {
        let accounts = match &msg {
            ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts } }, .. }) => {
                Some(Ok(accounts.iter().map(AccountTotals::borrowed).collect()))
            }
            _ => None,
        };
        Ready { item: Item::Result(msg), accounts, gets: 0 }
    }

    fn chunk(c: u32, n: u64) -> Ready {
        let a = AccountTotals { account_id: "a".into(), currency: "EUR".into(), count: n, gross: Decimal::new(100 * n as i64, 2), fees: Decimal::ZERO };
        ready(ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: "j".into(),
            chunk: c,
            transactions: n,
            outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![a] } },
            requests: RequestCounts::default(),
        }))
    }

    fn failed(c: u32) -> Ready {
        ready(ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: "j".into(),
            chunk: c,
            transactions: 99,
            outcome: ChunkOutcome::Failed { reason: "bad".into() },
            requests: RequestCounts::default(),
        }))
    }

    fn seal(total: u32) -> Ready {
        ready(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: total })
    }

    fn manifest(chunks: &[u64]) -> Manifest {
        let mut m = super::super::quarantine::placeholder_manifest("j", chunks.len() as u32, chunks.iter().sum());
        m.created_at = "2026-11-26T00:00:00Z".into();
        m.chunk_transactions = chunks.to_vec();
        m
    }

    /// Commits `commit` as if its checkpoint was written.
    fn commit(j: &mut Job, commit: Commit) {
        let save = j.plan(commit, &RequestCounts::default()).unwrap();
        j.saved(save, "\"etag\"".into());
    }

    #[test]
    fn a_chunk_counts_once_a_real_result_replaces_a_failure_and_the_seal_bounds_the_job() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        j.apply(chunk(0, 2), &mut ctl).unwrap();
        j.apply(chunk(0, 2), &mut ctl).unwrap();
        j.apply(failed(1), &mut ctl).unwrap();
        assert!(!j.all_in(), "not sealed");
        j.apply(seal(2), &mut ctl).unwrap();
        assert!(j.all_in());
        assert_eq!(j.failed().len(), 1);
        j.apply(chunk(1, 3), &mut ctl).unwrap();
        assert_eq!((j.failed().len(), j.processed()), (0, 5), "the real result replaced the failure");
        j.apply(chunk(7, 50), &mut ctl).unwrap();
        assert_eq!(j.processed(), 5, "beyond the sealed size: ignored");
        let d = j.decide(&manifest(&[2, 3]));
        assert_eq!((d.status, d.note.as_deref()), (JobStatus::Complete, None));
    }

    #[test]
    fn a_job_with_a_failure_finishes_only_once_settled_and_its_ending_is_kept() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        for r in [chunk(0, 1), failed(1), seal(2)] {
            j.apply(r, &mut ctl).unwrap();
        }
        let settle = Duration::from_secs(120);
        let t0 = j.news();
        assert!(!j.due_to_finish(t0 + Duration::from_secs(119), t0, settle));
        assert!(j.due_to_finish(t0 + settle, t0, settle));
        assert!(!j.due_to_finish(t0 + settle, t0 + Duration::from_secs(60), settle), "no idle time from before the floor");
        let d = j.decide(&manifest(&[1, 4]));
        assert_eq!(d.status, JobStatus::Partial);
        assert_eq!(d.failed[0].transactions, 4, "the manifest's count, not the 99 the result declared");
        let mut a = job();
        a.apply(chunk(0, 1), &mut ctl).unwrap();
        a.abandon("first".into());
        a.abandon("second".into());
        assert!(a.due_to_finish(a.news(), a.news(), settle), "an abandon asked for: finished at once");
        let d = a.decide(&manifest(&[1, 2, 3]));
        assert_eq!(d.status, JobStatus::Abandoned);
        assert_eq!(d.failed.iter().map(|f| (f.chunk, f.transactions)).collect::<Vec<_>>(), [(1, 2), (2, 3)]);
        assert_eq!(d.note.as_deref(), Some("abandoned: first"), "the first reason asked for is kept");
    }

    /// Deciding changes nothing; a planned checkpoint changes nothing until it is written; a committed
    /// ending is the only one the job ever reports, takes no more results, and its end drops the rows.
    #[tokio::test]
    async fn an_ending_is_the_job_s_only_once_a_checkpoint_commits_it() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        for r in [chunk(0, 2), failed(1), seal(2)] {
            j.apply(r, &mut ctl).unwrap();
        }
        let d = j.decide(&manifest(&[2, 5]));
        assert!(j.is_open(), "deciding is not committing");
        // The write failed: the plan is dropped, the job is as it was (no flag to roll back).
        let lost = j.plan(Commit::Ending(d.clone()), &RequestCounts::default()).unwrap();
        drop(lost);
        assert_eq!((j.is_open(), j.failed().len()), (true, 1));
        j.apply(chunk(1, 5), &mut ctl).unwrap();
        assert_eq!(j.failed().len(), 0, "still open: the real result replaced the failure");
        // Decided again and written: the ending is committed.
        let d = j.decide(&manifest(&[2, 5]));
        assert_eq!(d.status, JobStatus::Complete);
        let mut calls = RequestCounts::default();
        calls.add("s3.PutObject", 3);
        let save = j.plan(Commit::Ending(d.clone()), &calls).unwrap();
        j.saved(save, "\"e1\"".into());
        assert_eq!(j.phase(), &Phase::Ending(d.clone()));
        assert_eq!(j.requests().0.get("s3.PutObject"), Some(&3), "the finish's calls are counted with the commit that decided it");
        // Nothing more is taken, and a decision asked again is the committed one.
        let (k, _done) = kept_delivery("late");
        assert!(j.apply_batch(vec![(failed(0), (Source::Results, k))], Instant::now(), &mut ctl).is_ok());
        assert_eq!((j.failed().len(), j.unsaved().len()), (0, 1), "a late failure is not applied, only kept for the finish");
        assert_eq!(j.decide(&manifest(&[9, 9])), d);
        assert_eq!(j.next(j.news(), j.news(), Duration::from_secs(120), Asker::Timer), Next::Finish);
        commit(&mut j, Commit::Final);
        assert_eq!(j.phase(), &Phase::Finished(JobStatus::Complete));
        assert_eq!(j.done().len(), 1);
    }

    /// A job quarantined (committed) whose report could not be written stays in memory: it asks to
    /// be finished again (the report written), never to be saved (no checkpoint follows an end).
    #[tokio::test]
    async fn a_quarantined_job_left_in_memory_asks_only_to_be_finished() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        let (k, _done) = kept_delivery("1");
        j.apply_batch(vec![(chunk(0, 1), (Source::Results, k))], Instant::now(), &mut ctl).unwrap();
        commit(&mut j, Commit::Quarantined);
        assert_eq!(j.phase(), &Phase::Finished(JobStatus::Quarantined));
        let t = Instant::now();
        assert_eq!(j.next(t, t, Duration::from_secs(120), Asker::Timer), Next::Finish, "its report is left to write");
        assert_eq!(j.next(t, t, Duration::from_secs(120), Asker::Batch), Next::Finish);
    }

    #[tokio::test]
    async fn a_batch_saves_once_enough_is_unsaved_the_timer_whatever_is() {
        let mut j = job();
        let mut ctl = RequestCounts::default();
        let t0 = Instant::now();
        let settle = Duration::from_secs(120);
        assert_eq!(j.next(t0, t0, settle, Asker::Timer), Next::Wait, "nothing unsaved");
        let (k, _done) = kept_delivery("1");
        j.apply_batch(vec![(chunk(0, 1), (Source::Results, k))], t0, &mut ctl).unwrap();
        assert_eq!(j.next(t0, t0, settle, Asker::Timer), Next::Save);
        assert_eq!(j.next(j.saved, t0, settle, Asker::Batch), Next::Wait, "one message, just saved");
        assert_eq!(j.next(j.saved + FLUSH_INTERVAL, t0, settle, Asker::Batch), Next::Save);
        commit(&mut j, Commit::Progress);
        assert!(j.is_open());
    }

    fn kept_delivery(id: &str) -> (Kept, fleet_engine::Completions) {
        let q = fleet_io::memory::MemoryQueue::new("billing-results", Duration::from_secs(30));
        let done = fleet_engine::Completions::start(q, Default::default());
        let m = fleet_io::queue::Message { id: id.into(), body: String::new(), receive_count: 1, ..Default::default() };
        (done.keep(fleet_io::queue::Delivery::new(m, format!("r-{id}"))), done)
    }

    /// Handing a job over gives back exactly the messages applied since its last checkpoint (for the
    /// new owner), dropping it gives them back with their queues (to hold), and the aggregator's count
    /// of unsaved messages follows both.
    #[tokio::test]
    async fn a_job_handed_over_or_dropped_gives_back_exactly_its_unsaved_messages() {
        let q = fleet_io::memory::MemoryQueue::new("billing-results", Duration::from_secs(30));
        let done = fleet_engine::Completions::start(q, Default::default());
        let kept = |id: &str| {
            let m = fleet_io::queue::Message { id: id.into(), body: String::new(), receive_count: 1, ..Default::default() };
            done.keep(fleet_io::queue::Delivery::new(m, format!("r-{id}")))
        };
        let count = Arc::new(AtomicUsize::new(0));
        let mut a = Job::new("a", Lease::detached(), Clock::System, Unsaved::new(count.clone()));
        a.unsaved.extend(vec![(Source::Results, kept("1")), (Source::ResultsDeadLetter, kept("2"))]);
        let mut b = Job::new("b", Lease::detached(), Clock::System, Unsaved::new(count.clone()));
        b.unsaved.extend(vec![(Source::WorkDeadLetter, kept("3"))]);
        assert_eq!(count.load(Ordering::Relaxed), 3);
        let handed: Vec<String> = a.hand_over().iter().map(|k| k.id.clone()).collect();
        assert_eq!(handed, ["1", "2"]);
        assert_eq!(count.load(Ordering::Relaxed), 1);
        let dropped: Vec<(Source, String)> = b.drop_unsaved().into_iter().map(|(s, k)| (s, k.id.clone())).collect();
        assert_eq!(dropped, [(Source::WorkDeadLetter, "3".to_string())]);
        assert_eq!(count.load(Ordering::Relaxed), 0);
    }

    /// Only what changes a job is its news: a duplicate, a second seal or an abandon asked again
    /// restarts neither its stall nor its abandon time, and a checkpoint that only covers them keeps
    /// the checkpoint's time (which other controllers date the job's news by); a first result, the
    /// seal and an ending move both.
    #[tokio::test]
    async fn a_duplicate_is_not_news() {
        let q = fleet_io::memory::MemoryQueue::new("billing-results", Duration::from_secs(30));
        let done = fleet_engine::Completions::start(q, Default::default());
        let mut n = 0;
        let mut kept = || {
            n += 1;
            let m = fleet_io::queue::Message { id: n.to_string(), body: String::new(), receive_count: 1, ..Default::default() };
            (Source::Results, done.keep(fleet_io::queue::Delivery::new(m, format!("r-{n}"))))
        };
        let mut j = job();
        let mut ctl = RequestCounts::default();
        let t0 = Instant::now();
        let (t1, t2, t3) = (t0 + Duration::from_secs(10), t0 + Duration::from_secs(20), t0 + Duration::from_secs(30));
        j.apply_batch(vec![(chunk(0, 2), kept()), (seal(2), kept())], t1, &mut ctl).unwrap();
        assert_eq!(j.news(), t1, "a first result and the seal are news");
        commit(&mut j, Commit::Progress);
        j.cp.updated_at = "2026-11-26T00:00:00Z".into();
        j.apply_batch(vec![(chunk(0, 2), kept()), (seal(2), kept()), (seal(3), kept())], t2, &mut ctl).unwrap();
        assert_eq!(j.news(), t1, "a duplicate, the seal again and a conflicting seal are not news");
        commit(&mut j, Commit::Progress);
        assert_eq!(j.cp.updated_at, "2026-11-26T00:00:00Z", "a checkpoint covering only duplicates keeps its time");
        j.apply_batch(vec![(failed(1), kept())], t3, &mut ctl).unwrap();
        assert_eq!(j.news(), t3, "a chunk's first failure is news");
        commit(&mut j, Commit::Progress);
        assert_ne!(j.cp.updated_at, "2026-11-26T00:00:00Z", "a checkpoint with news has a new time");
    }
}
