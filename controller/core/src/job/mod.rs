//! Why the transitions are in one file: they are checked together (that nothing changes before a
//! write is confirmed, that each counted call lands in one checkpoint). The item's, the ending's and
//! the unsaved messages' rules are in `apply`, `ending`, `unsaved`; what it has counted is its
//! `Tally` (`tally`), what it knows of its own writes its `Writes` (`writes`), both read through the
//! job; the tally changes only by its transitions, and its writes also by what the driver reports
//! through `writes_mut` (a write of unknown outcome, its open marker written).
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
mod tally;
mod unsaved;
mod writes;

#[cfg(test)]
mod tests;

use std::time::{Duration, Instant};

use fleet_domain::billing::CheckedTotals;
use fleet_domain::model::{Checkpoint, FailedChunk, JobStatus, Manifest};
use fleet_domain::requests::RequestCounts;

pub use self::ending::placeholder_manifest;
pub use self::tally::Tally;
pub use self::unsaved::Unsaved;
pub use self::writes::Writes;
use crate::decision::{Commit, Decision};
use crate::expiry::Ending;
use crate::item::Source;
use crate::limits::{FLUSH_INTERVAL, FLUSH_MESSAGES};
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
    /// What it has counted: its checkpoint without rows, and its rows.
    tally: Tally,
    phase: Phase,
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
    /// Its writes: the ETag it fences on, those of unknown outcome, the calls since the last one,
    /// its open marker.
    writes: Writes,
}

impl<H> Job<H> {
    /// A job nothing is known of yet (no checkpoint), met at `now` (`wall`).
    pub fn new(job_id: &str, now: Instant, wall: String, unsaved: Unsaved<H>) -> Job<H> {
        Job {
            tally: Tally { cp: fresh_checkpoint(job_id, wall), totals: CheckedTotals::new() },
            phase: Phase::Open { abandon: None, stall: None },
            unsaved,
            saved: now,
            news: now,
            changed: true,
            writes: Writes::new(None, false),
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
        Job { tally: Tally { cp, totals }, phase, unsaved, saved: now, news, changed: false, writes: Writes::new(etag, true) }
    }

    pub fn id(&self) -> &str {
        &self.tally.cp.job_id
    }

    /// Its messages came from results partition `p`: recorded with its next checkpoint (the first
    /// partition seen stays: a job keeps its partition).
    pub fn travels_on(&mut self, p: u16) {
        self.tally.cp.partition.get_or_insert(p);
    }

    /// What it has counted.
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// What it knows of its own writes.
    pub fn writes(&self) -> &Writes {
        &self.writes
    }

    /// Its writes, for the driver to report one of unknown outcome or its open marker written.
    pub fn writes_mut(&mut self) -> &mut Writes {
        &mut self.writes
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// It still takes results (its ending is not committed).
    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open { .. })
    }

    /// The chunks failed so far (or those its committed ending has).
    pub fn failed(&self) -> &[FailedChunk] {
        match &self.phase {
            Phase::Ending(d) => &d.failed,
            _ => &self.tally.cp.failed_chunks,
        }
    }

    /// Counts calls made for it: in its next checkpoint.
    pub fn count(&mut self, calls: &RequestCounts) {
        self.tally.cp.requests.merge(calls);
        self.writes.counted(calls);
    }

    /// Takes back calls a loaded checkpoint holds that were not made: the deletes a write of unknown
    /// outcome attributed to it, which landed while its writer, told it failed, kept the messages
    /// (they were covered and attributed again by a later checkpoint).
    pub fn withdraw(&mut self, calls: &RequestCounts) {
        self.tally.cp.requests.sub(calls);
    }

