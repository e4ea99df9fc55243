//! Deterministic tests of the engine's rules on the in-memory queue under tokio's paused time.

use std::collections::HashMap;

use super::*;
use crate::backoff::RetryBackoff;
use crate::completion::BatchSettings;
use crate::dynamic_consumers::WorkRules;
use fleet_io::call::Op;
use fleet_io::memory::MemoryQueue;
use fleet_io::queue::{Attrs, Outgoing};

struct TestHandler {
    t0: Instant,
    work: Duration,
    /// Extra time for these bodies.
    slow: HashMap<String, Duration>,
    /// Failures still to come per body (u32::MAX: always).
    fail: Mutex<HashMap<String, u32>>,
    /// (start, end, body) of every successful handling.
    handled: Mutex<Vec<(Duration, Duration, String)>>,
    attempts: Mutex<Vec<(Duration, String)>>,
    poisoned: Mutex<Vec<String>>,
    events: Mutex<Vec<String>>,
}

impl TestHandler {
    fn new(work: Duration) -> TestHandler {
        TestHandler {
            t0: Instant::now(),
            work,
            slow: HashMap::new(),
            fail: Mutex::default(),
            handled: Mutex::default(),
            attempts: Mutex::default(),
            poisoned: Mutex::default(),
            events: Mutex::default(),
        }
    }

    fn handled_bodies(&self) -> Vec<String> {
        lock(&self.handled).iter().map(|(_, _, b)| b.clone()).collect()
    }
}

#[async_trait]
impl Handler for TestHandler {
    async fn handle(&self, msgs: Vec<Delivery>, _done: &Completions) -> Vec<(Delivery, Outcome)> {
        let mut out = Vec::new();
        for m in msgs {
            let start = self.t0.elapsed();
            lock(&self.attempts).push((start, m.body.clone()));
            tokio::time::sleep(self.work + self.slow.get(&m.body).copied().unwrap_or_default()).await;
            let fail = {
                let mut f = lock(&self.fail);
                match f.get_mut(&m.body) {
                    Some(n) if *n > 0 => {
                        *n = n.saturating_sub(if *n == u32::MAX { 0 } else { 1 });
                        true
                    }
                    _ => false,
                }
            };
            if fail {
                out.push((m, Outcome::Failed("test failure".into())));
            } else {
                lock(&self.handled).push((start, self.t0.elapsed(), m.body.clone()));
                out.push((m, Outcome::Done));
            }
        }
        out
    }

    async fn on_poison(&self, msg: &Message, _reason: &str) {
        lock(&self.poisoned).push(msg.body.clone());
    }

    fn on_error(&self, event: ErrorEvent<'_>) {
        let e = match event {
            ErrorEvent::Expired { msg, dead_lettered } => format!("expired {} dlq={dead_lettered}", msg.body),
            ErrorEvent::Evicted { msg } => format!("evicted {}", msg.body),
            ErrorEvent::Overdue { .. } => "overdue".to_string(),
            ErrorEvent::Receive { .. } => "receive".to_string(),
        };
        lock(&self.events).push(e);
    }
}

fn cfg() -> EngineConfig {
    EngineConfig {
        scaling: ScalingPolicy { min_consumers: 1, max_consumers: 4, sample_rate: 1, idle_threshold: 3, busy_threshold: 1 },
        backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(1) },
        receive_wait: Duration::ZERO,
        receive_batch: 10,
        work_rules: WorkRules::parse("*:1").unwrap(),
        throttle: ThrottleLimits { max_concurrency: 16, buffer: 20, ttl: None },
        completion: BatchSettings { batch_size: 10, push_interval: Duration::from_millis(50), max_concurrency: 4, max_attempts: 5 },
        retry: RetryBackoff { base: Duration::from_secs(2), max: Duration::from_secs(60) },
        heartbeat: true,
        max_processing: Duration::from_secs(900),
        triggers: false,
        park_poll: None,
    }
}

async fn send(q: &MemoryQueue, bodies: impl IntoIterator<Item = (String, Attrs)>) {
    let msgs: Vec<Outgoing> = bodies.into_iter().map(|(body, attrs)| Outgoing { body, attrs, dedup: None }).collect();
    q.send_messages(&msgs).await.unwrap();
}

fn plain(n: usize) -> Vec<(String, Attrs)> {
    (0..n).map(|i| (format!("m{i:04}"), Attrs::default())).collect()
}

async fn start(q: &Arc<MemoryQueue>, h: &Arc<TestHandler>, cfg: EngineConfig) -> Engine {
    Engine::start(q.clone(), None, h.clone(), cfg).await.unwrap()
}

/// Waits (in paused time) until `f` holds, checking every 10 ms, at most `limit`.
async fn until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

