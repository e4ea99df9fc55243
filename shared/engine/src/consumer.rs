//! The consumer loop (seed 000 with seed 004's back-off): each consumer task reserves room in the
//! throttle, receives up to that many messages with a long poll, hands them to the throttle, and after
//! an empty receive waits, stops or parks as the `QueueEmpty` rule says. The main (oldest) consumer
//! samples activity and scales the consumer set; a work-detected trigger raises it at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::{EmptyContext, EmptyDecision};
use crate::config::{RECEIVE_GRACE, STOP_POLL_MARGIN};
use crate::dynamic_consumers::{decide, Activity, ScaleDecision};
use crate::events::{self, Retired};
use crate::{lock, release, sleep_until, ErrorEvent, Inner};
use fleet_io::breaker::{all_closed, any_open};
use fleet_io::queue::{Delivery, Message};

/// One consumer task's entry in the consumer set.
pub(crate) struct ConsumerSlot {
    /// Busy/idle record of its last receives (seed 000's sample), written by the consumer itself.
    activity: Activity,
    /// Waiting for a trigger after an empty receive (does not count as active).
    pub(crate) parked: bool,
    /// Chosen by the main consumer's sample to stop at the end of its current iteration.
    retiring: bool,
}

/// The consumer set, behind `Inner::consumers`.
pub(crate) struct Consumers {
    next_id: usize,
    /// Consumers by id; the lowest id alive is the main consumer (it samples and never retires).
    pub(crate) list: BTreeMap<usize, ConsumerSlot>,
    /// (time, active consumers) at every change, for the state and benchmarks.
    pub(crate) timeline: Vec<(Instant, usize)>,
}

impl Consumers {
    pub(crate) fn new() -> Consumers {
        Consumers { next_id: 0, list: BTreeMap::new(), timeline: Vec::new() }
    }

    pub(crate) fn active(&self) -> usize {
        self.list.values().filter(|c| !c.parked && !c.retiring).count()
    }

    fn note(&mut self) {
        let n = self.active();
        if self.timeline.last().is_none_or(|&(_, last)| last != n) {
            self.timeline.push((Instant::now(), n));
            if self.timeline.len() > 10_000 {
                self.timeline.drain(..5_000);
            }
        }
    }
}

pub(crate) fn spawn_consumer(inner: &Arc<Inner>) -> Option<usize> {
    if inner.lifecycle.stopping() {
        return None;
    }
    let id = {
        let mut c = lock(&inner.consumers);
        let id = c.next_id;
        c.next_id += 1;
        c.list.insert(id, ConsumerSlot { activity: Activity::new(&inner.cfg.scaling), parked: false, retiring: false });
        c.note();
        id
    };
    inner.lifecycle.consumer_tasks.spawn(consume(inner.clone(), id));
    Some(id)
}

pub(crate) async fn wait_for_room(inner: &Inner) -> Option<usize> {
    loop {
        let notified = inner.buffer.room.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Room must not start a receive once stopping (a returned message was received again at once).
        if inner.lifecycle.stopping() {
            return None;
        }
        let n = lock(&inner.buffer.throttle).reserve(inner.cfg.receive_batch);
        if n > 0 {
            return Some(n);
        }
        tokio::select! {
            biased;
            _ = inner.lifecycle.stop_receiving.cancelled() => return None,
            _ = notified => {}
        }
    }
}

/// Waits `d` (None: until woken). `Some(true)`: woken, also by a wake since `wakes` was read (a trigger
/// that arrived during the receive that came back empty); `Some(false)`: waited; `None`: stopping.
pub(crate) async fn pause(inner: &Inner, d: Option<Duration>, wakes: u64) -> Option<bool> {
    let notified = inner.wakeups.wake.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    if inner.wakeups.count() != wakes {
        return Some(true);
    }
    tokio::select! {
        biased;
        _ = inner.lifecycle.stop_receiving.cancelled() => None,
        _ = notified => Some(true),
        _ = sleep_until(d.map(|d| Instant::now() + d)) => Some(false),
    }
}

