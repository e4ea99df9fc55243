//! Taking a job as a state machine, sans-I/O: its lease first, then its checkpoint, read again when it
//! cannot be read until the same document (one ETag) failed twice. It takes the answer to what it
//! asked last and returns what to do next; the driver does each effect (acquire, load, quarantine,
//! give the lease back, keep the job dormant again, remember it finished) and keeps the job it loaded.
//!
//! A dormant job (known from its open marker only) is taken out of the dormant set when its take
//! starts and kept there again when the take ends without the job: a store error, or its lease busy.
//! Busy, it is not loaded again before the lease may have run out, and its partition's listeners keep
//! looking meanwhile. Forgotten, a job whose messages were handed back until a dead owner's lease ran
//! out was nobody's: when those messages reached the dead-letter queue after their last receive, nobody
//! looked there until the hourly safety poll with the scaling agent down (the simulation, seed
//! 228242485: a report 53 min past its bound).
//!
//! A read that fails because the document changed under it (a stale owner finishing, replacing its
//! base part and deleting the old ones) is not corruption: the new document is read instead, three
//! reads at most. Generic over `E`, the driver's error.

use std::time::{Duration, Instant};

use fleet_domain::model::JobStatus;

use crate::expiry::Dormant;

/// Reads of a checkpoint before a take gives up on one that changes on every read.
pub const MAX_READS: u32 = 3;

/// What the driver does next.
#[derive(Debug)]
pub enum Effect<E> {
    /// Acquire the job's lease: answer [`Answer::Ours`], [`Answer::Busy`] or [`Answer::Failed`].
    Acquire,
    /// Load it from its checkpoint with the lease: answer [`Answer::Loaded`], [`Answer::Finished`],
    /// [`Answer::Unreadable`] or [`Answer::Failed`].
    Load,
    /// Quarantine it, its checkpoint (this ETag) unreadable for good, the lease held: answer
    /// [`Answer::Done`] (then the take ends, the job finished), or an error that ends the take as it
    /// is (the lease left to run out).
    Quarantine(E, String),
    /// Give the lease back: answer [`Answer::Done`], whatever became of it.
    Release,
    /// Keep it dormant again, as this says: answer [`Answer::Done`].
    KeepDormant(Dormant),
    /// Remember it finished with this status: answer [`Answer::Done`].
    Remember(JobStatus),
    /// The take is over.
    Taken(Taken<E>),
}

/// How a take ended.
#[derive(Debug)]
pub enum Taken<E> {
    /// Loaded (the driver holds it), this controller's.
    Open,
    /// Finished before (remembered; its lease given back), or quarantined now.
    AlreadyFinished,
    /// Another controller holds it: its messages go back to the queue for this long.
    Busy(Duration),
    /// Not taken for this error.
    Failed(E),
}

/// What the driver found doing the last effect.
#[derive(Debug)]
pub enum Answer<E> {
    /// Nothing done yet: the take starts.
    Start,
    /// Done.
    Done,
    /// The lease is ours.
    Ours,
    /// Another controller holds it: its messages go back for `after`; not loaded again before `at`
    /// plus the longer of that and half the lease's time (`ttl`).
    Busy { after: Duration, ttl: Duration, at: Instant },
    /// Loaded (the driver holds the job).
    Loaded,
    /// Finished before, with this status.
    Finished(JobStatus),
    /// Its checkpoint (this ETag) cannot be read.
    Unreadable(E, String),
    /// The call failed.
    Failed(E),
}

#[derive(Debug, Default)]
enum Stage {
    #[default]
    Start,
    Acquiring,
    Loading,
    /// Giving the lease back, then ending so.
    Releasing,
    /// Keeping the job dormant, then ending so.
    Restoring,
    Remembering,
    Quarantining,
    Over,
}

/// One take of one job.
#[derive(Debug)]
pub struct Take<E> {
    job: String,
    stage: Stage,
    /// What the dormant set knew of the job when the take started.
    dormant: Option<Dormant>,
    /// The ETag of the last document that could not be read.
    failed_at: Option<String>,
    reads: u32,
    /// How the take ends once the lease is given back or the job kept dormant.
    ending: Option<Taken<E>>,
    /// Whether a failed take keeps the job dormant (off only while a mutation test undoes it).
    keeps_dormant: bool,
}