#[tokio::test(start_paused = true)]
async fn a_burst_raises_consumers_to_max_and_idleness_brings_them_back_to_min() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    // Receives take 20 ms and processing has room for 200 at once: receiving is the bottleneck.
    q.set_latency(Duration::from_millis(20));
    let h = Arc::new(TestHandler::new(Duration::from_millis(20)));
    send(&q, plain(2000)).await;
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 200, buffer: 200, ttl: None }, ..cfg() };
    let e = start(&q, &h, c).await;
    let mut peak = 0;
    assert!(
        until(Duration::from_secs(60), || {
            peak = peak.max(e.active_consumers());
            lock(&h.handled).len() == 2000
        })
        .await
    );
    assert_eq!(peak, 4, "scaled up to max and never above: {:?}", e.timeline());
    assert!(until(Duration::from_secs(60), || e.active_consumers() == 1).await, "back to min when idle");
    let tl = e.timeline();
    assert_eq!(tl.first().map(|x| x.1), Some(1));
    assert!(tl.windows(2).all(|w| w[1].1.abs_diff(w[0].1) == 1), "one consumer at a time: {tl:?}");
    assert!(tl.iter().all(|&(_, n)| (1..=4).contains(&n)));
    e.shutdown(Duration::from_secs(5)).await;
    assert!(q.bodies().is_empty(), "every message deleted");
    assert_eq!(h.handled_bodies().len(), 2000, "each handled once");
}

#[tokio::test(start_paused = true)]
async fn work_detected_raises_consumers_to_the_rule_count_at_once() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_millis(20)));
    let c = EngineConfig { work_rules: WorkRules::parse("10:1,100:2,*:3").unwrap(), triggers: true, ..cfg() };
    let e = start(&q, &h, c).await;
    // Idle until the main consumer parks.
    assert!(until(Duration::from_secs(30), || e.active_consumers() == 0).await);
    let receives = e.stats().receives.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), receives, "parked: no requests");
    send(&q, plain(150)).await;
    e.wake(Some(150)).await;
    // The woken main consumer and two more, at once (not a second one for the main).
    assert!(until(Duration::from_millis(10), || e.active_consumers() == 3).await, "150 visible: the rule says 3");
    assert_eq!(e.state().consumers_total, 3);
    assert!(until(Duration::from_secs(30), || lock(&h.handled).len() == 150).await);
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn an_idle_consumer_that_finds_work_raises_the_others() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_millis(500)));
    let c = EngineConfig { work_rules: WorkRules::parse("10:1,*:4").unwrap(), ..cfg() };
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(e.active_consumers(), 1);
    send(&q, plain(100)).await;
    assert!(until(Duration::from_secs(2), || e.active_consumers() == 4).await, "QueueWorkDetected on the first receive after idling");
    e.shutdown(Duration::from_secs(30)).await;
}

#[tokio::test(start_paused = true)]
async fn a_trigger_during_the_receive_that_comes_back_empty_is_not_lost() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    // A 5 s long poll reaches the 1 s cap: the main consumer parks after its first empty receive.
    let c = EngineConfig { receive_wait: Duration::from_secs(5), triggers: true, ..cfg() };
    let e = start(&q, &h, c).await;
    assert!(until(Duration::from_secs(10), || e.stats().receives.load(Ordering::Relaxed) == 1 && e.active_consumers() == 0).await);
    let parked = e.stats().receives.load(Ordering::Relaxed);
    // Woken: it polls again (5 s, empty), alone (the woken consumer is not doubled). A trigger arrives while that receive is under way, about
    // work that the receive did not return (in SQS, e.g., put on another server just as it answered).
    e.wake(None).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    e.wake(None).await;
    tokio::time::sleep(Duration::from_millis(3100)).await;
    // The empty receive ended at 5 s: instead of parking, the consumer is polling again.
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), parked + 1, "one receive after the first wake, one under way");
    assert_eq!(e.active_consumers(), 1, "receiving, not parked");
    assert_eq!(e.state().consumers_total, 1, "the woken consumer was not doubled");
    send(&q, plain(1)).await;
    assert!(until(Duration::from_millis(100), || lock(&h.handled).len() == 1).await, "the new receive finds the work");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn room_given_back_by_an_empty_receive_reaches_a_waiting_consumer() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    // Room for one receive at a time; an idle main consumer parks after one empty 5 s poll.
    let c = EngineConfig {
        receive_wait: Duration::from_secs(5),
        throttle: ThrottleLimits { max_concurrency: 1, buffer: 0, ttl: None },
        work_rules: WorkRules::parse("*:2").unwrap(),
        triggers: true,
        ..cfg()
    };
    let e = start(&q, &h, c).await;
    // Before the main consumer's first receive: a second consumer, which waits for room.
    e.wake(Some(100)).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(e.active_consumers(), 2);
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), 0);
    // At 5 s the main poll comes back empty and the main consumer parks, giving the room back: the
    // waiting consumer takes it at once (it had waited forever) and its poll ends at 10 s.
    tokio::time::sleep(Duration::from_millis(10_040)).await;
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), 2, "at 10.05 s: the main poll (5 s) and the second consumer's (10 s)");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn a_receive_that_never_answers_is_abandoned() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    // Every receive hangs for an hour (a dead connection), until the network comes back.
    q.set_latency(Duration::from_secs(3600));
    let e = start(&q, &h, EngineConfig { receive_wait: Duration::from_secs(5), ..cfg() }).await;
    tokio::time::sleep(Duration::from_secs(14)).await;
    assert!(lock(&h.events).is_empty(), "still within the long poll + 10 s");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(lock(&h.events).clone(), vec!["receive"], "abandoned after 15 s, reported as a receive error");
    q.set_latency(Duration::ZERO);
    send(&q, plain(1)).await;
    assert!(until(Duration::from_secs(20), || lock(&h.handled).len() == 1).await, "the consumer receives again");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn idle_back_off_then_park_makes_zero_requests() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    let c = EngineConfig { backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(2) }, triggers: true, ..cfg() };
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    // Waits ~0.1, 0.3, 0.7, 1.5 s, then the cap (2 s): park on the 5th empty receive.
    let n = e.stats().receives.load(Ordering::Relaxed);
    assert_eq!(n, 5, "receives before parking");
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), n, "zero requests while parked");
    // A trigger wakes it within the same instant.
    send(&q, plain(1)).await;
    e.wake(None).await;
    assert!(until(Duration::from_millis(100), || lock(&h.handled).len() == 1).await, "woken well under 100 ms");
    e.shutdown(Duration::from_secs(5)).await;
}