pub(crate) async fn consume(inner: Arc<Inner>, id: usize) {
    let mut idle: u32 = 0;
    let mut iterations: u64 = 0;
    let mut error_backoff = Duration::from_millis(100);
    loop {
        if lock(&inner.consumers).list.get(&id).is_none_or(|c| c.retiring) {
            break;
        }
        if any_open(&inner.breakers) {
            // A dependency is down: take nothing new until it answers (the breaker's probe tells).
            set_parked(&inner, id, true);
            events::ConsumerPaused { queue: inner.queue.name(), consumer: id }.emit(&inner.observed.stats);
            let stopped = tokio::select! {
                biased;
                _ = all_closed(&inner.breakers) => false,
                _ = inner.lifecycle.stop_receiving.cancelled() => true,
            };
            set_parked(&inner, id, false);
            if stopped {
                break;
            }
            idle = 0;
            error_backoff = Duration::from_millis(100);
            continue;
        }
        let Some(max) = wait_for_room(&inner).await else {
            break;
        };
        let started = Instant::now();
        let wakes = inner.wakeups.count();
        // A stop does not cut the receive short: the queue would keep serving a poll cut on this side
        // and could hand it messages nobody sees until their visibility timeout (a restart cost a job
        // 30 s). The poll ends within its wait; what it brings goes straight back (see `accept`).
        // A receive that outlives its long poll by far hangs on a dead connection: give up on it, and
        // sooner when stopping (at the poll's end plus a second).
        let limit = inner.cfg.receive_wait + RECEIVE_GRACE;
        let receive = tokio::time::timeout(limit, inner.queue.receive(max as u32, inner.cfg.receive_wait));
        tokio::pin!(receive);
        let answer = tokio::select! {
            biased;
            r = &mut receive => r,
            _ = inner.lifecycle.stop_receiving.cancelled() => {
                let end = started + inner.cfg.receive_wait + STOP_POLL_MARGIN;
                tokio::time::timeout_at(end, receive).await.unwrap_or_else(Err)
            }
        };
        let received = answer.unwrap_or_else(|_| {
            Err(fleet_io::Error::Service {
                service: fleet_io::error::Service::Sqs,
                operation: "ReceiveMessage",
                detail: format!("no answer on queue {} within {} s; abandoned", inner.queue.name(), started.elapsed().as_secs()),
                retryable: true,
                source: None,
            })
        });
        iterations += 1;
        // One look at the consumer set: record this iteration; the main consumer is the oldest alive.
        let (main, alive) = {
            let mut c = lock(&inner.consumers);
            if let (Ok(msgs), Some(slot)) = (&received, c.list.get_mut(&id)) {
                slot.activity.record(!msgs.is_empty());
            }
            (c.list.keys().next() == Some(&id), c.list.values().filter(|s| !s.retiring).count())
        };
        match received {
            Err(e) => {
                inner.buffer.unreserve(max);
                if inner.lifecycle.stopping() {
                    return_at_stop(&inner, Vec::new());
                }
                inner.handler.on_error(ErrorEvent::Receive { error: &e });
                events::ReceiveFailed { queue: inner.queue.name(), consumer: id, error: &e, retry_in: error_backoff }.emit(&inner.observed.stats);
                if pause(&inner, Some(error_backoff), wakes).await.is_none() {
                    break;
                }
                error_backoff = (error_backoff * 2).min(Duration::from_secs(10));
                continue;
            }
            Ok(msgs) => {
                error_backoff = Duration::from_millis(100);
                events::ReceiveDone { queue: inner.queue.name(), consumer: id, messages: msgs.len() }.emit(&inner.observed.stats);
                if !msgs.is_empty() {
                    let was_idle = idle > 0;
                    idle = 0;
                    inner.handler.on_received(&msgs);
                    accept(&inner, msgs, max);
                    if was_idle {
                        work_detected(&inner, None).await;
                    }
                } else {
                    inner.buffer.unreserve(max);
                    if inner.lifecycle.stopping() {
                        return_at_stop(&inner, Vec::new());
                    }
                    idle = idle.saturating_add(1);
                    let ctx = EmptyContext {
                        idle_count: idle,
                        waited: started.elapsed(),
                        main,
                        alive,
                        min_consumers: inner.cfg.scaling.min_consumers,
                        triggers: inner.cfg.triggers && inner.wakeups.triggers_live(),
                    };
                    match inner.handler.queue_empty(&inner.cfg.backoff, ctx) {
                        EmptyDecision::Stop if !main => {
                            events::ConsumerRetired { queue: inner.queue.name(), consumer: id, why: Retired::Idle(idle) }.emit();
                            break;
                        }
                        EmptyDecision::Park | EmptyDecision::Stop => {
                            set_parked(&inner, id, true);
                            events::ConsumerParked { queue: inner.queue.name(), consumer: id }.emit();
                            let woke = pause(&inner, inner.cfg.park_poll, wakes).await;
                            set_parked(&inner, id, false);
                            match woke {
                                None => break,
                                Some(true) => idle = 0,
                                Some(false) => {}
                            }
                        }
                        EmptyDecision::Wait(d) => match pause(&inner, Some(d.saturating_sub(started.elapsed())), wakes).await {
                            None => break,
                            Some(true) => idle = 0,
                            Some(false) => {}
                        },
                    }
                }
            }
        }
        if main && iterations.is_multiple_of(u64::from(inner.cfg.scaling.sample_rate)) {
            sample(&inner);
        }
    }
    let mut c = lock(&inner.consumers);
    c.list.remove(&id);
    c.note();
}

