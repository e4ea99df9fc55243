//! Circuit breakers, one per external dependency (SQS, S3) and shared by every client of a process
//! built from the same [`crate::config::Aws`]: an outage of a dependency pauses the work that needs it
//! instead of failing that work.
//!
//! Every call the SQS and S3 clients make reports its result here. A call that failed for the
//! infrastructure (no answer within its deadline, a refused connection, a 5xx or a throttle: see
//! [`Error::is_outage`]) counts; any answer of the service (also a refusal such as NotFound) resets the
//! count. After `threshold` failed calls in a row the breaker opens: listeners stop receiving, work in
//! hand waits (its visibility kept) instead of spending its receive count, and a probe task asks the
//! dependency a cheap question (GetQueueAttributes, HeadBucket) with a jittered, doubling back-off
//! until it answers. The first answer, of the probe or of any other call, closes the breaker and
//! wakes whoever waits for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::error::{Error, Result, Service};
use crate::lock;

/// A cheap call that tells whether the dependency answers.
pub type Probe = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<()>> + Send>> + Send + Sync>;

/// How breakers open and probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Failed calls in a row that open the breaker.
    pub threshold: u32,
    /// The first probe's wait after opening; it doubles per failed probe up to `max_probe_interval`
    /// (each wait jittered between half and all of it).
    pub first_probe: Duration,
    pub max_probe_interval: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy { threshold: 3, first_probe: Duration::from_secs(1), max_probe_interval: Duration::from_secs(10) }
    }
}

/// What a breaker shows (`/state`, `/metrics`, the agent's decisions).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct BreakerState {
    pub dependency: String,
    pub open: bool,
    /// Seconds since it opened (0 when closed).
    pub open_for_s: f64,
    /// Failed calls in a row.
    pub failures: u32,
    /// Times it has opened since the process started.
    pub trips: u64,
    pub probes: u64,
    /// The last failure that counted (no credentials: errors name endpoints and operations only).
    pub last_error: Option<String>,
}

struct State {
    failures: u32,
    opened: Option<Instant>,
    trips: u64,
    probes: u64,
    last_error: Option<String>,
}

/// The breaker of one dependency.
pub struct Breaker {
    service: Service,
    policy: BreakerPolicy,
    state: Mutex<State>,
    /// Woken when it closes (open while `state.opened` is set): a `Notify` wakes its waiters in the order they came (a `watch`
    /// channel wakes them in an order drawn from the runtime's unseeded generator, so the listeners
    /// a breaker held resumed in a different order each run: found by the simulation's replays).
    closes: tokio::sync::Notify,
    probe: Mutex<Option<Probe>>,
}

impl Breaker {
    pub fn new(service: Service, policy: BreakerPolicy) -> Arc<Breaker> {
        Arc::new(Breaker {
            service,
            policy: BreakerPolicy { threshold: policy.threshold.max(1), ..policy },
            state: Mutex::new(State { failures: 0, opened: None, trips: 0, probes: 0, last_error: None }),
            closes: tokio::sync::Notify::new(),
            probe: Mutex::new(None),
        })
    }

    pub fn service(&self) -> Service {
        self.service
    }

    /// Sets the probe, unless one is set already (the first client of the dependency provides it).
    pub fn set_probe(&self, probe: Probe) {
        let mut p = lock(&self.probe);
        if p.is_none() {
            *p = Some(probe);
        }
    }

    /// Reports a call's result.
    pub fn record<T>(self: &Arc<Self>, result: &Result<T>) {
        match result {
            Err(e) if e.is_outage() => self.failure(e),
            _ => self.success(),
        }
    }

    /// The dependency answered.
    pub fn success(&self) {
        let reopened = {
            let mut s = lock(&self.state);
            s.failures = 0;
            s.opened.take()
        };
        if let Some(since) = reopened {
            tracing::warn!(dependency = %self.service, open_s = since.elapsed().as_secs_f64(), "dependency answers again: breaker closed, work resumes");
            self.closes.notify_waiters();
        }
    }

    /// A call failed for the infrastructure.
    pub fn failure(self: &Arc<Self>, e: &Error) {
        let opened = {
            let mut s = lock(&self.state);
            s.failures = s.failures.saturating_add(1);
            s.last_error = Some(e.to_string());
            if s.opened.is_none() && s.failures >= self.policy.threshold {
                s.opened = Some(Instant::now());
                s.trips += 1;
                true
            } else {
                false
            }
        };
        if opened {
            tracing::warn!(dependency = %self.service, error = %e, "dependency does not answer: breaker open, work pauses until it does");
            self.spawn_probe();
        }
    }

    pub fn is_open(&self) -> bool {
        lock(&self.state).opened.is_some()
    }

    /// Returns once the breaker is closed (at once when it is).
    pub async fn wait_closed(&self) {
        loop {
            // Registered before the state is read: a close in between is not missed.
            let closes = self.closes.notified();
            tokio::pin!(closes);
            closes.as_mut().enable();
            if !self.is_open() {
                return;
            }
            closes.await;
        }
    }

