//! Results held through a store outage. A message whose job cannot be loaded, checkpointed or
//! finished because S3 does not answer (or answers "retry later") is not dropped to come back after its
//! visibility timeout: each receive would spend one of its `maxReceiveCount`, and an outage longer than
//! a few timeouts would push healthy results into the results dead-letter queue. It is held here
//! instead, its visibility extended, and applied again once the store answers: when the store's
//! breaker closes, or after a doubling back-off where there is no breaker. The messages applied to a
//! job since its last checkpoint are held with it when that job is dropped for such a failure (they
//! are applied again to the job reloaded from its last checkpoint: an item already counted is a
//! duplicate).
//!
//! A hold lasts as long as the store is out of reach for this controller. It does not hand its
//! messages to a peer after a lease time any more (issue 43 retired that): a partition's messages
//! reach its owner only, so a peer never receives them, and a controller cut off from S3 cannot
//! renew its membership either: it stops reading its partitions within a lease and hands everything
//! it holds for them back at once (`hand_back_held`), for their next owner. Handed back to its own
//! queue while the owner still owns it (a store that fails one prefix and not the membership's),
//! a held message would only come back to the same controller and spend a receive. A controller
//! whose breaker is open receives nothing, so while it is cut off nobody spends the receives of its
//! partitions (before a breaker opens, calls that hang may cost a receive or two, well within
//! maxReceiveCount).

//!
//! The hold's state and its decisions (which messages, when each is extended, when they are tried
//! again) are the core's (`controller_core::hold`); this file performs them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use controller_core::hold::Retried;
pub use controller_core::hold::HOLD_VISIBILITY;
use fleet_engine::{Kept, Visibility};
use fleet_io::error::Error;
use fleet_io::lock;
use tokio::time::Instant;

use super::item::{parse, Source};
use std::sync::{Arc, Mutex};

use super::batch::Receipt;
use super::job::Job;
use super::reading::Reading;
use super::{Aggregator, Applied};

/// The messages held, and when to try them again.
pub(super) type Hold = controller_core::hold::Hold<Kept, Visibility>;

/// The messages held through a store outage, under one lock, and the partitions read here (whose
/// messages alone are held).
pub struct Holding {
    hold: Mutex<Hold>,
    reading: Arc<Reading>,
}

impl Holding {
    /// Nothing held; messages of the partitions `reading` reads are held.
    pub(super) fn new(reading: Arc<Reading>) -> Holding {
        Holding { hold: Mutex::new(Hold::new(Instant::now().into_std())), reading }
    }

    /// Holds messages that could not be applied or saved for a failure that may pass (the error
    /// says which): their visibility is extended now, and they are applied again later.
    pub(super) fn hold(&self, msgs: Vec<(Source, Kept)>, why: &Error) {
        // A batch that failed after its partition was given up (its handler outlived the stop's
        // grace) is not held by a controller that no longer reads it: back to the queue at once,
        // for the partition's new owner.
        // So is every batch once the controller is stopping (a stop that ends on its deadline hands
        // nothing back after it).
        let gives_back = self.reading.gives_back();
        let (back, msgs): (Vec<_>, Vec<_>) = msgs.into_iter().partition(|(_, k)| !crate::undo::is(crate::undo::Fix::HandBackHeld) && gives_back(k.queue()));
        if !back.is_empty() {
            tracing::info!(messages = back.len(), "messages of a partition given up handed back instead of held");
            for (_, k) in back {
                k.release(Duration::ZERO);
            }
        }
        if msgs.is_empty() {
            return;
        }
        let now = Instant::now();
        for (_, k) in &msgs {
            k.extend(HOLD_VISIBILITY);
        }
        let n = msgs.len();
        let msgs = msgs
            .into_iter()
            .map(|(source, kept)| {
                let job = parse(source, &kept).ok().map(|i| i.job_id().to_string());
                (source, kept, job)
            })
            .collect();
        let held = lock(&self.hold).hold(msgs, now.into_std());
        tracing::warn!(messages = n, held, error = %why, "store unavailable: messages held (visibility kept, no receive spent) until it answers");
    }

    /// Messages held now, in all (`None`) or from one source.
    pub fn held(&self, source: Option<Source>) -> usize {
        lock(&self.hold).held(source)
    }

    /// The jobs that have messages held (nothing is finished for them until those are applied).
    pub(super) fn jobs(&self) -> BTreeSet<String> {
        lock(&self.hold).jobs()
    }

    /// Takes the held messages out of the hold to go back to their queue at once (a stop, or a results
    /// partition given up: the messages of that partition's queues only), so that whoever reads
    /// their queue next applies them instead of waiting out their extended visibility.
    pub fn hand_back(&self, partition: Option<u16>) -> Vec<Kept> {
        if crate::undo::is(crate::undo::Fix::HandBackHeld) {
            return Vec::new();
        }
        let ours = |k: &Kept| partition.is_none_or(|p| self.reading.partition_of(k.queue()) == Some(p));
        let back = lock(&self.hold).hand_back(ours);
        if !back.is_empty() {
            tracing::info!(messages = back.len(), ?partition, "held messages handed back to their queue");
        }
        back
    }