/// An engine with triggers (2 s idle cap) following an in-memory bus, a minute after its start.
async fn following_a_bus() -> (Arc<MemoryQueue>, Arc<TestHandler>, Engine, Arc<fleet_io::trigger::MemoryTriggers>, CancellationToken) {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    let c = EngineConfig { backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(2) }, triggers: true, ..cfg() };
    let e = start(&q, &h, c).await;
    let bus = fleet_io::trigger::MemoryTriggers::new();
    let stop = CancellationToken::new();
    e.follow_triggers(&bus.subscription(), stop.clone());
    tokio::time::sleep(Duration::from_secs(60)).await;
    (q, h, e, bus, stop)
}

/// A burst of triggers for other queues outruns the follower, and the one for this queue is dropped
/// with them: the parked consumer still wakes at once (a lagged subscription is a possible trigger),
/// not at its safety poll.
#[tokio::test(start_paused = true)]
async fn a_lagged_trigger_subscription_wakes_parked_consumers() {
    let (q, h, e, bus, stop) = following_a_bus().await;
    assert_eq!(e.state().consumers_parked, 1, "parked while a trigger can reach it");
    send(&q, plain(1)).await;
    let ev = |queue: &str| fleet_io::trigger::WorkDetected { queue: queue.into(), messages: 1, source: "test".into() };
    // No await in between: the follower cannot read any of them before the channel overflows.
    let _ = bus.tx.send(ev("work"));
    for _ in 0..400 {
        let _ = bus.tx.send(ev("other"));
    }
    assert!(until(Duration::from_millis(100), || lock(&h.handled).len() == 1).await, "woken by the lag, well before a safety poll");
    stop.cancel();
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn while_the_bus_is_down_no_consumer_parks_and_it_parks_again_once_back() {
    let (q, h, e, bus, stop) = following_a_bus().await;
    let parked = e.stats().receives.load(Ordering::Relaxed);
    assert!(e.triggers_live());
    assert_eq!(e.state().consumers_parked, 1, "parked while a trigger can reach it");
    // The broker goes away: the parked consumer is woken and polls at its 2 s cap.
    bus.live.send_replace(false);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let polled = e.stats().receives.load(Ordering::Relaxed) - parked;
    assert!((25..=35).contains(&polled), "{polled} receives in 60 s at the 2 s cap");
    assert_eq!(e.state().consumers_parked, 0);
    assert!(!e.triggers_live());
    // Work put meanwhile, with a trigger that is lost: the polling finds it.
    send(&q, plain(1)).await;
    assert!(until(Duration::from_secs(3), || lock(&h.handled).len() == 1).await, "found by polling within the cap");
    // Back: one poll for what a lost trigger announced, then parked again, zero requests.
    send(&q, plain(1)).await;
    bus.live.send_replace(true);
    assert!(until(Duration::from_millis(100), || lock(&h.handled).len() == 2).await, "a poll at once when the bus is back");
    // Publishers may still be in their reconnect back-off: polling goes on for the grace period.
    let back = e.stats().receives.load(Ordering::Relaxed);
    tokio::time::sleep(crate::trigger::REJOIN_GRACE - Duration::from_secs(5)).await;
    assert!(e.stats().receives.load(Ordering::Relaxed) - back >= 10, "polling during the grace after the bus came back");
    assert_eq!(e.state().consumers_parked, 0);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let n = e.stats().receives.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), n, "parked again once the bus is back");
    stop.cancel();
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn without_triggers_the_main_consumer_polls_at_the_cap_and_long_polls_count_as_idle_time() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    let c = EngineConfig { backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(2) }, ..cfg() };
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let n = e.stats().receives.load(Ordering::Relaxed);
    // ~2.6 s to reach the cap, then one receive per 2 s: about 30 in a minute.
    assert!((29..=33).contains(&n), "{n} receives");
    e.shutdown(Duration::from_secs(5)).await;
    // With a 20 s long poll the back-off (capped at 10 s) is absorbed by the wait: 3 receives a minute.
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    let c =
        EngineConfig { receive_wait: Duration::from_secs(20), backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(10) }, ..cfg() };
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(121)).await;
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), 6, "receives at 0, 20, ..., 100 s");
    e.shutdown(Duration::from_secs(25)).await;
}