    /// Messages applied and not yet covered by a checkpoint.
    pub fn unsaved(&self) -> &Unsaved<H> {
        &self.unsaved
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

    /// What it asks for at `now`: to be finished, saved, or nothing yet. It is finished from memory
    /// when its ending is committed or asked for, or every chunk is in and none failed, or some failed
    /// and nothing came for `settle` (no real result is coming any more).
    pub fn next(&self, now: Instant, floor: Instant, settle: Duration, asker: Asker) -> Next {
        let finish = match &self.phase {
            Phase::Ending(_) => true,
            Phase::Open { abandon: Some(_), .. } | Phase::Open { stall: Some(_), .. } => true,
            Phase::Open { .. } => self.tally.all_in() && (self.tally.cp.failed_chunks.is_empty() || self.quiet_for(now, floor) >= settle),
            // Still in memory: what finishing it left undone (a quarantined job's report) is done again.
            Phase::Finished(_) => true,
        };
        if finish {
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

    /// Its claims settled (see `crate::claims`): `subtract`, the bills of its rows that another job
    /// billed first, taken out of its totals, and those rows kept for its report (`rejected`). Once
    /// only: a job whose claims are settled takes nothing more. Fails, changing nothing, when a row
    /// is not within its totals (its chunks read again disagree with what it counted).
    pub fn settle_claims(
        &mut self,
        subtract: &[fleet_domain::billing::AccountTotals],
        rejected: Vec<fleet_domain::model::Rejected>,
    ) -> Result<(), fleet_domain::billing::Overflow> {
        assert!(self.tally.cp.duplicates.is_none(), "a job's claims are settled once");
        self.tally.totals.try_subtract(subtract)?;
        let n = subtract.iter().fold(0u64, |n, a| n.saturating_add(a.count));
        self.tally.cp.processed_transactions = self.tally.cp.processed_transactions.saturating_sub(n);
        self.tally.cp.duplicates = Some(rejected);
        self.changed = true;
        Ok(())
    }

    /// Asks it to end (the expiry's rule found it quiet too long): abandoned, or stalled (its missing
    /// chunks fail). The first reason of each kind is kept; an abandon outranks a stall.
    pub fn ask_to_end(&mut self, ending: Ending) {
        if let Phase::Open { abandon, stall } = &mut self.phase {
            match ending {
                Ending::Abandon(reason) => abandon.get_or_insert(reason),
                Ending::Stalled(reason) => stall.get_or_insert(reason),
            };
        }
    }

    /// The manifest that stands in for one never written, if it may end without one (the submission
    /// never finished): only abandoned, asked now or committed so before. It counts the transactions
    /// the job knows of: processed, and those of its failed chunks.
    pub fn stand_in_manifest(&self) -> Option<Manifest> {
        if !matches!(&self.phase, Phase::Open { abandon: Some(_), .. } | Phase::Ending(_)) {
            return None;
        }
        let known = self.tally.cp.processed_transactions.saturating_add(self.failed().iter().fold(0u64, |n, f| n.saturating_add(f.transactions)));
        Some(placeholder_manifest(self.id(), self.tally.accounted() as u32, known))
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
        let mut doc = self.tally.cp.clone();
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
        save::plan(doc, &self.tally.totals, rows, commit, self.writes.etag(), part_id)
    }

    /// The checkpoint planned was written (its ETag `etag`) at `now`: the job takes what it committed
    /// (its calls, parts, phase). Returns the parts the document no longer names (to delete).
    pub fn saved(&mut self, save: Save, etag: String, now: Instant) -> Vec<String> {
        self.writes.confirmed(etag);
        let (doc, commit, stale) = save.into_parts();
        let rows_kept = !matches!(commit, Commit::Final);
        let failed = doc.failed_chunks;
        self.tally.cp.requests = doc.requests;
        self.tally.cp.parts = doc.parts;
        self.tally.cp.updated_at = doc.updated_at;
        self.saved = now;
        self.changed = false;
        match commit {
            Commit::Progress => {}
            Commit::Ending(d) => self.phase = Phase::Ending(d),
            Commit::Final => {
                let Phase::Ending(d) = std::mem::replace(&mut self.phase, Phase::Finished(JobStatus::Running)) else {
                    unreachable!("only an ending job finishes")
                };
                (self.tally.cp.status, self.tally.cp.failed_chunks, self.tally.cp.note, self.tally.cp.ended_at) = (d.status, d.failed, d.note, Some(d.at));
                self.phase = Phase::Finished(d.status);
            }
            Commit::Quarantined => {
                (self.tally.cp.status, self.tally.cp.failed_chunks) = (JobStatus::Quarantined, failed);
                self.phase = Phase::Finished(JobStatus::Quarantined);
            }
        }
        if rows_kept {
            self.tally.totals.clear_changed();
        }
        stale
    }
}

/// The checkpoint of a job nothing is known of yet, at `wall`.
pub fn fresh_checkpoint(job_id: &str, wall: String) -> Checkpoint {
    Checkpoint {
        duplicates: None,
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
