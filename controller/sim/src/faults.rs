//! What can go wrong between a controller and S3, drawn from the seed: each controller reaches the
//! one shared in-memory store through its own [`FaultyStore`], whose calls may fail (a retryable
//! error, nothing done), hang (seconds of simulated time, then go through), or go through with their
//! answer lost and be tried again (as `fleet_io::call` retries: a conditional write then meets its own
//! write), and which freezes while its controller is paused (a process stopped past its lease) or
//! the store is out. Every call is written to the run's trace; every report written, to its record.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::breaker::{Breaker, BreakerPolicy};
use fleet_io::call::CallCounter;
use fleet_io::error::{Error, Result, Service};
use fleet_io::memory::MemoryStore;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::time::Instant;

use crate::World;

/// How often a call goes wrong, per kind (drawn per controller from the seed).
#[derive(Debug, Clone, Copy, Default)]
pub struct Rates {
    pub fail: f64,
    pub hang: f64,
    pub lost: f64,
}

/// The faults in force for one controller.
pub struct Faults {
    rng: ChaCha8Rng,
    pub rates: Rates,
    /// The controller is stopped (SIGSTOP) until then: none of its calls starts or ends before.
    pub paused_until: Option<Instant>,
    /// The controller is cut off from the store until then (the others are not): its calls hang
    /// until their deadline and fail.
    pub cut_off_until: Option<Instant>,
}

impl Faults {
    pub fn new(seed: u64, rates: Rates) -> Faults {
        Faults { rng: ChaCha8Rng::seed_from_u64(seed), rates, paused_until: None, cut_off_until: None }
    }
}

/// What to do with one call.
enum Fate {
    Go,
    Fail,
    Hang(Duration),
    Lost,
}

/// One controller's way to the shared store, with the breaker its S3 client would have (every call's
/// result reported; no probe task of its own, whose jitter is not the seed's: the simulation probes).
pub struct FaultyStore {
    inner: Arc<MemoryStore>,
    ctl: usize,
    faults: Arc<Mutex<Faults>>,
    world: Arc<World>,
    calls: CallCounter,
    breaker: Arc<Breaker>,
}

impl FaultyStore {
    pub fn new(inner: Arc<MemoryStore>, ctl: usize, faults: Arc<Mutex<Faults>>, world: Arc<World>) -> Arc<FaultyStore> {
        let breaker = Breaker::new(Service::S3, BreakerPolicy::default());
        Arc::new(FaultyStore { inner, ctl, faults, world, calls: CallCounter::default(), breaker })
    }

    /// Asks the store a cheap question (as the breaker's probe does), reporting the answer.
    pub async fn probe(&self) {
        let _ = self.head("probe").await;
    }

    fn record<T>(&self, r: Result<T>) -> Result<T> {
        self.breaker.record(&r);
        r
    }

    /// Waits out a pause or an outage, then draws the call's fate.
    async fn before(&self, op: &'static str, key: &str) -> Fate {
        loop {
            let paused = fleet_io::lock(&self.faults).paused_until;
            match paused {
                Some(t) if t > Instant::now() => tokio::time::sleep_until(t).await,
                _ => break,
            }
        }
        let cut_off = fleet_io::lock(&self.faults).cut_off_until.filter(|t| *t > Instant::now());
        if let Some(end) = self.world.outage_until().max(cut_off) {
            // A hung store: the call waits out its deadline (or the outage), then fails.
            let deadline = Instant::now() + Duration::from_secs(30);
            tokio::time::sleep_until(end.min(deadline)).await;
            if end > deadline {
                self.world.trace(format!("ctl{} {op} {} timed out (outage)", self.ctl, short(key)));
                return Fate::Fail;
            }
        }
        let fate = {
            let mut f = fleet_io::lock(&self.faults);
            let r: f64 = f.rng.random();
            let Rates { fail, hang, lost } = f.rates;
            if r < fail {
                Fate::Fail
            } else if r < fail + hang {
                Fate::Hang(Duration::from_millis(f.rng.random_range(100..20_000)))
            } else if r < fail + hang + lost {
                Fate::Lost
            } else {
                Fate::Go
            }
        };
        let what = match &fate {
            Fate::Go => String::new(),
            Fate::Fail => " FAILS".to_string(),
            Fate::Hang(d) => format!(" HANGS {:.1} s", d.as_secs_f64()),
            Fate::Lost => " ANSWER LOST, retried".to_string(),
        };
        self.world.trace(format!("ctl{} {op} {}{what}", self.ctl, short(key)));
        if let Fate::Hang(d) = fate {
            tokio::time::sleep(d).await;
        }
        fate
    }

