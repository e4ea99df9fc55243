//! The parts of the state every task of one engine shares ([`crate::Inner`]), grouped by what each
//! guards: the throttle and its two signals ([`Buffer`]), the consumers' wake-ups ([`Wakeups`]), the
//! receipts in hand for the heartbeat ([`InHand`]), stopping and the task sets ([`Lifecycle`]), and
//! what the state endpoint and health checks read ([`Observed`]). Each says who writes it and who
//! reads it; the small operations done on it in many places are its methods.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::events::Stats;
use crate::heartbeat::Heartbeat;
use crate::throttle::Throttle;
use fleet_io::lock;
use fleet_io::queue::{Delivery, QueueDepth};

/// The throttle and the two signals about it. Written by consumers (reserve, push, unreserve), the
/// dispatcher (pop, expire), work tasks (finish, give back) and `set_limits`/`quiesce`; consumers
/// wait on `room`, the dispatcher on `dispatch`.
pub(crate) struct Buffer {
    /// Received messages waiting for a slot, and the slots in use. Written by consumers (push, reserve),
    /// the dispatcher (pop, expire), work tasks (finish) and `set_limits`/`quiesce`.
    pub(crate) throttle: Mutex<Throttle<Delivery>>,
    /// Something may be ready to dispatch: notified by consumers after a push and by work tasks as
    /// they finish; the dispatcher waits on it.
    pub(crate) dispatch: Notify,
    /// Room may have opened in the throttle: notified when slots or reservations are given back;
    /// consumers waiting to receive (`wait_for_room`) wait on it.
    pub(crate) room: Notify,
    /// What polls under way at a stop brought, kept until the last of them ends (see
    /// `consumer::return_at_stop`).
    pub(crate) stop_returns: Mutex<Vec<Delivery>>,
}

impl Buffer {
    pub(crate) fn new(throttle: Throttle<Delivery>) -> Buffer {
        Buffer { throttle: Mutex::new(throttle), dispatch: Notify::new(), room: Notify::new(), stop_returns: Mutex::new(Vec::new()) }
    }

    /// Gives back room reserved for a receive that brought nothing (or less): consumers waiting for
    /// room must hear of it (one waited forever behind a long poll that came back empty).
    pub(crate) fn unreserve(&self, n: usize) {
        lock(&self.throttle).unreserve(n);
        self.room.notify_waiters();
    }

    /// The throttle changed both ways (messages pushed, slots finished, limits changed): the
    /// dispatcher looks for ready messages and consumers waiting for room look again.
    pub(crate) fn changed(&self) {
        self.dispatch.notify_one();
        self.room.notify_waiters();
    }
}

/// Wake-ups of paused and parked consumers. Written by triggers (`follow_triggers`, `Engine::wake`),
/// a retiring decision and stops; read by consumers (`pause`, and before a receive).
pub(crate) struct Wakeups {
    /// Wakes paused and parked consumers: notified by triggers, `wake`, a retiring decision and stops;
    /// consumers wait on it in `pause`.
    pub(crate) wake: Notify,
    /// Wakes so far: a consumer that was receiving when one came does not wait after an empty receive.
    /// Bumped with every `wake` notification; read by consumers before a receive.
    wakes: AtomicU64,
    /// A trigger can reach this engine now (triggers on and the bus subscription live): only then does
    /// an idle main consumer park; otherwise it polls at its back-off cap. Written by the task of
    /// `follow_triggers`; read by consumers.
    triggers_live: AtomicBool,
}

impl Wakeups {
    pub(crate) fn new() -> Wakeups {
        Wakeups { wake: Notify::new(), wakes: AtomicU64::new(0), triggers_live: AtomicBool::new(true) }
    }

    /// A wake: counted (a consumer receiving now does not wait after its receive) and every paused
    /// or parked consumer woken.
    pub(crate) fn wake(&self) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.wake.notify_waiters();
    }

    /// Wakes paused and parked consumers without counting a wake (a stop, a retiring decision, the
    /// bus down at start): each looks again at why it waits.
    pub(crate) fn rouse(&self) {
        self.wake.notify_waiters();
    }

    /// Wakes so far.
    pub(crate) fn count(&self) -> u64 {
        self.wakes.load(Ordering::SeqCst)
    }

    pub(crate) fn triggers_live(&self) -> bool {
        self.triggers_live.load(Ordering::SeqCst)
    }

    pub(crate) fn set_triggers_live(&self, live: bool) {
        self.triggers_live.store(live, Ordering::SeqCst);
    }
}

