//! An outage of a dependency under paused time: the engine holds what it has (visibility kept by the
//! heartbeat, receive count unspent), receives nothing while the breaker is open, and resumes when the
//! probe finds the dependency back; nothing reaches the dead-letter queue.

use std::sync::atomic::AtomicBool;

use super::*;
use fleet_io::breaker::{Breaker, BreakerPolicy};
use fleet_io::error::Service;

/// Bills nothing while `down`: each attempt is a timed-out call to the dependency (reported to its
/// breaker) and the delivery goes back as `Unavailable`. `stuck` bodies fail that way for themselves
/// alone, without the breaker hearing of it.
struct OutageHandler {
    breaker: Arc<Breaker>,
    down: Arc<AtomicBool>,
    stuck: Vec<String>,
    /// (body, receive count) of every delivery billed.
    billed: Mutex<Vec<(String, u32)>>,
    attempts: AtomicU64,
    /// Deliveries the hook `on_received` was told of.
    received: AtomicU64,
    poisoned: Mutex<Vec<String>>,
}

fn timeout() -> fleet_io::Error {
    fleet_io::Error::Timeout { service: Service::S3, operation: "GetObject", after: Duration::from_secs(10), attempts: 3 }
}

#[async_trait]
impl Handler for OutageHandler {
    fn batch_size(&self) -> usize {
        10
    }

    fn dependencies(&self) -> Vec<Arc<Breaker>> {
        vec![self.breaker.clone()]
    }

    async fn handle(&self, msgs: Vec<Delivery>, _done: &Completions) -> Vec<(Delivery, Outcome)> {
        // One call's deadline.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut out = Vec::new();
        for m in msgs {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            if self.stuck.contains(&m.body) {
                out.push((m, Outcome::Unavailable("its blob's download times out".into())));
            } else if self.down.load(Ordering::SeqCst) {
                self.breaker.record::<()>(&Err(timeout()));
                out.push((m, Outcome::Unavailable(timeout().to_string())));
            } else {
                self.breaker.record(&Ok(()));
                lock(&self.billed).push((m.body.clone(), m.receive_count));
                out.push((m, Outcome::Done));
            }
        }
        out
    }

    fn on_received(&self, msgs: &[Delivery]) {
        self.received.fetch_add(msgs.len() as u64, Ordering::SeqCst);
    }

    async fn on_poison(&self, msg: &Message, _reason: &str) {
        lock(&self.poisoned).push(msg.body.clone());
    }
}

fn outage_handler(stuck: &[&str]) -> (Arc<OutageHandler>, Arc<AtomicBool>) {
    let breaker = Breaker::new(Service::S3, BreakerPolicy::default());
    let down = Arc::new(AtomicBool::new(true));
    let d = down.clone();
    breaker.set_probe(Arc::new(move || {
        let d = d.clone();
        Box::pin(async move {
            if d.load(Ordering::SeqCst) {
                Err(timeout())
            } else {
                Ok(())
            }
        })
    }));
    let h = OutageHandler {
        breaker,
        down: down.clone(),
        stuck: stuck.iter().map(|s| s.to_string()).collect(),
        billed: Mutex::default(),
        attempts: AtomicU64::new(0),
        received: AtomicU64::new(0),
        poisoned: Mutex::default(),
    };
    (Arc::new(h), down)
}

