//! Every periodic action of the controller in one table: [`Timer`] names each, [`Table`] gives its
//! period (from [`Settings`]), and `spawn` runs one loop per timer, each ended by the stop. The
//! simulation drives this same table (it runs `run_with_clock` itself).
//!
//! Every loop follows the same rules: a tick missed while an action ran late is not made up (the
//! next one is a period after it); a stop ends the loop between actions, and cuts short the action
//! under way only for the timers whose action may wait on a hung store and is done again by the
//! stop ([`Timer::cut_by_stop`]).

use std::sync::Arc;
use std::time::Duration;

use fleet_engine::Engine;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::aggregate::{self, Aggregator, FLUSH_INTERVAL};
use crate::handler::{complete, complete_applied, Notifiers};
use crate::partitions::{rebalance, Ownership, Readers};
use crate::{events, undo, Settings};

/// How often the partitions of jobs waiting here for results are looked at (and how long a job has
/// been quiet before its partition is): a receive per listener a minute while a job waits, instead
/// of an hour's wait for a result that comes back unannounced.
pub const WAITING_LOOK: Duration = Duration::from_secs(60);

/// A periodic action of the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// A balancing round of the results partitions (`partitions`): when the ownership says, a
    /// third of a lease after the last round, sooner after one that failed.
    Balance,
    /// Idle jobs' pending work checkpointed (and its messages deleted), the jobs' leases renewed.
    Flush,
    /// Results held through a store outage applied again.
    RetryHeld,
    /// The visibility of held results extended.
    ExtendHeld,
    /// The partitions of jobs waiting here for results looked at, their listeners parked or not.
    WaitingLook,
    /// Expiry: unsealed jobs abandoned, stalled ones finished `partial`, settled ones finished.
    Expire,
}

impl Timer {
    /// Every timer, in the order they are started.
    pub const ALL: [Timer; 6] = [Timer::Balance, Timer::Flush, Timer::RetryHeld, Timer::ExtendHeld, Timer::WaitingLook, Timer::Expire];

    /// Whether a stop cuts short the action under way: a balancing round and a retry of held results
    /// may wait out a hung store, and the stop does both again (a last round hands the partitions
    /// back; what a retry had in hand comes back after its extended visibility). The others end
    /// their action first.
    pub fn cut_by_stop(self) -> bool {
        matches!(self, Timer::Balance | Timer::RetryHeld)
    }

    /// Whether its first action waits a period (the others act at once: the first balancing round is
    /// made before the timers start, and its next is the ownership's to say).
    fn waits_first(self) -> bool {
        matches!(self, Timer::WaitingLook)
    }
}

/// Each timer's period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    periods: [Duration; Timer::ALL.len()],
}

impl Table {
    /// The periods `settings` give.
    pub fn new(settings: &Settings) -> Table {
        let abandon_after = Duration::from_secs(settings.abandon_after);
        let mut periods = [Duration::ZERO; Timer::ALL.len()];
        for t in Timer::ALL {
            periods[t as usize] = match t {
                // As `Ownership::interval`: the round's own schedule (`Ownership::next_round_at`) rules.
                Timer::Balance => Duration::from_secs(settings.lease_secs) / 3,
                Timer::Flush => FLUSH_INTERVAL,
                // A retry may wait out several call deadlines: on its own timer.
                Timer::RetryHeld => Duration::from_millis(250),
                Timer::ExtendHeld => Duration::from_secs(1),
                Timer::WaitingLook => WAITING_LOOK,
                Timer::Expire => (abandon_after / 10).clamp(Duration::from_millis(200), Duration::from_secs(60)),
            };
        }
        Table { periods }
    }

    /// How often `timer` acts.
    pub fn period(&self, timer: Timer) -> Duration {
        self.periods[timer as usize]
    }
}

/// What the timers act on: the controller's parts.
pub(crate) struct Actions {
    pub(crate) agg: Arc<Aggregator>,
    pub(crate) own: Arc<tokio::sync::Mutex<Ownership>>,
    pub(crate) readers: Arc<tokio::sync::Mutex<Readers>>,
    pub(crate) notifiers: Arc<Notifiers>,
    /// `--abandon-after`.
    pub(crate) abandon_after: Duration,
}

impl Actions {
    /// When `timer` acts next, when its action's own state says (a balancing round: the ownership's
    /// schedule); `None`: a period after its last.
    async fn next_at(&self, timer: Timer) -> Option<Instant> {
        match timer {
            Timer::Balance => Some(self.own.lock().await.next_round_at()),
            _ => None,
        }
    }

    /// Does `timer`'s action once.
    async fn act(&self, timer: Timer) {
        match timer {
            Timer::Balance => rebalance(&self.own, &self.readers, false).await,
            Timer::Flush => {
                complete(self.agg.flush_idle().await);
                self.agg.renew_leases().await;
                events::open_jobs(self.agg.memory().open_jobs());
            }
            Timer::RetryHeld => complete_applied(self.agg.retry_held().await, &self.notifiers),
            Timer::ExtendHeld => self.agg.holding().extend(),
            Timer::WaitingLook => self.look_at_waiting().await,
            Timer::Expire => complete(self.agg.expire(self.abandon_after).await),
        }
    }

    /// A job waiting here for results: its partition's listeners look, parked or not. What it waits
    /// for may come back unannounced (SQS moves a result to the dead-letter queue after its last
    /// receive; with the scaling agent down nobody announces it), and a parked listener would see it
    /// only at its safety poll, an hour later (found by the simulation, seed 608 with a quiet rolling
    /// upgrade and the agent down).
    async fn look_at_waiting(&self) {
        if undo::is(undo::Fix::WaitingLooks) {
            return;
        }
        let waiting = self.agg.waiting(WAITING_LOOK);
        if waiting == aggregate::Waiting::default() {
            return;
        }
        // A balancing round under way (it may wait out a stop's grace) skips this look.
        let Ok(r) = self.readers.try_lock() else { return };
        let engines: Vec<Engine> = r.running.iter().filter(|(p, _)| waiting.any || waiting.partitions.contains(p)).flat_map(|(_, (e, _))| e.clone()).collect();
        drop(r);
        for e in engines {
            // Depth 0: the parked consumer looks once; no depth query, no new consumer.
            e.wake(Some(0)).await;
        }
    }
}

/// Starts one loop per timer of `table` on `tracker`, each ended by `stop`.
pub(crate) fn spawn(tracker: &TaskTracker, table: &Table, actions: &Arc<Actions>, stop: &CancellationToken) {
    for timer in Timer::ALL {
        let (period, actions, stop) = (table.period(timer), actions.clone(), stop.clone());
        tracker.spawn(async move { drive(timer, period, &actions, &stop).await });
    }
}

/// One timer's loop.
async fn drive(timer: Timer, period: Duration, actions: &Actions, stop: &CancellationToken) {
    // Made at the first wait on the period (a timer whose action says when it acts next has none).
    let mut tick: Option<tokio::time::Interval> = None;
    loop {
        match actions.next_at(timer).await {
            Some(at) => tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(at) => {}
            },
            None => {
                let tick = match &mut tick {
                    Some(tick) => tick,
                    None => {
                        let mut first = tokio::time::interval(period);
                        first.set_missed_tick_behavior(MissedTickBehavior::Delay);
                        if timer.waits_first() {
                            first.tick().await;
                        }
                        tick.insert(first)
                    }
                };
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
            }
        }
        if timer.cut_by_stop() {
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                () = actions.act(timer) => {}
            }
        } else {
            actions.act(timer).await;
        }
    }
}
