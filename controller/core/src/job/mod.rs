//! Why one file: a job's fields and the transitions that change them are checked together (that
//! nothing changes before a write is confirmed, that each counted call lands in one checkpoint); the
//! item's, the ending's and the unsaved messages' rules are in `apply`, `ending`, `unsaved`.
//!
//! A newcomer reads `Phase`, then `impl Job` here; what an item does to a job is in `apply`, how it
//! ends in `ending`, its unit tests in `tests`.
//!
//! A job in memory as a state machine, sans-I/O: its fields are its own, its transitions are methods
//! that take what happened (an item applied, a manifest read, a checkpoint written) and return what to
//! do (finish it, save it, the document to write, the messages to complete); the controller does the
//! I/O and reports back. Nothing is set before a write and rolled back after it fails: a checkpoint
//! is planned from the job as it is ([`Job::plan`]), and only a written one changes it
//! ([`Job::saved`]), its phase included.
//!
//! Generic over `H`, the handle of a message applied (the controller's kept delivery; a plain value in
//! tests): [`Unsaved`] holds those not yet covered by a checkpoint, and the job gives them back to be
//! completed, handed over or held. It reads no clock: the caller passes the instant (`now`) and the
//! wall time (`wall`, RFC 3339) of each event, and the name of a new checkpoint part.

mod apply;
mod ending;
mod unsaved;

#[cfg(test)]
mod tests;

use std::time::{Duration, Instant};

use fleet_domain::billing::CheckedTotals;
use fleet_domain::model::{Checkpoint, FailedChunk, JobStatus};
use fleet_domain::requests::RequestCounts;

pub use self::ending::placeholder_manifest;
pub use self::unsaved::Unsaved;
use crate::decision::{Commit, Decision};
use crate::item::Source;
use crate::limits::{FLUSH_INTERVAL, FLUSH_MESSAGES};
use crate::resident::Carry;
use crate::save::{self, Rows, Save};

/// Where a job is in its life.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
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
pub enum Next {
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
pub enum Asker {
    Batch,
    Timer,
}

pub struct Job<H> {
    /// What it has counted, in its checkpoint's form (without rows: those are `totals`). While the job
    /// is open its `status`, `note` and `finishing` are not read: the phase says them.
    cp: Checkpoint,
    phase: Phase,
    totals: CheckedTotals,
    /// Applied in memory, not yet covered by a checkpoint: completed after the next one.
    unsaved: Unsaved<H>,
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
    /// ETag of the checkpoint as last read or written (`None`: there is none yet where this release
    /// writes it, a new job's or one read where an earlier release kept it): checkpoints are written
    /// only if it still matches (fencing), or only where none is.
    etag: Option<String>,
    /// The digests of its checkpoint writes since the last confirmed one whose outcome is unknown (no
    /// answer, or an answer lost and not read back): one may have landed, and a later write fenced
    /// by `etag` then finds it in place (see `fleet_io::blob::put_if_owned_after`).
    unconfirmed: Vec<[u8; 32]>,
    /// The calls counted for it since its last checkpoint (in `cp.requests` too): lost with the job
    /// when it is dropped from memory unless the driver carries them to its next load.
    uncommitted: RequestCounts,
    /// Beside each of `unconfirmed`, the calls since the last checkpoint its document held, and the
    /// calls it attributed to what it covered.
    unconfirmed_calls: Vec<(RequestCounts, RequestCounts)>,
}

/// How many checkpoint writes of unknown outcome a job remembers (each failed one may have landed,
/// and at most one did: they are all fenced on the job's last confirmed ETag, so it may be the
/// first). Digests, 32 bytes each: enough for minutes of failed tries at a finish's pace. (It was
/// the last 4 bodies until seed 168173223: a finish whose first ending write landed unanswered,
/// then four more tries without an answer, took its own first write for another controller's.)
const MAX_UNCONFIRMED: usize = 1024;

impl<H> Job<H> {
    /// A job nothing is known of yet (no checkpoint), met at `now` (`wall`).
    pub fn new(job_id: &str, now: Instant, wall: String, unsaved: Unsaved<H>) -> Job<H> {
        Job {
            cp: fresh_checkpoint(job_id, wall),
            phase: Phase::Open { abandon: None, stall: None },
            totals: CheckedTotals::new(),
            unsaved,
            saved: now,
            news: now,
            changed: true,
            marked_open: false,
            etag: None,
            unconfirmed: Vec::new(),
            uncommitted: RequestCounts::default(),
            unconfirmed_calls: Vec::new(),
        }
    }

    /// A job resumed from its checkpoint (`etag`), its rows restored into `totals`: open, or ending
    /// with the decision the checkpoint committed. Its last news is `news` (when the caller first saw
    /// the checkpoint's time); it is resumed at `now`.
    pub fn resume(mut cp: Checkpoint, totals: CheckedTotals, etag: Option<String>, news: Instant, now: Instant, unsaved: Unsaved<H>) -> Job<H> {
        let phase = if cp.finishing {
            let at = cp.ending_time().to_string();
            Phase::Ending(Decision { status: cp.status, failed: std::mem::take(&mut cp.failed_chunks), note: cp.note.take(), at })
        } else {
            Phase::Open { abandon: None, stall: None }
        };
        cp.accounts = Vec::new();
        Job {
            cp,
            phase,
            totals,
            unsaved,
            saved: now,
            news,
            changed: false,
            marked_open: true,
            etag,
            unconfirmed: Vec::new(),
            uncommitted: RequestCounts::default(),
            unconfirmed_calls: Vec::new(),
        }
    }