    pub fn state(&self) -> BreakerState {
        let s = lock(&self.state);
        BreakerState {
            dependency: self.service.to_string(),
            open: s.opened.is_some(),
            open_for_s: s.opened.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0),
            failures: s.failures,
            trips: s.trips,
            probes: s.probes,
            last_error: s.last_error.clone(),
        }
    }

    /// Probes the dependency with back-off until the breaker closes (by the probe or another call).
    /// Without a probe the breaker closes on the next call that gets an answer.
    fn spawn_probe(self: &Arc<Self>) {
        let Some(probe) = lock(&self.probe).clone() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let me = Arc::downgrade(self);
        let policy = self.policy;
        rt.spawn(async move {
            let mut wait = policy.first_probe;
            loop {
                tokio::time::sleep(half_jitter(wait)).await;
                wait = (wait * 2).min(policy.max_probe_interval);
                let Some(b) = me.upgrade() else { return };
                if !b.is_open() {
                    return;
                }
                lock(&b.state).probes += 1;
                let r = probe().await;
                tracing::debug!(dependency = %b.service, ok = r.is_ok(), "probe");
                b.record(&r);
                if !b.is_open() {
                    return;
                }
            }
        });
    }
}

/// A uniform wait in [d/2, d].
fn half_jitter(d: Duration) -> Duration {
    let half = d / 2;
    half + Duration::from_nanos(crate::jitter::u64_in(0..half.as_nanos() as u64 + 1))
}

/// The breakers of one process's dependencies (cheap to clone: shared).
#[derive(Clone)]
pub struct Breakers {
    pub sqs: Arc<Breaker>,
    pub s3: Arc<Breaker>,
}

impl Breakers {
    pub fn new(policy: BreakerPolicy) -> Breakers {
        Breakers { sqs: Breaker::new(Service::Sqs, policy), s3: Breaker::new(Service::S3, policy) }
    }

    pub fn all(&self) -> Vec<Arc<Breaker>> {
        vec![self.sqs.clone(), self.s3.clone()]
    }

    pub fn states(&self) -> Vec<BreakerState> {
        self.all().iter().map(|b| b.state()).collect()
    }
}

impl Default for Breakers {
    fn default() -> Self {
        Breakers::new(BreakerPolicy::default())
    }
}

/// Whether any of `breakers` is open.
pub fn any_open(breakers: &[Arc<Breaker>]) -> bool {
    breakers.iter().any(|b| b.is_open())
}

/// Returns once every one of `breakers` is closed at the same moment.
pub async fn all_closed(breakers: &[Arc<Breaker>]) {
    loop {
        for b in breakers {
            b.wait_closed().await;
        }
        if !any_open(breakers) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use super::*;

    fn timeout() -> Error {
        Error::Timeout { service: Service::S3, operation: "GetObject", after: Duration::from_secs(10), attempts: 3 }
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_the_threshold_probes_with_back_off_and_closes_when_the_dependency_answers() {
        let b = Breaker::new(Service::S3, BreakerPolicy::default());
        let up = Arc::new(AtomicBool::new(false));
        let probes = Arc::new(AtomicU32::new(0));
        let (u, p) = (up.clone(), probes.clone());
        b.set_probe(Arc::new(move || {
            let (u, p) = (u.clone(), p.clone());
            Box::pin(async move {
                p.fetch_add(1, Ordering::SeqCst);
                if u.load(Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err(Error::Timeout { service: Service::S3, operation: "HeadBucket", after: Duration::from_secs(10), attempts: 1 })
                }
            })
        }));
        // An answer in between resets the count: two failures, an answer, two failures stay closed.
        b.record::<()>(&Err(timeout()));
        b.record::<()>(&Err(timeout()));
        b.record(&Ok(()));
        b.record::<()>(&Err(timeout()));
        b.record::<()>(&Err(timeout()));
        assert!(!b.is_open());
        // A refusal is an answer, not an outage.
        b.record::<()>(&Err(Error::NotFound { service: Service::S3, what: "no such key".into() }));
        assert_eq!(b.state().failures, 0);
        for _ in 0..3 {
            b.record::<()>(&Err(timeout()));
        }
        assert!(b.is_open());
        assert_eq!(b.state().trips, 1);
        // Probes back off: waits of 1, 2, 4, 8, 10, 10, ... s, each jittered down to half. Within
        // 2 minutes: at least 14 probes (every wait whole: 1+2+4+8 = 15 s, then one per 10 s), at most
        // 26 (every wait half: 0.5+1+2+4 = 7.5 s, then one per 5 s).
        tokio::time::sleep(Duration::from_secs(120)).await;
        let n = probes.load(Ordering::SeqCst);
        assert!((14..=26).contains(&n), "{n} probes in 120 s");
        assert!(b.is_open());
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.wait_closed().await })
        };
        up.store(true, Ordering::SeqCst);
        let t = Instant::now();
        waiter.await.unwrap();
        assert!(t.elapsed() <= Duration::from_secs(10), "closed {:?} after the dependency came back", t.elapsed());
        assert!(!b.is_open());
        let s = b.state();
        assert_eq!((s.open, s.failures, s.trips), (false, 0, 1));
        // Probing has stopped.
        let n = probes.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(300)).await;
        assert_eq!(probes.load(Ordering::SeqCst), n);
    }

    #[tokio::test(start_paused = true)]
    async fn any_call_that_gets_an_answer_closes_it() {
        let b = Breaker::new(Service::Sqs, BreakerPolicy { threshold: 1, ..BreakerPolicy::default() });
        b.record::<()>(&Err(Error::Unreachable { service: Service::Sqs, endpoint: "x".into(), detail: "refused".into(), source: None }));
        assert!(b.is_open());
        let both = [b.clone(), Breaker::new(Service::S3, BreakerPolicy::default())];
        assert!(any_open(&both));
        b.record(&Ok(1));
        assert!(!any_open(&both));
        tokio::time::timeout(Duration::from_secs(1), all_closed(&both)).await.unwrap();
    }
}
