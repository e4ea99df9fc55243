//! A job's finish as a state machine, sans-I/O: it takes the answer to what it asked last and
//! returns what to do next (renew the lease, write the open marker, read the manifest, commit the
//! ending, write the report, drop the rows), until the job is finished, handed over or quarantined.
//! The driver does each effect and feeds back its answer; the job changes only on an answer (its
//! marker known once written; its phase by the driver's `Job::saved` once a commit is written).
//!
//! Every step is safe to repeat: an effect that fails for another reason than the two the machine
//! answers (fenced, unreadable) leaves the job as it stands, and the next finish starts again from
//! what the job has committed. Generic over `E`, the driver's error that makes a job unreadable
//! (kept for the quarantine's note).
//!
//! The order, and why: (1) the lease is renewed first (a paused owner whose lease lapsed must not
//! write a report); (2) a job finishing before its first checkpoint is marked open (until its purge
//! is recorded, the marker brings the finished job back to a scan should the controller die: the
//! simulation, seed 2225); (3) the manifest its seal was checked against (else read; a stand-in for
//! an abandoned job whose submission never finished); (4) an open job's ending decided
//! ([`Job::decide`]) and committed, rows kept: a fenced write, so only the owner decides, and a
//! controller that loads the job after writes the report of this decision; (5) the report of the
//! committed decision; (6) the rows dropped ([`Commit::Final`]).
//!
//! Between (4) and (5), once per job: its transactions claimed (`crate::claims`), the rows another
//! job billed first taken out of its totals and kept for its report. Only a committed ending claims
//! (its counted chunks are frozen then), so every claim is one its job bills.

use std::sync::Arc;

use fleet_domain::model::{JobStatus, Manifest};

use crate::decision::Commit;
use crate::job::{Job, Phase};

/// What the driver does next.
#[derive(Debug)]
pub enum Effect<E> {
    /// Renew the job's lease; answer [`Answer::Renewed`].
    Renew,
    /// Write its open marker; answer [`Answer::Done`].
    MarkOpen,
    /// Its manifest, from its records or read; answer [`Answer::Manifest`] (none: there is none).
    ReadManifest,
    /// Write the checkpoint that commits this; answer [`Answer::Done`] once the job took it.
    Commit(Commit),
    /// Claim the transactions of its committed ending's counted chunks (`crate::claims`) and settle
    /// what they found on the job (`Job::settle_claims`); answer [`Answer::Done`].
    Claim(Arc<Manifest>),
    /// Write the report of its committed ending with this manifest, unless one is there; answer
    /// [`Answer::Done`].
    Report(Arc<Manifest>),
    /// Another controller owns the job now (its lease lost, or a write fenced): hand it over.
    HandOver,
    /// Its state cannot be read (a step answered it unreadable; none: it was quarantined before and
    /// only its report is left): quarantine it for this.
    Quarantine(Option<E>),
    /// It has no manifest and may not end without one: not finished now.
    NoManifest,
    /// Finished with this status: its marker removed, its lease given back, remembered.
    Finished(JobStatus),
}

/// What the driver found doing the last effect.
#[derive(Debug)]
pub enum Answer<E> {
    /// Nothing done yet: the finish starts.
    Start,
    /// Done.
    Done,
    /// The lease renewed (false: lost).
    Renewed(bool),
    /// The manifest (none: none was written).
    Manifest(Option<Arc<Manifest>>),
    /// A write was fenced: another controller owns the job.
    Fenced,
    /// What the step read or wrote cannot be (the manifest corrupt, a checkpoint that cannot be
    /// planned, anything corrupt in the report's or the final commit's writing).
    Unreadable(E),
}

#[derive(Debug, Default)]
enum Stage {
    #[default]
    Start,
    Renewing,
    Marking,
    Reading,
    Ending(Arc<Manifest>),
    Claiming(Arc<Manifest>),
    Reporting,
    Dropping,
    Over,
}

/// One finish of one job, from its lease's renewal to its last effect.
#[derive(Debug, Default)]
pub struct Finish {
    stage: Stage,
}

impl Finish {
    /// The next effect, given the answer to the last (`Answer::Start` first). `wall`: the time its
    /// ending is decided at (RFC 3339), asked only then.
    pub fn next<H, E>(&mut self, job: &mut Job<H>, answer: Answer<E>, wall: impl FnOnce() -> String) -> Effect<E> {
        let stage = std::mem::replace(&mut self.stage, Stage::Over);
        match (stage, answer) {
            (_, Answer::Fenced) => Effect::HandOver,
            (_, Answer::Unreadable(e)) => Effect::Quarantine(Some(e)),
            (Stage::Start, Answer::Start) => {
                self.stage = Stage::Renewing;
                Effect::Renew
            }
            (Stage::Renewing, Answer::Renewed(false)) => Effect::HandOver,
            // Quarantined already (committed), its report not written: only that is left.
            (Stage::Renewing, Answer::Renewed(true)) if job.phase() == &Phase::Finished(JobStatus::Quarantined) => Effect::Quarantine(None),
            (Stage::Renewing, Answer::Renewed(true)) if job.writes().needs_marker() => {
                self.stage = Stage::Marking;
                Effect::MarkOpen
            }
            (Stage::Renewing, Answer::Renewed(true)) => {
                self.stage = Stage::Reading;
                Effect::ReadManifest
            }
            (Stage::Marking, Answer::Done) => {
                job.writes_mut().marked();
                self.stage = Stage::Reading;
                Effect::ReadManifest
            }
            (Stage::Reading, Answer::Manifest(found)) => {
                // Only an abandoned job may end without one (decided now, or committed so before).
                let Some(manifest) = found.or_else(|| job.stand_in_manifest().map(Arc::new)) else { return Effect::NoManifest };
                if job.is_open() {
                    let decision = job.decide(&manifest, &wall());
                    self.stage = Stage::Ending(manifest);
                    Effect::Commit(Commit::Ending(decision))
                } else {
                    self.claim_or_report(job, manifest)
                }
            }
            (Stage::Ending(manifest), Answer::Done) => self.claim_or_report(job, manifest),
            (Stage::Claiming(manifest), Answer::Done) => {
                self.stage = Stage::Reporting;
                Effect::Report(manifest)
            }
            (Stage::Reporting, Answer::Done) => {
                self.stage = Stage::Dropping;
                Effect::Commit(Commit::Final)
            }
            (Stage::Dropping, Answer::Done) => match job.phase() {
                Phase::Finished(status) => Effect::Finished(*status),
                phase => unreachable!("a final commit leaves the job finished, not {phase:?}"),
            },
            (stage, answer) => unreachable!("a finish at {stage:?} does not take {}", what(&answer)),
        }
    }
}

impl Finish {
    /// A committed ending claims its transactions once (settled in its checkpoint from then on), then
    /// is reported.
    fn claim_or_report<H, E>(&mut self, job: &Job<H>, manifest: Arc<Manifest>) -> Effect<E> {
        if job.tally().duplicates().is_none() && !crate::undo::is(crate::undo::Fix::ClaimsChecked) {
            self.stage = Stage::Claiming(manifest.clone());
            Effect::Claim(manifest)
        } else {
            self.stage = Stage::Reporting;
            Effect::Report(manifest)
        }
    }
}

fn what<E>(answer: &Answer<E>) -> &'static str {
    match answer {
        Answer::Start => "a start",
        Answer::Done => "a done",
        Answer::Renewed(_) => "a renewal",
        Answer::Manifest(_) => "a manifest",
        Answer::Fenced => "a fence",
        Answer::Unreadable(_) => "an unreadable answer",
    }
}

#[cfg(test)]
mod tests;