#[tokio::test(start_paused = true)]
async fn an_outage_of_ten_minutes_holds_the_work_and_spends_no_receive_count() {
    let dlq = MemoryQueue::new("work-dlq", Duration::from_secs(30));
    // Two receives allowed: an outage handled by release-and-receive would dead-letter everything.
    let q = MemoryQueue::with_dlq("work", Duration::from_secs(30), 2, dlq.clone());
    let (h, down) = outage_handler(&[]);
    send(&q, plain(25)).await;
    let e = Engine::start(q.clone(), None, h.clone(), cfg()).await.unwrap();
    assert!(until(Duration::from_secs(10), || h.breaker.is_open()).await, "the breaker did not open");
    let s = e.state();
    assert_eq!(s.paused_for, vec!["S3"]);
    let h0 = e.health();
    assert!(!h0.ready && h0.live && h0.reasons.iter().any(|r| r.contains("S3")), "not ready, still live, while S3 is out: {h0:?}");
    assert_eq!(s.breakers.iter().map(|b| (b.dependency.as_str(), b.open, b.trips)).collect::<Vec<_>>(), [("S3", true, 1)], "{:?}", s.breakers);
    let m = crate::http::render_metrics(std::slice::from_ref(&s));
    assert!(m.contains("listener_breaker_open{queue=\"work\",dependency=\"S3\"} 1"), "{m}");
    assert!(m.contains("listener_breaker_trips_total{queue=\"work\",dependency=\"S3\"} 1"), "{m}");
    let receives = e.stats().receives.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(600)).await;
    let s = e.state();
    assert_eq!(e.stats().receives.load(Ordering::SeqCst), receives, "consumers received while the breaker was open");
    // As many held as the concurrency limit allows; the rest wait in the buffer, in hand too.
    assert_eq!((s.held, s.buffer_len), (16, 9), "{s:?}");
    assert_eq!(s.in_hand, 25, "the held messages are still in hand (their visibility extended)");
    assert!(s.extended >= 25 * 30, "visibility extended every 15 s for 10 minutes: {}", s.extended);
    assert!(e.health().live, "a paused listener is not stuck: {:?}", e.health());
    assert!(lock(&h.billed).is_empty());
    // A held batch tries again only when the breaker closes: a handful of attempts each, not one per second.
    assert!(h.attempts.load(Ordering::SeqCst) <= 25 * 4, "{} attempts", h.attempts.load(Ordering::SeqCst));
    assert!(h.breaker.state().probes >= 20, "probes back off to 10 s: {:?}", h.breaker.state());

    down.store(false, Ordering::SeqCst);
    assert!(until(Duration::from_secs(40), || lock(&h.billed).len() == 25).await, "not resumed: {:?}", e.state());
    assert!(lock(&h.billed).iter().all(|(_, n)| *n == 1), "received more than once: {:?}", lock(&h.billed));
    assert!(until(Duration::from_secs(5), || q.bodies().is_empty()).await, "not deleted");
    assert!(dlq.bodies().is_empty() && lock(&h.poisoned).is_empty(), "dead-lettered: {:?}", dlq.bodies());
    let s = e.state();
    assert!(s.paused_for.is_empty() && s.held == 0 && s.failed == 0, "{s:?}");
    assert!(e.health().ready, "ready again once S3 answers: {:?}", e.health());
    // Work sent after the outage flows at once.
    send(&q, [("after".to_string(), Attrs::default())]).await;
    assert!(until(Duration::from_secs(5), || lock(&h.billed).len() == 26).await);
    // The receive hook heard of each delivery once, however often the outage handed it back.
    let (received, attempts) = (h.received.load(Ordering::SeqCst), h.attempts.load(Ordering::SeqCst));
    assert!(received == 26 && attempts > 26, "on_received told of {received} deliveries, handle tried {attempts}");
    e.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn a_drain_during_an_outage_returns_the_held_work_at_once() {
    let q = MemoryQueue::new("work", Duration::from_secs(30));
    let (h, _down) = outage_handler(&[]);
    send(&q, plain(5)).await;
    let e = Engine::start(q.clone(), None, h.clone(), cfg()).await.unwrap();
    assert!(until(Duration::from_secs(10), || e.counts().in_hand == 5 && h.breaker.is_open()).await);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let t = Instant::now();
    assert!(e.quiesce(Duration::from_secs(30)).await, "the drain did not finish");
    e.finish(true).await;
    assert!(t.elapsed() < Duration::from_secs(5), "held work delayed the drain: {:?}", t.elapsed());
    assert_eq!((q.bodies().len(), q.in_flight()), (5, 0), "the held messages are back on the queue, visible");
}

#[tokio::test(start_paused = true)]
async fn a_message_that_fails_alone_while_the_dependency_answers_counts_as_failed() {
    let dlq = MemoryQueue::new("work-dlq", Duration::from_secs(30));
    let q = MemoryQueue::with_dlq("work", Duration::from_secs(30), 2, dlq.clone());
    let (h, down) = outage_handler(&["stuck"]);
    down.store(false, Ordering::SeqCst);
    send(&q, [("stuck".to_string(), Attrs::default()), ("fine".to_string(), Attrs::default())]).await;
    let e = Engine::start(q.clone(), None, h.clone(), cfg()).await.unwrap();
    assert!(until(Duration::from_secs(600), || dlq.bodies() == vec!["stuck"]).await, "not dead-lettered");
    assert_eq!(lock(&h.poisoned).clone(), vec!["stuck"]);
    assert_eq!(lock(&h.billed).iter().map(|(b, _)| b.as_str()).collect::<Vec<_>>(), vec!["fine"]);
    assert!(!h.breaker.is_open());
    e.shutdown(Duration::from_secs(5)).await;
}