#[tokio::test(start_paused = true)]
async fn a_stop_lets_the_long_poll_end_and_returns_what_it_brings_at_once() {
    // SQS keeps serving a poll cut on the client side: a message it hands to that dead poll stays
    // invisible for its timeout (30 s). A stop therefore lets the poll end and returns its catch.
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    let c = EngineConfig { receive_wait: Duration::from_secs(20), ..cfg() };
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = Instant::now();
    let stop = tokio::spawn({
        let e = e.clone();
        async move { e.shutdown(Duration::from_secs(30)).await }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!stop.is_finished(), "the poll under way is not cut");
    send(&q, plain(1)).await;
    stop.await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(6), "the poll ended with the message: {:?}", t.elapsed());
    assert!(h.handled_bodies().is_empty(), "nothing starts after a stop");
    assert_eq!((q.bodies().len(), q.in_flight()), (1, 0), "the message is visible again at once");

    // An empty poll ends with its wait; the whole stop stays within the grace period.
    let e = start(&q, &h, EngineConfig { receive_wait: Duration::from_secs(20), ..cfg() }).await;
    assert!(until(Duration::from_secs(5), || h.handled_bodies().len() == 1).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = Instant::now();
    e.shutdown(Duration::from_secs(30)).await;
    assert!(t.elapsed() <= Duration::from_secs(20), "{:?}", t.elapsed());
    let e = start(&q, &h, EngineConfig { receive_wait: Duration::from_secs(20), ..cfg() }).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = Instant::now();
    e.shutdown(Duration::from_secs(3)).await;
    assert!(t.elapsed() <= Duration::from_secs(3), "bounded by the grace: {:?}", t.elapsed());
}

#[tokio::test(start_paused = true)]
async fn lowering_the_buffer_returns_the_lowest_priority_messages_to_the_queue() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(10)));
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 1, buffer: 4, ttl: None }, ..cfg() };
    let prio = |p: i32| Attrs { priority: p, ..Attrs::default() };
    send(&q, [("first".to_string(), prio(0))]).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    send(&q, [("p1".into(), prio(1)), ("p5".into(), prio(5)), ("p3".into(), prio(3)), ("p0".into(), prio(0))]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(e.state().buffer_len, 4);
    assert_eq!(q.in_flight(), 5);
    let limits = e.set_limits(&LimitsChange { buffer: Some(2), ..Default::default() });
    assert_eq!(limits.buffer, 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(q.in_flight(), 3, "two returned to the queue at once (visibility 0)");
    // The two lowest (p1, p0) were returned; they come back behind p5 and p3.
    assert!(until(Duration::from_secs(120), || lock(&h.handled).len() == 5).await);
    assert_eq!(h.handled_bodies(), vec!["first", "p5", "p3", "p1", "p0"]);
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn priorities_order_processing_and_buffer_zero_receives_only_free_capacity() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(1)));
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 2, buffer: 0, ttl: None }, ..cfg() };
    let prio = |p: i32| Attrs { priority: p, ..Attrs::default() };
    send(&q, (0..6).map(|i| (format!("m{i}"), prio(i)))).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(q.in_flight(), 2, "nothing received beyond the two free slots");
    let s = e.state();
    assert_eq!((s.concurrency_in_use, s.concurrency_limit, s.buffer_len), (2, 2, 0));
    e.shutdown(Duration::from_secs(10)).await;
    // With a buffer, the highest priority of what was received goes first.
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(1)));
    send(&q, (0..6).map(|i| (format!("m{i}"), prio(i)))).await;
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 1, buffer: 10, ttl: None }, ..cfg() };
    let e = start(&q, &h, c).await;
    assert!(until(Duration::from_secs(30), || lock(&h.handled).len() == 6).await);
    // m0 started before the others were buffered (one receive delivers all six here, so the first
    // popped is the highest).
    assert_eq!(h.handled_bodies(), vec!["m5", "m4", "m3", "m2", "m1", "m0"]);
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn expired_messages_go_back_or_to_the_dead_letter_queue_past_their_deadline() {
    let q = MemoryQueue::new("work", Duration::from_secs(60));
    let dlq = MemoryQueue::new("work-dlq", Duration::from_secs(60));
    let h = Arc::new(TestHandler::new(Duration::from_secs(5)));
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 1, buffer: 5, ttl: Some(Duration::from_secs(1)) }, ..cfg() };
    send(&q, [("busy".to_string(), Attrs { priority: 9, ..Attrs::default() })]).await;
    send(&q, [("late".to_string(), Attrs { deadline_ms: Some(1), ..Attrs::default() }), ("keep".into(), Attrs::default())]).await;
    let e = Engine::start(q.clone(), Some(dlq.clone()), h.clone(), c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut events = lock(&h.events).clone();
    events.sort();
    assert_eq!(events, vec!["expired keep dlq=false", "expired late dlq=true"]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(dlq.bodies(), vec!["late"]);
    let got = dlq.receive(1, Duration::ZERO).await.unwrap();
    assert_eq!(got[0].attrs.reason.as_deref(), Some("expired"));
    assert_eq!(e.stats().expired.load(Ordering::Relaxed), 2);
    // "keep" went back to the queue and is received again; "late" is gone from the work queue.
    assert!(!q.bodies().contains(&"late".to_string()));
    // Raising the TTL lets "keep" wait its turn.
    e.set_limits(&LimitsChange { ttl_ms: Some(60_000), ..Default::default() });
    assert!(until(Duration::from_secs(30), || h.handled_bodies().contains(&"keep".to_string())).await);
    e.shutdown(Duration::from_secs(10)).await;
}

#[tokio::test(start_paused = true)]
async fn heartbeat_keeps_a_slow_message_invisible_until_done() {
    let q = MemoryQueue::new("work", Duration::from_secs(10));
    let mut th = TestHandler::new(Duration::from_millis(10));
    th.slow.insert("slow".into(), Duration::from_secs(35));
    let h = Arc::new(th);
    let c = EngineConfig { scaling: ScalingPolicy { min_consumers: 2, ..cfg().scaling }, ..cfg() };
    send(&q, [("slow".to_string(), Attrs::default())]).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(lock(&h.attempts).len(), 1, "never redelivered while in hand");
    assert_eq!(h.handled_bodies(), vec!["slow"]);
    // Extended at 5, 10, 15, 20, 25, 30 s (half of the 10 s timeout each time).
    assert_eq!(e.stats().extended.load(Ordering::Relaxed), 7);
    assert!(q.bodies().is_empty());
    let calls = q.calls().snapshot();
    // The last extension, still waiting in its batcher when the message was deleted, is not sent.
    assert!(calls.calls(Op::SqsChangeMessageVisibilityBatch) >= 6);
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn heartbeat_stops_at_the_maximum_processing_time() {
    let q = MemoryQueue::new("work", Duration::from_secs(10));
    let mut th = TestHandler::new(Duration::ZERO);
    th.slow.insert("stuck".into(), Duration::from_secs(100));
    let h = Arc::new(th);
    let c = EngineConfig { max_processing: Duration::from_secs(20), ..cfg() };
    send(&q, [("stuck".to_string(), Attrs::default())]).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_secs(35)).await;
    assert_eq!(lock(&h.events).clone(), vec!["overdue"]);
    assert_eq!(lock(&h.attempts).len(), 2, "let go after 20 s: redelivered after its timeout");
    e.quiesce(Duration::ZERO).await;
    e.finish(false).await;
}

#[tokio::test(start_paused = true)]
async fn failed_messages_back_off_by_receive_count_and_poison_reaches_the_dlq() {
    let dlq = MemoryQueue::new("work-dlq", Duration::from_secs(30));
    let q = MemoryQueue::with_dlq("work", Duration::from_secs(30), 3, dlq.clone());
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    lock(&h.fail).insert("flaky".into(), 2);
    lock(&h.fail).insert("poison".into(), u32::MAX);
    send(&q, [("flaky".to_string(), Attrs::default()), ("poison".into(), Attrs::default())]).await;
    let e = start(&q, &h, cfg()).await;
    assert!(until(Duration::from_secs(30), || h.handled_bodies() == vec!["flaky"]).await);
    let flaky: Vec<u64> = lock(&h.attempts).iter().filter(|(_, b)| b == "flaky").map(|(t, _)| t.as_millis() as u64 / 100).collect();
    // Receives 1, 2, 3 at 0 s, +2 s, +4 s (retry delays 2 s then 4 s; +1 tick of the idle back-off).
    assert_eq!(flaky.len(), 3);
    // The idle consumer polls at least every max_idle (1 s), so each retry is seen within 1 s.
    assert!((20..=31).contains(&(flaky[1] - flaky[0])) && (40..=51).contains(&(flaky[2] - flaky[1])), "{flaky:?}");
    assert!(until(Duration::from_secs(30), || dlq.bodies() == vec!["poison"]).await);
    assert_eq!(lock(&h.poisoned).clone(), vec!["poison"], "the hook ran on the last allowed receive only");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn fifo_groups_are_processed_one_at_a_time_in_order() {
    let q = MemoryQueue::new("work.fifo", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_millis(100)));
    lock(&h.fail).insert("a2".into(), 1);
    let g = |s: &str| Attrs { group: Some(s.to_string()), ..Attrs::default() };
    let mut msgs = Vec::new();
    for i in 1..=5 {
        msgs.push((format!("a{i}"), g("a")));
        msgs.push((format!("b{i}"), g("b")));
        msgs.push((format!("c{i}"), g("c")));
    }
    send(&q, msgs).await;
    let e = start(&q, &h, cfg()).await;
    assert!(until(Duration::from_secs(60), || lock(&h.handled).len() == 15).await);
    let handled = lock(&h.handled).clone();
    for group in ["a", "b", "c"] {
        let mine: Vec<&(Duration, Duration, String)> = handled.iter().filter(|(_, _, b)| b.starts_with(group)).collect();
        let order: Vec<&str> = mine.iter().map(|(_, _, b)| b.as_str()).collect();
        assert_eq!(order, (1..=5).map(|i| format!("{group}{i}")).collect::<Vec<_>>(), "group {group}");
        assert!(mine.windows(2).all(|w| w[1].0 >= w[0].1), "group {group} overlapped: {mine:?}");
    }
    // Groups ran in parallel: b and c were done before a2's retry (2 s after its failure) began. How
    // soon exactly depends on the idle back-off's random jitter between receives, so no tighter bound.
    let end = |b: &str| handled.iter().find(|x| x.2 == b).map(|x| x.1).unwrap();
    let a2: Vec<Duration> = lock(&h.attempts).iter().filter(|(_, b)| b == "a2").map(|(t, _)| *t).collect();
    assert_eq!(a2.len(), 2, "a2 failed once, then succeeded: {a2:?}");
    assert!(a2[1] - a2[0] >= Duration::from_secs(2), "a2's retry waited its back-off: {a2:?}");
    for g in ["b5", "c5"] {
        assert!(end(g) < a2[1], "{g} ended at {:?}, after a2's retry began at {:?}", end(g), a2[1]);
    }
    assert!(end("a5") > a2[1], "a3..a5 waited for a2's retry");
    // Each handling is observed in the histogram (other tests may add to the same queue name).
    let m = http::render_metrics(&[e.state()]);
    let count = m
        .lines()
        .find_map(|l| l.strip_prefix("listener_handling_seconds_count{queue=\"work.fifo\"} "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no handling histogram: {m}"));
    assert!(count >= 16, "15 handled and one failure: {count}");
    assert!(m.contains("# TYPE listener_handling_seconds histogram"), "{m}");
    e.shutdown(Duration::from_secs(5)).await;
}

/// A poison message at the head of a FIFO group (found by the fleet simulation: given back with each
/// retry, the group's later messages spent a receive every time and the redrive dead-lettered them
/// with it). Retried in place, then dead-lettered by the listener: only it reaches the dead-letter
/// queue; the rest of its group follows in order, each received once.
#[tokio::test(start_paused = true)]
async fn a_poison_message_does_not_take_its_fifo_group_to_the_dead_letter_queue() {
    let dlq = MemoryQueue::new("work-dlq.fifo", Duration::from_secs(30));
    let q = MemoryQueue::with_dlq("work.fifo", Duration::from_secs(30), 3, dlq.clone());
    let h = Arc::new(TestHandler::new(Duration::from_millis(100)));
    lock(&h.fail).insert("a1".into(), u32::MAX);
    lock(&h.fail).insert("a3".into(), 1);
    let g = |s: &str| Attrs { group: Some(s.to_string()), ..Attrs::default() };
    send(&q, (1..=5).map(|i| (format!("a{i}"), g("a"))).chain((1..=3).map(|i| (format!("b{i}"), g("b"))))).await;
    let e = Engine::start(q.clone(), Some(dlq.clone()), h.clone(), cfg()).await.unwrap();
    assert!(until(Duration::from_secs(120), || lock(&h.handled).len() == 7).await, "handled: {:?}", h.handled_bodies());
    let handled: Vec<String> = h.handled_bodies().into_iter().filter(|b| b.starts_with('a')).collect();
    assert_eq!(handled, ["a2", "a3", "a4", "a5"], "the group went on in order after its poison message");
    let attempts: Vec<Duration> = lock(&h.attempts).iter().filter(|(_, b)| b == "a1").map(|(t, _)| *t).collect();
    assert_eq!(attempts.len(), 3, "a1 tried as often as the redrive allows: {attempts:?}");
    assert!(attempts[1] - attempts[0] >= Duration::from_secs(2) && attempts[2] - attempts[1] >= Duration::from_secs(4), "with back-off: {attempts:?}");
    assert_eq!(lock(&h.poisoned).clone(), ["a1"]);
    assert!(until(Duration::from_secs(5), || q.bodies().is_empty()).await, "left: {:?}", q.bodies());
    assert_eq!(dlq.bodies(), ["a1"], "only the poison message is dead-lettered");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn drain_returns_buffered_finishes_in_flight_and_flushes_deletes() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(2)));
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 1, buffer: 5, ttl: None }, receive_wait: Duration::from_secs(20), ..cfg() };
    send(&q, plain(6)).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(q.in_flight(), 6);
    let t = Instant::now();
    assert!(e.quiesce(Duration::from_secs(10)).await);
    assert!(t.elapsed() >= Duration::from_millis(1900) && t.elapsed() < Duration::from_secs(3), "waited for the message in progress only");
    e.finish(true).await;
    assert_eq!(h.handled_bodies(), vec!["m0000"]);
    assert_eq!(q.bodies().len(), 5, "the finished one was deleted");
    assert_eq!(q.in_flight(), 0, "buffered ones are visible again at once");

    // Without drain, the pending delete is dropped: the message comes back after its timeout.
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(2)));
    send(&q, plain(1)).await;
    let c = EngineConfig { completion: BatchSettings { push_interval: Duration::from_secs(5), ..cfg().completion }, ..cfg() };
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(h.handled_bodies().len(), 1);
    e.quiesce(Duration::from_secs(1)).await;
    e.finish(false).await;
    assert_eq!(q.bodies().len(), 1, "not deleted");
}

