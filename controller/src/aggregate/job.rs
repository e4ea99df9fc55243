//! A job as the controller holds it: the core's state machine (`controller_core::job`: what each
//! item does to the job, when it asks to be saved or finished, how it ends, the checkpoint it plans)
//! with this controller's lease on the job beside it. The methods here only give the core what it
//! does not read itself: the instant on tokio's clock (the simulation pauses it), the wall time of
//! the aggregator's clock, a new checkpoint part's name, a written body's digest, and the store's
//! error for a payload that could not be read.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use controller_core::decision::Commit;
use controller_core::finish::{Answer, Effect, Finish};
use controller_core::save::Save;
use fleet_domain::billing::CheckedTotals;
use fleet_domain::model::Checkpoint;
use fleet_domain::requests::RequestCounts;
use fleet_engine::{Kept, Visibility};
use fleet_io::error::{Error, Result};
use tokio::time::Instant;

pub(super) use controller_core::job::{Asker, Next, Phase, Unsaved};

use super::carried::CarriedCalls;
use super::item::{Ready, Source};
use crate::clock::Clock;
use crate::lease::Lease;

/// A job in memory: its state machine, and this controller's lease on it.
pub(super) struct Job {
    core: controller_core::job::Job<Kept>,
    lease: Lease,
    /// The aggregator's clock (a checkpoint's `updated_at`, a decision's time).
    clock: Clock,
    /// Where its calls since its last checkpoint go when it is dropped from memory.
    carried: CarriedCalls,
}

/// What a job loaded here is held with: this controller's lease on it, the aggregator's clock, the
/// count its unsaved messages add to, and where its calls go when it is dropped.
pub(super) struct Held {
    pub(super) lease: Lease,
    pub(super) clock: Clock,
    pub(super) unsaved: Unsaved<Kept>,
    pub(super) carried: CarriedCalls,
}

impl Deref for Job {
    type Target = controller_core::job::Job<Kept>;

    fn deref(&self) -> &Self::Target {
        &self.core
    }
}

impl DerefMut for Job {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.core
    }
}

impl Job {
    /// A job nothing is known of yet (no checkpoint), held as `held` says.
    pub(super) fn new(job_id: &str, held: Held) -> Job {
        let Held { lease, clock, unsaved, carried } = held;
        let core = controller_core::job::Job::new(job_id, Instant::now().into_std(), clock.rfc3339(), unsaved);
        Job { core, lease, clock, carried }.with_carried(None)
    }

    /// A job resumed from its checkpoint `cp` (see `controller_core::job::Job::resume`), whose body's
    /// digest is `loaded`, held as `held` says.
    pub(super) fn resume(cp: Checkpoint, totals: CheckedTotals, etag: Option<String>, news: Instant, loaded: [u8; 32], held: Held) -> Job {
        let Held { lease, clock, unsaved, carried } = held;
        let core = controller_core::job::Job::resume(cp, totals, etag, news.into_std(), Instant::now().into_std(), unsaved);
        Job { core, lease, clock, carried }.with_carried(Some(loaded))
    }

    /// Counts the calls carried for it (made while it was not in memory to take them), less what the
    /// checkpoint it was loaded from (`loaded`: its body's digest) holds already.
    fn with_carried(mut self, loaded: Option<[u8; 32]>) -> Job {
        let taken = self.carried.take(self.core.id(), loaded);
        self.core.count(&taken.count);
        self.core.withdraw(&taken.withdraw);
        self
    }

    /// Counts the calls carried for it since it was loaded (a lease renewed by the timer).
    pub(super) fn take_carried(&mut self) {
        let taken = self.carried.take(self.core.id(), None);
        self.core.count(&taken.count);
    }

    pub(super) fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Applies a batch's items (see the core's `apply_batch`); on a payload S3 could not give yet, the
    /// store's error with the deliveries not applied.
    pub(super) fn apply_batch(&mut self, items: Vec<(Ready, (Source, Kept))>, now: Instant) -> std::result::Result<(), (Error, Vec<(Source, Kept)>)> {
        self.core.apply_batch(items, now.into_std()).map_err(|(e, back)| (e.error, back))
    }

    /// When it last had news.
    pub(super) fn news(&self) -> Instant {
        Instant::from_std(self.core.news())
    }

    /// Its last news is now `at`.
    pub(super) fn heard(&mut self, at: Instant) {
        self.core.heard(at.into_std());
    }

    /// How long the job has had no news at `now` (never counted from before `floor`).
    pub(super) fn quiet_for(&self, now: Instant, floor: Instant) -> Duration {
        self.core.quiet_for(now.into_std(), floor.into_std())
    }

    /// What it asks for at `now`.
    pub(super) fn next(&self, now: Instant, floor: Instant, settle: Duration, asker: Asker) -> Next {
        self.core.next(now.into_std(), floor.into_std(), settle, asker)
    }

    /// The next step of its finish, given the answer to the last (see `controller_core::finish`); its
    /// ending is decided at the aggregator's wall time.
    pub(super) fn finish_step(&mut self, finish: &mut Finish, answer: Answer<Error>) -> Effect<Error> {
        let clock = self.clock;
        finish.next(&mut self.core, answer, || clock.rfc3339())
    }

    /// Plans the checkpoint that commits `commit` (a new part, if one is written, named by a fresh
    /// UUID: a part is never written over).
    pub(super) fn plan(&self, commit: Commit, attributed: &RequestCounts) -> Result<Save> {
        let part_id = || uuid::Uuid::now_v7().simple().to_string();
        self.core.plan(commit, attributed, || self.clock.rfc3339(), part_id).map_err(Error::corrupt)
    }

    /// A checkpoint write of `body`, which attributed `attributed`, failed without saying whether it
    /// landed.
    pub(super) fn write_unconfirmed(&mut self, body: &[u8], attributed: &RequestCounts) {
        self.core.writes_mut().write_unconfirmed(fleet_io::blob::digest(body), attributed);
    }

    /// The checkpoint planned was written (its ETag `etag`): see the core's `saved`.
    pub(super) fn saved(&mut self, save: Save, etag: String) -> Vec<String> {
        self.core.saved(save, etag, Instant::now().into_std())
    }

    /// Handles that make each unsaved message visible again, even once the message itself is gone (a
    /// stop whose last checkpoint does not finish in time).
    pub(super) fn visibility(&self) -> Vec<Visibility> {
        self.core.unsaved().iter().map(Kept::visibility).collect()
    }

    /// Hands it over to the controller that owns it now: its unsaved messages (its calls since its
    /// last checkpoint carried, should it come back here).
    pub(super) fn hand_over(self) -> Vec<Kept> {
        self.carried.keep_dropped(self.core.id(), self.core.writes().carry());
        self.core.hand_over()
    }

    /// Drops it after a failure: its unsaved messages with their queues (its calls since its last
    /// checkpoint carried to its next load).
    pub(super) fn drop_unsaved(self) -> Vec<(Source, Kept)> {
        self.carried.keep_dropped(self.core.id(), self.core.writes().carry());
        self.core.drop_unsaved()
    }

    /// Its messages once it is finished: to delete.
    pub(super) fn done(self) -> Vec<Kept> {
        self.core.done()
    }
}

/// Drops a job from memory that another controller owns now (fenced, or its lease lost): the
/// messages applied to it since its last checkpoint go back to the queue for the owner at once
/// (they may have been kept invisible for minutes by a hold).
pub(super) fn hand_over(loaded: &mut Option<Job>) {
    if let Some(job) = loaded.take() {
        for k in job.hand_over() {
            k.release(super::HAND_BACK);
        }
    }
}