/// The messages in hand for the visibility heartbeat. Written by consumers (tracked when received),
/// work tasks and completions (untracked when completed, restarted when held); the heartbeat task
/// reads it and waits on `changed`; the state endpoint counts it.
pub(crate) struct InHand {
    /// Receipts in hand and when their visibility must be extended: tracked when received, untracked
    /// when completed; the heartbeat task reads it.
    pub(crate) schedule: Mutex<Heartbeat>,
    /// The heartbeat's schedule changed (a new message in hand): the heartbeat task waits on it.
    pub(crate) changed: Notify,
}

impl InHand {
    pub(crate) fn new(schedule: Heartbeat) -> InHand {
        InHand { schedule: Mutex::new(schedule), changed: Notify::new() }
    }

    /// Messages received at `now`: in hand from now, and the heartbeat task told.
    pub(crate) fn track<'a>(&self, receipts: impl IntoIterator<Item = &'a str>, now: Instant) {
        {
            let mut hb = lock(&self.schedule);
            for r in receipts {
                hb.track(r, now);
            }
        }
        self.changed.notify_one();
    }

    /// A message is no longer in hand.
    pub(crate) fn untrack(&self, receipt: &str) {
        lock(&self.schedule).untrack(receipt);
    }

    /// Messages in hand now.
    pub(crate) fn len(&self) -> usize {
        lock(&self.schedule).len()
    }

    /// No message in hand now.
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.schedule).is_empty()
    }
}

/// Stopping and the engine's tasks. The tokens are cancelled by `quiesce`/`finish` and watched by
/// every loop; the trackers are written by whoever spawns a task and waited on by `quiesce`/`finish`.
pub(crate) struct Lifecycle {
    /// Cancelled by `quiesce`/`finish`: consumers stop receiving, and what a poll under way brings
    /// goes straight back.
    pub(crate) stop_receiving: CancellationToken,
    /// Cancelled by `finish`: the dispatcher and heartbeat end.
    pub(crate) stop_all: CancellationToken,
    /// Consumer tasks; `quiesce` waits for them (their long polls end within the wait).
    pub(crate) consumer_tasks: TaskTracker,
    /// Handler calls and expiries in progress; `quiesce` waits for them within the grace period.
    pub(crate) work_tasks: TaskTracker,
    /// Dispatcher, heartbeat and trigger follower; `finish` waits for them.
    pub(crate) service_tasks: TaskTracker,
}

impl Lifecycle {
    pub(crate) fn new() -> Lifecycle {
        Lifecycle {
            stop_receiving: CancellationToken::new(),
            stop_all: CancellationToken::new(),
            consumer_tasks: TaskTracker::new(),
            work_tasks: TaskTracker::new(),
            service_tasks: TaskTracker::new(),
        }
    }

    /// Receiving has stopped (`quiesce` or `finish`).
    pub(crate) fn stopping(&self) -> bool {
        self.stop_receiving.is_cancelled()
    }
}

/// What the state endpoint, the health checks and tests read: written where things happen (events,
/// work tasks, depth looks), never read back by the engine's own decisions.
pub(crate) struct Observed {
    /// Counters for the state endpoint and tests, bumped where the event happens (by `events`).
    pub(crate) stats: Stats,
    /// Deliveries held for an outage right now: written by work tasks as they start and stop waiting.
    pub(crate) holding: AtomicUsize,
    /// When the engine started (the consumer timeline's origin).
    pub(crate) started: Instant,
    /// The queue's depth at the last look and when it was taken: the state endpoint reports it and
    /// never asks the queue itself (see `state::depth_loop`).
    last_depth: Mutex<Option<(QueueDepth, Instant)>>,
    /// The progress count (receives and completed messages) at the last health check and since when it
    /// has not moved (see `state::Health`).
    pub(crate) progress: Mutex<(u64, Instant)>,
}

impl Observed {
    pub(crate) fn new() -> Observed {
        Observed {
            stats: Stats::default(),
            holding: AtomicUsize::new(0),
            started: Instant::now(),
            last_depth: Mutex::new(None),
            progress: Mutex::new((0, Instant::now())),
        }
    }

    /// Keeps `d` as the last look at the queue's depth (what the state endpoint reports).
    pub(crate) fn note_depth(&self, d: QueueDepth) {
        *lock(&self.last_depth) = Some((d, Instant::now()));
    }

    /// The last look at the queue's depth and when it was taken.
    pub(crate) fn last_depth(&self) -> Option<(QueueDepth, Instant)> {
        *lock(&self.last_depth)
    }

    /// Deliveries held for an outage right now (by work tasks; the handler's own are not here).
    pub(crate) fn holding(&self) -> usize {
        self.holding.load(Ordering::SeqCst)
    }
}