impl<E: std::fmt::Display> Take<E> {
    /// A take of job `job`, which the dormant set knew as `dormant` (taken out of it now).
    pub fn new(job: &str, dormant: Option<Dormant>) -> Take<E> {
        let keeps_dormant = !crate::undo::is(crate::undo::Fix::BusyStaysDormant);
        Take { job: job.to_string(), stage: Stage::Start, dormant, failed_at: None, reads: 0, ending: None, keeps_dormant }
    }

    /// The next effect, given the answer to the last (`Answer::Start` first). `conflict`: the error of
    /// a checkpoint that changed on every read.
    pub fn next(&mut self, answer: Answer<E>, conflict: impl FnOnce() -> E) -> Effect<E> {
        let stage = std::mem::replace(&mut self.stage, Stage::Over);
        match (stage, answer) {
            (Stage::Start, Answer::Start) => {
                self.stage = Stage::Acquiring;
                Effect::Acquire
            }
            (Stage::Acquiring, Answer::Failed(e)) => self.restore(Taken::Failed(e), None),
            (Stage::Acquiring, Answer::Busy { after, ttl, at }) => self.restore(Taken::Busy(after), Some(at + after.max(ttl / 2))),
            (Stage::Acquiring, Answer::Ours) => self.load(),
            (Stage::Loading, Answer::Loaded) => Effect::Taken(Taken::Open),
            (Stage::Loading, Answer::Finished(status)) => {
                self.stage = Stage::Remembering;
                Effect::Remember(status)
            }
            (Stage::Loading, Answer::Unreadable(e, etag)) => {
                if self.failed_at.as_deref() == Some(etag.as_str()) || crate::undo::is(crate::undo::Fix::QuarantineSecondRead) {
                    self.stage = Stage::Quarantining;
                    return Effect::Quarantine(e, etag);
                }
                tracing::warn!(job = %self.job, error = %e, "the job's checkpoint could not be read; reading it again");
                self.failed_at = Some(etag);
                if self.reads < MAX_READS {
                    return self.load();
                }
                self.release(Taken::Failed(conflict()))
            }
            (Stage::Loading, Answer::Failed(e)) => self.release(Taken::Failed(e)),
            (Stage::Quarantining, Answer::Done) => Effect::Taken(Taken::AlreadyFinished),
            (Stage::Quarantining, Answer::Failed(e)) => Effect::Taken(Taken::Failed(e)),
            (Stage::Remembering, Answer::Done) => self.release(Taken::AlreadyFinished),
            (Stage::Releasing, Answer::Done) => match self.ending.take() {
                Some(Taken::AlreadyFinished) => Effect::Taken(Taken::AlreadyFinished),
                Some(ending) => self.restore(ending, None),
                None => unreachable!("a take gives its lease back only to end"),
            },
            (Stage::Restoring, Answer::Done) => Effect::Taken(self.ending.take().expect("a take keeps its job dormant only to end")),
            (stage, answer) => unreachable!("a take at {stage:?} does not take {}", what(&answer)),
        }
    }

    fn load(&mut self) -> Effect<E> {
        self.reads += 1;
        self.stage = Stage::Loading;
        Effect::Load
    }

    /// Gives the lease back, then ends as `ending` (a failure keeps the job dormant first).
    fn release(&mut self, ending: Taken<E>) -> Effect<E> {
        self.ending = Some(ending);
        self.stage = Stage::Releasing;
        Effect::Release
    }

    /// Keeps the job dormant again (not loaded before `not_before`, when given), then ends as
    /// `ending`; ends at once when it was not dormant.
    fn restore(&mut self, ending: Taken<E>, not_before: Option<Instant>) -> Effect<E> {
        match self.dormant.take().filter(|_| self.keeps_dormant) {
            Some(d) => {
                self.ending = Some(ending);
                self.stage = Stage::Restoring;
                Effect::KeepDormant(match not_before {
                    Some(t) => Dormant { not_before: Some(t), ..d },
                    None => d,
                })
            }
            None => Effect::Taken(ending),
        }
    }
}

fn what<E>(answer: &Answer<E>) -> &'static str {
    match answer {
        Answer::Start => "a start",
        Answer::Done => "a done",
        Answer::Ours => "a lease",
        Answer::Busy { .. } => "a busy lease",
        Answer::Loaded => "a load",
        Answer::Finished(_) => "a finished job",
        Answer::Unreadable(..) => "an unreadable checkpoint",
        Answer::Failed(_) => "a failure",
    }
}

#[cfg(test)]
mod tests;