    pub fn id(&self) -> &str {
        &self.cp.job_id
    }

    /// The results partition its messages travel on, as its checkpoint recorded it.
    pub fn partition(&self) -> Option<u16> {
        self.cp.partition
    }

    /// Its messages came from results partition `p`: recorded with its next checkpoint (the first
    /// partition seen stays: a job keeps its partition).
    pub fn travels_on(&mut self, p: u16) {
        self.cp.partition.get_or_insert(p);
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// It still takes results (its ending is not committed).
    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open { .. })
    }

    pub fn total_chunks(&self) -> Option<u32> {
        self.cp.total_chunks
    }

    /// Chunks accounted for (processed or failed).
    pub fn accounted(&self) -> usize {
        self.cp.accounted.len()
    }

    /// The chunks failed so far (or those its committed ending has).
    pub fn failed(&self) -> &[FailedChunk] {
        match &self.phase {
            Phase::Ending(d) => &d.failed,
            _ => &self.cp.failed_chunks,
        }
    }

    /// Checkpoint parts its last checkpoint names (a large job's rows).
    pub fn parts(&self) -> usize {
        self.cp.parts.len()
    }

    /// Transactions counted so far.
    pub fn processed(&self) -> u64 {
        self.cp.processed_transactions
    }

    pub fn totals(&self) -> &CheckedTotals {
        &self.totals
    }

    /// The calls counted for it so far (by the initiator's manifest aside: by processors and the
    /// controllers), each where it was made.
    pub fn requests(&self) -> &RequestCounts {
        &self.cp.requests
    }

    /// Counts calls made for it: in its next checkpoint.
    pub fn count(&mut self, calls: &RequestCounts) {
        self.cp.requests.merge(calls);
        self.uncommitted.merge(calls);
    }

    /// Takes back calls a loaded checkpoint holds that were not made: the deletes a write of unknown
    /// outcome attributed to it, which landed while its writer, told it failed, kept the messages
    /// (they were covered and attributed again by a later checkpoint).
    pub fn withdraw(&mut self, calls: &RequestCounts) {
        self.cp.requests.sub(calls);
    }

    /// The calls counted since its last checkpoint.
    pub fn uncommitted(&self) -> &RequestCounts {
        &self.uncommitted
    }

    /// What it carries when it is dropped from memory: its calls since its last checkpoint, and
    /// those each write of unknown outcome since held (see `crate::resident::Carry`).
    pub fn carry(&self) -> Carry {
        let in_writes = self.unconfirmed.iter().zip(&self.unconfirmed_calls).map(|(d, (held, attributed))| (*d, held.clone(), attributed.clone())).collect();
        Carry { calls: self.uncommitted.clone(), in_writes }
    }

    /// Messages applied and not yet covered by a checkpoint.
    pub fn unsaved(&self) -> &Unsaved<H> {
        &self.unsaved
    }

    /// Whether its open marker must be written before its checkpoint.
    pub fn needs_marker(&self) -> bool {
        !self.marked_open
    }

    /// Its open marker was written.
    pub fn marked(&mut self) {
        self.marked_open = true;
    }

    /// Sealed, with every chunk accounted for (processed or failed).
    pub fn all_in(&self) -> bool {
        self.cp.total_chunks == Some(self.cp.accounted.len() as u32)
    }

    /// When it last had news.
    pub fn news(&self) -> Instant {
        self.news
    }

    /// Its last news is now `at` (a batch applied; the expiry's scan when a fix is undone).
    pub fn heard(&mut self, at: Instant) {
        self.news = at;
    }

    /// How long the job has had no news at `now` (never counted from before `floor`).
    pub fn quiet_for(&self, now: Instant, floor: Instant) -> Duration {
        now.saturating_duration_since(self.news.max(floor))
    }

    /// Whether it is to be finished now from memory: its ending is committed or asked for, or every
    /// chunk is in and none failed, or some failed and nothing came for `settle` (no real result is
    /// coming any more).
    pub fn due_to_finish(&self, now: Instant, floor: Instant, settle: Duration) -> bool {
        match &self.phase {
            Phase::Ending(_) => true,
            Phase::Open { abandon: Some(_), .. } | Phase::Open { stall: Some(_), .. } => true,
            Phase::Open { .. } => self.all_in() && (self.cp.failed_chunks.is_empty() || self.quiet_for(now, floor) >= settle),
            // Still in memory: what finishing it left undone (a quarantined job's report) is done again.
            Phase::Finished(_) => true,
        }
    }