    /// Makes visible at once every message a retry applied whose hold extension has not lapsed:
    /// for a stop whose deadline passed while their job's checkpoint waited on a hung store (a
    /// message deleted or handed back meanwhile is left alone: its completions remember it for
    /// longer than a hold; one checkpointed and not yet deleted comes back as a duplicate).
    /// Without it they stayed invisible for the hold's two minutes, four times a results
    /// visibility (found by the simulation, seed 845127842: the timer's checkpoint hung with the
    /// job, so the stop never reached its last checkpoint).
    pub fn show_retried(&self) {
        if crate::undo::is(crate::undo::Fix::HandBackHeld) {
            return;
        }
        let due = lock(&self.hold).take_unlapsed(Instant::now().into_std());
        if !due.is_empty() {
            tracing::info!(messages = due.len(), "messages applied again after a hold and not yet checkpointed go back to their queue");
        }
        for v in due {
            v.show();
        }
    }

    /// Extends the visibility of held messages that are due (cheap: batched calls on their queues).
    pub fn extend(&self) {
        let mut h = lock(&self.hold);
        for k in h.due_for_extension(Instant::now().into_std()) {
            k.extend(HOLD_VISIBILITY);
        }
    }

    /// Drops a job from memory after a failure, with `also` (messages not applied to it yet): its
    /// messages are held when the failure may pass (applied again to the job reloaded from its last
    /// checkpoint), else left to come back after their visibility timeout.
    pub(super) fn drop_job(&self, loaded: &mut Option<Job>, mut also: Vec<(Source, Kept)>, e: &Error) {
        if let Some(job) = loaded.take() {
            also.extend(job.drop_unsaved());
        }
        if e.is_retryable() {
            self.hold(also, e);
        }
    }

    /// Runs `f` on the hold, under its lock (not to be held across an await).
    fn with<T>(&self, f: impl FnOnce(&mut Hold) -> T) -> T {
        f(&mut lock(&self.hold))
    }
}

impl Aggregator {
    /// The messages held through a store outage.
    pub fn holding(&self) -> &Holding {
        &self.holding
    }

    /// Applies the held messages again when it is time: the store's breaker is closed (at once when it
    /// closes) and the back-off since the last failure has passed. What fails again is held again.
    pub async fn retry_held(&self) -> Applied {
        let breaker_open = self.store.breaker().is_some_and(|b| b.is_open());
        let taken = self.holding.with(|h| h.take_for_retry(Instant::now().into_std(), breaker_open));
        if taken.is_empty() {
            return Applied::default();
        }
        let n = taken.len();
        let extended = Instant::now();
        tracing::info!(messages = n, "applying held messages again");
        // Out of the hold while they are tried (which may wait out several call deadlines): kept
        // invisible for a full hold meanwhile.
        for w in &taken {
            w.handle.extend(HOLD_VISIBILITY);
        }
        // A stop does not wait for a retry that waits on a hung store: it drops it, with these
        // messages out of the hold. Dropped, the retry makes them visible again at once (those
        // completed meanwhile excepted), for whoever reads their queue next, instead of leaving
        // them invisible for the hold's time (found by the simulation).
        let shown_if_dropped =
            ShowOnDrop(if crate::undo::is(crate::undo::Fix::HandBackHeld) { Vec::new() } else { taken.iter().map(|w| w.handle.visibility()).collect() });
        // The retry is the try: jobs turned back for a failure just before are tried now.
        self.memory.with(|r| r.try_all());
        let mut by_source: BTreeMap<Source, Vec<Kept>> = BTreeMap::new();
        for w in taken {
            by_source.entry(w.source).or_default().push(w.handle);
        }
        let mut applied = Applied::default();
        for (source, kept) in by_source {
            let a = self.apply_from(source, kept, Receipt::Held).await;
            applied.delete.extend(a.delete);
            applied.release.extend(a.release);
        }
        let retried = shown_if_dropped.disarm();
        let ended = self.holding.with(|h| h.retry_ended(retried, extended.into_std(), Instant::now().into_std()));
        if let Retried::HeldAgain { held, next_in } = ended {
            tracing::warn!(retried = n, held, next_in_s = next_in.as_secs_f64(), "store still unavailable");
        }
        applied
    }
}

/// Messages made visible again if the retry holding them is dropped before it ends (see
/// `retry_held`).
struct ShowOnDrop(Vec<Visibility>);

impl ShowOnDrop {
    /// The retry ended: nothing is shown; the handles are returned.
    fn disarm(mut self) -> Vec<Visibility> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for ShowOnDrop {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            tracing::info!(messages = self.0.len(), "a retry of held messages was stopped: its messages go back to their queue");
        }
        for v in &self.0 {
            v.show();
        }
    }
}