#[tokio::test(start_paused = true)]
async fn deletes_are_batched_by_ten() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    send(&q, plain(95)).await;
    let e = start(&q, &h, cfg()).await;
    assert!(until(Duration::from_secs(10), || q.bodies().is_empty()).await);
    let calls = q.calls().snapshot();
    assert_eq!(calls.calls(Op::SqsDeleteMessageBatch), 10, "95 deletes in 10 calls: {calls:?}");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn failed_delete_entries_are_retried() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    q.fail_next_entries(3);
    send(&q, plain(10)).await;
    let e = start(&q, &h, cfg()).await;
    assert!(until(Duration::from_secs(10), || q.bodies().is_empty()).await);
    assert_eq!(h.handled_bodies().len(), 10, "deleted without redelivery");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn state_reports_consumers_concurrency_and_buffer_and_metrics_render() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(60)));
    let c = EngineConfig {
        throttle: ThrottleLimits { max_concurrency: 2, buffer: 3, ttl: Some(Duration::from_secs(60)) },
        scaling: ScalingPolicy { max_consumers: 1, ..cfg().scaling },
        ..cfg()
    };
    send(&q, plain(10)).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Reading the state asks the queue nothing: before the first look there is no depth.
    for _ in 0..5 {
        let s = e.state();
        assert_eq!((s.depth, s.depth_age_ms), (None, None));
        let m = http::render_metrics(&[s]);
        // An unknown depth is left out, not made up.
        assert!(!m.contains("listener_queue_visible{") && !m.contains(" -1"), "{m}");
    }
    assert_eq!(q.calls().snapshot().calls(Op::SqsGetQueueAttributes), 0, "a state read made a request");
    // While the listener receives, the depth is looked at every DEPTH_REFRESH.
    tokio::time::sleep(crate::state::DEPTH_REFRESH).await;
    let s = e.state();
    assert_eq!(q.calls().snapshot().calls(Op::SqsGetQueueAttributes), 1);
    assert!(s.depth_age_ms.is_some_and(|a| a < 1000), "{:?}", s.depth_age_ms);
    assert_eq!(s.queue, "work");
    assert_eq!(s.depth, Some(fleet_io::queue::QueueDepth { visible: 5, in_flight: 5, delayed: 0 }));
    assert_eq!((s.concurrency_in_use, s.concurrency_limit, s.buffer_len, s.buffer_capacity, s.ttl_ms), (2, 2, 3, 3, 60_000));
    assert_eq!((s.consumers_active, s.consumers_total, s.consumers_min, s.consumers_max), (1, 1, 1, 1));
    assert_eq!(s.in_hand, 5);
    let m = http::render_metrics(&[s]);
    assert!(m.contains("listener_concurrency_in_use{queue=\"work\"} 2"), "{m}");
    assert!(m.contains("listener_buffer_capacity{queue=\"work\"} 3"), "{m}");
    assert!(m.contains("listener_received_total{queue=\"work\"} 5"), "{m}");
    assert!(m.contains("listener_queue_visible{queue=\"work\"} 5"), "{m}");
    // OpenMetrics: build info on every service, the closing `# EOF`.
    assert!(m.contains("# TYPE fleet_build_info gauge") && m.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))), "{m}");
    assert!(m.trim_end().ends_with("# EOF"), "{m}");
    e.quiesce(Duration::ZERO).await;
    e.finish(false).await;
}