    /// What it asks for at `now`: to be finished, saved, or nothing yet.
    pub fn next(&self, now: Instant, floor: Instant, settle: Duration, asker: Asker) -> Next {
        if self.due_to_finish(now, floor, settle) {
            return Next::Finish;
        }
        let save = match asker {
            Asker::Timer => !self.unsaved.is_empty(),
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
    pub fn abandon(&mut self, reason: String) {
        if let Phase::Open { abandon, .. } = &mut self.phase {
            abandon.get_or_insert(reason);
        }
    }

    /// Asks it to end as stalled for `reason`: its missing chunks fail (the first reason is kept).
    pub fn stall(&mut self, reason: String) {
        if let Phase::Open { stall, .. } = &mut self.phase {
            stall.get_or_insert(reason);
        }
    }

    /// Whether it may end without a manifest (the submission never finished): only abandoned, asked
    /// now or committed so before.
    pub fn may_end_without_manifest(&self) -> bool {
        matches!(&self.phase, Phase::Open { abandon: Some(_), .. } | Phase::Ending(_))
    }

    /// The transactions it knows of without a manifest: processed, and those of its failed chunks.
    pub fn known_transactions(&self) -> u64 {
        self.cp.processed_transactions.saturating_add(self.failed().iter().fold(0u64, |n, f| n.saturating_add(f.transactions)))
    }

    /// Hands it over to the controller that owns it now (fenced, or its lease lost): what it had applied
    /// since its last checkpoint, to go back to the queue for the owner.
    pub fn hand_over(mut self) -> Vec<H> {
        self.unsaved.take()
    }

    /// Drops it after a failure: the messages it had applied since its last checkpoint, with the
    /// queue each came from (held, to be applied again to the job reloaded from that checkpoint, or
    /// left to come back after their visibility timeout).
    pub fn drop_unsaved(mut self) -> Vec<(Source, H)> {
        self.unsaved.take_all()
    }

    /// The messages its last checkpoint covers (all it had unsaved: its lock was held across the
    /// write): to delete.
    pub fn covered(&mut self) -> Vec<H> {
        self.unsaved.take()
    }

    /// Its messages once it is finished (its last checkpoint covers them): to delete.
    pub fn done(mut self) -> Vec<H> {
        debug_assert!(matches!(self.phase, Phase::Finished(_)), "only a finished job's messages are done");
        self.unsaved.take()
    }

    /// Plans the checkpoint that commits `commit`, with every call counted so far (its own writes are
    /// counted once made, in the next) and `attributed` (calls attributed to it by rule for what this
    /// checkpoint covers: the job's once the document is written): the document and, for a large
    /// job, the part to write before it (named by `part_id`, asked only then). `wall`: the time it is planned at (RFC 3339), asked only when it is
    /// the document's new time: the job had news, or the commit is more than progress. The job is unchanged until [`saved`](Self::saved) says the document was
    /// written.
    pub fn plan(
        &self,
        commit: Commit,
        attributed: &RequestCounts,
        wall: impl FnOnce() -> String,
        part_id: impl FnOnce() -> String,
    ) -> fleet_domain::error::Result<Save> {
        let mut doc = self.cp.clone();
        doc.requests.merge(attributed);
        if self.changed || !matches!(commit, Commit::Progress) {
            doc.updated_at = wall();
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
        save::plan(doc, &self.totals, rows, commit, self.etag.clone(), part_id)
    }

    /// The digests of its checkpoint writes since the last one confirmed whose outcome is unknown
    /// (up to [`MAX_UNCONFIRMED`], the latest).
    pub fn unconfirmed(&self) -> &[[u8; 32]] {
        &self.unconfirmed
    }

    /// A checkpoint write failed without saying whether it landed (any such write since the last
    /// confirmed one may be the one in place): `digest`, its body's SHA-256; `attributed`, what its
    /// plan attributed to what it covered.
    pub fn write_unconfirmed(&mut self, digest: [u8; 32], attributed: &RequestCounts) {
        if self.unconfirmed.len() >= MAX_UNCONFIRMED {
            self.unconfirmed.remove(0);
            self.unconfirmed_calls.remove(0);
        }
        self.unconfirmed.push(digest);
        // Nothing is counted between a plan and its write: the document held these.
        self.unconfirmed_calls.push((self.uncommitted.clone(), attributed.clone()));
    }

    /// The checkpoint planned was written (its ETag `etag`) at `now`: the job takes what it committed
    /// (its calls, parts, phase). Returns the parts the document no longer names (to delete).
    pub fn saved(&mut self, save: Save, etag: String, now: Instant) -> Vec<String> {
        self.unconfirmed.clear();
        self.unconfirmed_calls.clear();
        self.uncommitted = RequestCounts::default();
        let (doc, commit, stale) = save.into_parts();
        let rows_kept = !matches!(commit, Commit::Final);
        let failed = doc.failed_chunks;
        self.cp.requests = doc.requests;
        self.cp.parts = doc.parts;
        self.cp.updated_at = doc.updated_at;
        self.etag = Some(etag);
        self.saved = now;
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

/// The checkpoint of a job nothing is known of yet, at `wall`.
pub fn fresh_checkpoint(job_id: &str, wall: String) -> Checkpoint {
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
        updated_at: wall,
        finishing: false,
        note: None,
        partition: None,
        ended_at: None,
    }
}