pub(crate) fn set_parked(inner: &Inner, id: usize, parked: bool) {
    let mut c = lock(&inner.consumers);
    if let Some(s) = c.list.get_mut(&id) {
        s.parked = parked;
    }
    c.note();
}

/// The main consumer's scaling check.
pub(crate) fn sample(inner: &Arc<Inner>) {
    let decision = {
        let c = lock(&inner.consumers);
        let main = c.list.keys().next().copied();
        decide(&inner.cfg.scaling, c.list.iter().filter(|(_, s)| !s.retiring && !s.parked).map(|(id, s)| (*id, &s.activity, Some(*id) == main)))
    };
    match decision {
        ScaleDecision::Up => {
            if let Some(id) = spawn_consumer(inner) {
                events::ConsumerAdded { queue: inner.queue.name(), consumer: id }.emit();
            }
        }
        ScaleDecision::Down(id) => {
            let mut c = lock(&inner.consumers);
            if let Some(s) = c.list.get_mut(&id) {
                // It stops at the end of its current iteration: a long poll is never cut for this.
                s.retiring = true;
            }
            c.note();
            drop(c);
            inner.wakeups.rouse();
            events::ConsumerRetired { queue: inner.queue.name(), consumer: id, why: Retired::Sampled }.emit();
        }
        ScaleDecision::Hold => {}
    }
}

/// QueueWorkDetected: raise the consumers at once to the optimal count for the queue depth.
pub(crate) async fn work_detected(inner: &Arc<Inner>, depth: Option<u64>) {
    if inner.lifecycle.stopping() {
        return;
    }
    let depth = match depth {
        Some(d) => d,
        None => match inner.queue.depth().await {
            Ok(d) => {
                inner.observed.note_depth(d);
                d.visible
            }
            Err(e) => {
                events::DepthUnavailable { queue: inner.queue.name(), error: &e }.emit();
                return;
            }
        },
    };
    let target = inner.cfg.scaling.clamp(inner.cfg.work_rules.optimal(depth));
    // Parked consumers count: a wake has just woken them (counting them as idle spawned a second
    // consumer on every trigger that woke a parked engine).
    let active = lock(&inner.consumers).list.values().filter(|c| !c.retiring).count();
    if target > active {
        events::ConsumersRaised { queue: inner.queue.name(), depth, from: active, to: target }.emit();
    }
    for _ in active..target {
        spawn_consumer(inner);
    }
}

/// Returns what polls under way at a stop brought once the last of them has ended, all at once:
/// returned at once, a message was received again by the next of those polls, and returned again,
/// one receive each time, so that a stop of every processor with a dozen polls open pushed healthy
/// work items past maxReceiveCount into the dead-letter queue (the compose scenario `compose stop
/// processor`: chunks received six times within two seconds). Called after each such poll and
/// after each empty or failed one while stopping; the listener's finish returns whatever is left.
pub(crate) fn return_at_stop(inner: &Inner, msgs: Vec<Delivery>) {
    lock(&inner.buffer.stop_returns).extend(msgs);
    if lock(&inner.buffer.throttle).reserved() == 0 {
        return_kept_at_stop(inner);
    }
}

/// Returns everything `return_at_stop` keeps, now.
pub(crate) fn return_kept_at_stop(inner: &Inner) {
    let back = std::mem::take(&mut *lock(&inner.buffer.stop_returns));
    for m in back {
        release(inner, m, Duration::ZERO);
    }
}

pub(crate) fn accept(inner: &Arc<Inner>, msgs: Vec<Delivery>, reserved: usize) {
    let now = Instant::now();
    if inner.lifecycle.stopping() {
        // A poll that was under way at the stop: none of it starts here, all of it goes back.
        inner.buffer.unreserve(reserved);
        events::PollReturned { queue: inner.queue.name(), returned: msgs.len() }.emit();
        return_at_stop(inner, msgs);
        return;
    }
    inner.in_hand.track(msgs.iter().map(|m| m.receipt()), now);
    let mut back = Vec::new();
    {
        let mut t = lock(&inner.buffer.throttle);
        t.unreserve(reserved);
        for m in msgs {
            let group = fifo_group(inner, &m);
            let priority = m.attrs.priority;
            back.extend(t.push(m, priority, group, now));
        }
    }
    for m in back {
        events::Evicted { queue: inner.queue.name(), message_id: &m.id }.emit(&inner.observed.stats);
        inner.handler.on_error(ErrorEvent::Evicted { msg: &m });
        release(inner, m, Duration::ZERO);
    }
    // Something to dispatch; and fewer messages than reserved leave room for another receive.
    inner.buffer.changed();
}

/// The message group that orders a message: only on a FIFO queue.
pub(crate) fn fifo_group(inner: &Inner, m: &Message) -> Option<String> {
    if inner.info.fifo {
        m.attrs.group.clone()
    } else {
        None
    }
}