#[tokio::test(start_paused = true)]
async fn after_a_burst_one_empty_long_poll_stops_surplus_consumers_and_parks_the_main_one() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_millis(10)));
    let c = EngineConfig {
        receive_wait: Duration::from_secs(20),
        backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(10) },
        work_rules: WorkRules::parse("*:4").unwrap(),
        triggers: true,
        ..cfg()
    };
    let e = start(&q, &h, c).await;
    send(&q, plain(50)).await;
    e.wake(Some(50)).await;
    assert_eq!(e.active_consumers(), 4);
    assert!(until(Duration::from_secs(5), || lock(&h.handled).len() == 50).await);
    // Every consumer's next poll waits the full 20 s and comes back empty: that is a whole idle cycle.
    assert!(until(Duration::from_secs(21), || e.active_consumers() == 0).await, "timeline {:?}", e.timeline());
    assert_eq!(e.state().consumers_total, 1, "only the parked main consumer is left");
    let n = e.stats().receives.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(e.stats().receives.load(Ordering::Relaxed), n, "zero requests while idle");
    e.shutdown(Duration::from_secs(5)).await;
}

/// Sends one HTTP/1.0 request and returns the whole response.
async fn http_request(addr: std::net::SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{body}", body.len());
    // A refused request's body may be left unread and its connection reset: what was answered counts.
    let _ = s.write_all(req.as_bytes()).await;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

fn status(r: &str) -> u16 {
    r.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// PUT /throttle is on the admin endpoint only, with the bearer token: without it 401 and nothing
/// changes; absurd limits are a 400 naming the field, and change nothing. The state endpoint is read-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttle_changes_need_the_admin_token_and_absurd_limits_are_refused_with_400() {
    let q = MemoryQueue::new("q", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::ZERO));
    let e = start(&q, &h, cfg()).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let token = crate::admin::AdminToken::parse("s3cret-token-0123456789").unwrap();
    let state = http::serve("127.0.0.1:0".parse().unwrap(), vec![e.clone()], stop.clone()).await.unwrap();
    let admin = http::serve_admin("127.0.0.1:0".parse().unwrap(), vec![e.clone()], token, stop.clone()).await.unwrap();
    let auth = "Authorization: Bearer s3cret-token-0123456789\r\n";
    let before = e.limits();
    let r = http_request(state, "PUT", "/throttle", auth, r#"{"max_concurrency":1}"#).await;
    assert!(matches!(status(&r), 404 | 405), "the state endpoint takes no changes: {r}");
    for headers in ["", "Authorization: Bearer wrong-token-0123456789\r\n", "Authorization: Basic czNjcmV0\r\n"] {
        let r = http_request(admin, "PUT", "/throttle", headers, r#"{"max_concurrency":1,"buffer":100000,"ttl_ms":1}"#).await;
        assert_eq!(status(&r), 401, "{headers}: {r}");
        assert!(r.to_ascii_lowercase().contains("www-authenticate: bearer"), "{r}");
    }
    assert_eq!(e.limits(), before, "nothing changed without the token");
    // Without the token a large body is refused from its headers (401, not read); with it, a body
    // past the limit is refused too (413).
    let big = format!(r#"{{"max_concurrency":1,"pad":"{}"}}"#, "x".repeat(16_000));
    assert_eq!(status(&http_request(admin, "PUT", "/throttle", "", &big).await), 401);
    assert_eq!(status(&http_request(admin, "PUT", "/throttle", auth, &big).await), 413);
    assert_eq!(e.limits(), before, "nothing changed");
    for (body, field) in [
        (r#"{"max_concurrency":18446744073709551615}"#, "max_concurrency"),
        (r#"{"max_concurrency":0}"#, "max_concurrency"),
        (r#"{"buffer":1000000000000}"#, "buffer"),
        (r#"{"ttl_ms":18446744073709551615}"#, "ttl_ms"),
    ] {
        let r = http_request(admin, "PUT", "/throttle", auth, body).await;
        assert_eq!(status(&r), 400, "{body}: {r}");
        assert!(r.contains(field), "{body}: {r}");
    }
    assert_eq!(e.limits(), before, "nothing changed");
    let r = http_request(admin, "PUT", "/throttle", auth, r#"{"max_concurrency":3,"ttl_ms":5000}"#).await;
    assert_eq!(status(&r), 200, "{r}");
    assert_eq!(e.limits().max_concurrency, 3);
    // Reads stay open; probes answer from the engine's own state.
    for path in ["/state", "/state?depth=false", "/metrics", "/healthz", "/livez", "/readyz"] {
        let r = http_request(state, "GET", path, "", "").await;
        assert_eq!(status(&r), 200, "{path}: {r}");
    }
    let r = http_request(state, "GET", "/metrics", "", "").await;
    assert!(r.to_ascii_lowercase().contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"), "{r}");
    assert_eq!(q.calls().snapshot().calls(Op::SqsGetQueueAttributes), 0, "a scrape asked the queue");
    stop.cancel();
    e.shutdown(Duration::from_secs(5)).await;
}

/// Liveness fails when a listener makes no progress past its bound (here its only slot is taken by a
/// handler that never returns), and the reason says so.
#[tokio::test(start_paused = true)]
async fn liveness_catches_a_stuck_listener() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let h = Arc::new(TestHandler::new(Duration::from_secs(1_000_000)));
    let c = EngineConfig { throttle: ThrottleLimits { max_concurrency: 1, buffer: 0, ttl: None }, max_processing: Duration::from_secs(60), ..cfg() };
    send(&q, plain(2)).await;
    let e = start(&q, &h, c).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let ok = e.health();
    assert!(ok.ready && ok.live, "{ok:?}");
    assert_eq!(e.stall_bound(true), Duration::from_secs(90), "with work in hand: max processing + slack");
    assert_eq!(e.stall_bound(false), Duration::from_secs(41), "receive wait 0 + grace 10 + idle cap 1 + slack 30");
    // Within max processing the busy slot is progress enough ...
    tokio::time::sleep(Duration::from_secs(55)).await;
    assert!(e.health().live, "not yet past the bound: {:?}", e.health());
    // ... past it the message is given up on (no longer in hand), and the quiet is far beyond a turn.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let stuck = e.health();
    assert!(!stuck.live && stuck.ready, "{stuck:?}");
    assert!(stuck.reasons.iter().any(|r| r.contains("no progress")), "{stuck:?}");
    e.quiesce(Duration::ZERO).await;
    e.finish(false).await;
}

/// Keeps every delivery and completes it later on its own (as the controller does after a checkpoint):
/// deleting the first half, releasing the second.
struct Keeper {
    kept: Mutex<Vec<Kept>>,
}

#[async_trait]
impl Handler for Keeper {
    fn batch_size(&self) -> usize {
        10
    }

    async fn handle(&self, msgs: Vec<Delivery>, done: &Completions) -> Vec<(Delivery, Outcome)> {
        lock(&self.kept).extend(msgs.into_iter().map(|d| done.keep(d)));
        Vec::new()
    }
}

#[tokio::test(start_paused = true)]
async fn a_kept_delivery_is_completed_later_on_its_queue_and_the_heartbeat_lets_it_go() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    send(&q, plain(20)).await;
    let h = Arc::new(Keeper { kept: Mutex::default() });
    let e = Engine::start(q.clone(), None, h.clone(), cfg()).await.unwrap();
    assert!(until(Duration::from_secs(5), || lock(&h.kept).len() == 20).await, "all 20 handed over and kept");
    assert_eq!(e.stats().processed.load(Ordering::Relaxed), 20, "kept counts as processed");
    // Kept, not completed: still in flight, and no longer extended by the heartbeat.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(q.in_flight(), 20);
    assert_eq!(q.calls().snapshot().calls(Op::SqsChangeMessageVisibilityBatch), 0, "kept deliveries are not extended");
    let mut kept = std::mem::take(&mut *lock(&h.kept));
    let released = kept.split_off(10);
    for k in kept {
        assert_eq!(k.queue(), "work");
        k.delete();
    }
    for k in released {
        k.release(Duration::from_secs(60));
    }
    e.quiesce(Duration::from_secs(5)).await;
    e.finish(true).await;
    assert_eq!(q.bodies().len(), 10, "ten deleted, ten back on the queue");
    assert_eq!(q.calls().snapshot().calls(Op::SqsDeleteMessageBatch), 1);
}

mod metrics_lint;
mod outage;