    fn failed(op: &'static str) -> Error {
        Error::Timeout { service: Service::S3, operation: op, after: Duration::from_secs(30), attempts: 3 }
    }
}

/// A key for the trace: checkpoint part keys end in a random id, cut off so that runs compare.
fn short(key: &str) -> &str {
    match key.find("/checkpoint/") {
        Some(i) => &key[..i + "/checkpoint/".len()],
        None => key,
    }
}

#[async_trait]
impl BlobStore for FaultyStore {
    fn bucket(&self) -> &str {
        "simulated"
    }

    async fn put_if(&self, key: &str, body: Bytes, content_type: &str, meta: &BTreeMap<String, String>, cond: &Cond) -> Result<Option<String>> {
        let r = self.put_if_inner(key, body, content_type, meta, cond).await;
        self.record(r)
    }

    async fn get_tagged(&self, key: &str) -> Result<Option<(Bytes, String)>> {
        let r = self.get_tagged_inner(key).await;
        self.record(r)
    }

    async fn head(&self, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        let r = self.head_inner(key).await;
        self.record(r)
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let r = self.list_inner(prefix, limit).await;
        self.record(r)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        let r = self.delete_inner(key).await;
        self.record(r)
    }

    fn calls(&self) -> &CallCounter {
        &self.calls
    }

    fn breaker(&self) -> Option<Arc<Breaker>> {
        Some(self.breaker.clone())
    }
}

impl FaultyStore {
    async fn put_if_inner(&self, key: &str, body: Bytes, content_type: &str, meta: &BTreeMap<String, String>, cond: &Cond) -> Result<Option<String>> {
        let fate = self.before("PutObject", key).await;
        if matches!(fate, Fate::Fail) {
            return Err(Self::failed("PutObject"));
        }
        let mut out = self.inner.put_if(key, body.clone(), content_type, meta, cond).await?;
        if matches!(fate, Fate::Lost) {
            // The answer never came: the call policy tries again, and the retry meets the first write.
            out = self.inner.put_if(key, body.clone(), content_type, meta, cond).await?;
        }
        if out.is_some() && key.ends_with("/report.json") {
            self.world.report_written(self.ctl, key, body);
        }
        Ok(out)
    }

    async fn get_tagged_inner(&self, key: &str) -> Result<Option<(Bytes, String)>> {
        if matches!(self.before("GetObject", key).await, Fate::Fail) {
            return Err(Self::failed("GetObject"));
        }
        self.inner.get_tagged(key).await
    }

    async fn head_inner(&self, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        if matches!(self.before("HeadObject", key).await, Fate::Fail) {
            return Err(Self::failed("HeadObject"));
        }
        self.inner.head(key).await
    }

    async fn list_inner(&self, prefix: &str, limit: usize) -> Result<Vec<String>> {
        if matches!(self.before("ListObjectsV2", prefix).await, Fate::Fail) {
            return Err(Self::failed("ListObjectsV2"));
        }
        self.inner.list(prefix, limit).await
    }

    async fn delete_inner(&self, key: &str) -> Result<()> {
        let fate = self.before("DeleteObject", key).await;
        if matches!(fate, Fate::Fail) {
            return Err(Self::failed("DeleteObject"));
        }
        self.inner.delete(key).await
    }
}
