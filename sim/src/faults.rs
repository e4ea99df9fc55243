//! Why one file: every fault a controller meets on its way to S3 and SQS is drawn from one
//! per-controller state (`Faults`), and the two ways (`FaultyStore`, `FaultyQueue`) must read it the
//! same way; split, a fault's rule would live apart from the calls it acts on.
//!
//! What can go wrong between a controller and S3 or SQS, drawn from the seed: each controller
//! reaches the one shared in-memory store through its own [`FaultyStore`], whose calls may fail (a
//! retryable error, nothing done), hang (seconds of simulated time, then go through), or go through
//! with their answer lost and be tried again (as `fleet_io::call` retries: a conditional write then
//! meets its own write), a checkpoint write may land with no answer at all (the call fails after it
//! went through), and which freezes while its controller is paused (a process stopped past
//! its lease) or the store is out; some faults wait for the moment they aim at (a crash as a
//! receive brings messages, a pause as a report is written; see [`Faults`]). Its queues are reached
//! through [`FaultyQueue`]s: each call takes a network round trip of its own (which receiver gets a
//! message is SQS's choice, not the order of the calls) and may fail. A crashed controller's calls
//! never end ([`Life`]): nothing it had under way reaches the store or a queue after its crash.
//! Every store call is written to the run's trace; every report written, to its record; every
//! message received from a dead-letter queue, to its count.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::breaker::{Breaker, BreakerPolicy};
use fleet_io::call::CallCounter;
use fleet_io::error::{Error, Result, Service};
use fleet_io::memory::{Hook, Hooked, MemoryStore, Put};
use fleet_io::queue::{Delivery, Outgoing, Queue, QueueDepth, QueueInfo, Receipt};
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
    /// SQS calls that fail (a retryable error, nothing done).
    pub sqs_fail: f64,
    /// The longest round trip of an SQS call, milliseconds (each call draws its own below it).
    pub sqs_latency_ms: u64,
    /// Listings (`ListObjectsV2`) that fail besides `fail`: S3 throttles listings of a busy prefix
    /// first (503 SlowDown). A failed scan of the open jobs must be tried again soon, and a job
    /// loaded on what a scan saw earlier must not be judged by it (drawn on a stream of its own, so
    /// that the other faults of a seed stay as they were).
    pub list_fail: f64,
}

/// The faults in force for one controller.
pub struct Faults {
    rng: ChaCha8Rng,
    /// Draws the listings' own failures (`Rates::list_fail`).
    list_rng: ChaCha8Rng,
    /// Draws which checkpoint writes land unanswered (`Fate::Landed`, at the `lost` rate; on a stream
    /// of its own, so that the other faults of a seed stay as they were).
    landed_rng: ChaCha8Rng,
    pub rates: Rates,
    /// The controller is stopped (SIGSTOP) until then: none of its calls starts or ends before.
    pub paused_until: Option<Instant>,
    /// When its last pause ended or ends (kept when the chaos ends and clears `paused_until`).
    pub last_pause_end: Option<Instant>,
    /// The controller is cut off from the store until then (the others are not): its calls hang
    /// until their deadline and fail.
    pub cut_off_until: Option<Instant>,
    /// The controller crashes as its next receive that gets messages answers (an OOM kill in the
    /// middle of a batch): the messages stay in flight, invisible, until their visibility timeout.
    pub crash_mid_batch: bool,
    /// The controller is paused for this long as it next writes a report (between the checkpoint
    /// that commits a job's ending and the report), with the fault's margin after it: a peer may
    /// take the job over and load it while this one, resumed, finishes it under its feet.
    /// With `true`, the pause ends early as a peer reads the job's checkpoint parts, whose read then
    /// hangs while this one finishes the job and deletes them.
    pub pause_at_report: Option<(Duration, Duration, bool)>,
    /// Its reads of checkpoint parts hang up to this long each (a large job's load is slow).
    pub slow_parts: Option<Duration>,
    /// Its listings fail for [`LIST_BURST`] after it gains a partition (S3 throttling the prefix its
    /// rescan lists): the jobs of the gained partition are loaded on what an earlier scan saw.
    pub list_burst: bool,
}

/// How long listings fail after a gain, with `Faults::list_burst`.
pub const LIST_BURST: Duration = Duration::from_secs(180);

impl Faults {
    pub fn new(seed: u64, rates: Rates) -> Faults {
        Faults {
            rng: ChaCha8Rng::seed_from_u64(seed),
            list_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x1157_1157),
            landed_rng: ChaCha8Rng::seed_from_u64(seed ^ 0x1a4d_1a4d),
            rates,
            paused_until: None,
            last_pause_end: None,
            cut_off_until: None,
            crash_mid_batch: false,
            pause_at_report: None,
            slow_parts: None,
            list_burst: false,
        }
    }
}

/// One run of a controller process: when it crashes, every call it has under way or starts later
/// hangs for ever (a process that is gone sends nothing more).
#[derive(Clone, Default)]
pub struct Life(Arc<AtomicBool>, Arc<Mutex<Option<Instant>>>);

impl Life {
    pub fn end(&self) {
        self.0.store(true, Ordering::SeqCst);
        fleet_io::lock(&self.1).get_or_insert_with(Instant::now);
    }

    /// When the process crashed or stopped.
    pub fn ended_at(&self) -> Option<Instant> {
        *fleet_io::lock(&self.1)
    }

    /// The same run of the process.
    pub fn same(&self, other: &Life) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The process has crashed or stopped.
    pub fn ended(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Never returns once the process has crashed.
    async fn check(&self) {
        if self.0.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }
}

/// Waits while the controller is paused (SIGSTOP), looking every second (a pause may end early:
/// see `Faults::pause_at_report`).
async fn unpaused(faults: &Mutex<Faults>) {
    loop {
        let until = fleet_io::lock(faults).paused_until;
        match until {
            Some(t) if t > Instant::now() => tokio::time::sleep_until(t.min(Instant::now() + Duration::from_secs(1))).await,
            _ => return,
        }
    }
}

/// One controller's way to one queue: a round trip per call, failures at its rate, nothing while it
/// is paused, nothing ever once it has crashed.
pub struct FaultyQueue {
    inner: Arc<dyn Queue>,
    ctl: usize,
    faults: Arc<Mutex<Faults>>,
    life: Life,
    world: Arc<World>,
}

impl FaultyQueue {
    pub fn wrap(inner: Arc<dyn Queue>, ctl: usize, faults: Arc<Mutex<Faults>>, life: Life, world: Arc<World>) -> Arc<dyn Queue> {
        Arc::new(FaultyQueue { inner, ctl, faults, life, world })
    }

    /// A receipt is good on the queue that gave it only (SQS refuses another's as invalid): one
    /// completed on another queue is a bug of the caller, written to the trace as a violation.
    fn own_receipts<'a>(&self, receipts: impl Iterator<Item = &'a str>) {
        let own = format!("{}:", self.inner.name());
        for r in receipts.filter(|r| !r.starts_with(&own)) {
            self.world.trace(format!("WRONG QUEUE ctl{} completed receipt {r} on {}", self.ctl, self.inner.name()));
        }
    }

    /// Names what a call did to which messages (in `--trace` runs only: the soak does without).
    fn said(&self, what: impl FnOnce() -> String) {
        if self.world.every_call {
            self.world.trace(format!("ctl{} {} {}", self.ctl, self.inner.name(), what()));
        }
    }

    async fn before(&self, op: &'static str) -> Result<()> {
        self.life.check().await;
        unpaused(&self.faults).await;
        let (delay, fails) = {
            let mut f = fleet_io::lock(&self.faults);
            let max = f.rates.sqs_latency_ms.max(1);
            let delay = f.rng.random_range(1..=max);
            let r: f64 = f.rng.random();
            (Duration::from_millis(delay), r < f.rates.sqs_fail)
        };
        tokio::time::sleep(delay).await;
        self.life.check().await;
        unpaused(&self.faults).await;
        // A process killed while it was paused (its stop's deadline passed) never resumes.
        self.life.check().await;
        if fails {
            return Err(Error::Service { service: Service::Sqs, operation: op, detail: "simulated: InternalError".into(), retryable: true, source: None });
        }
        Ok(())
    }
}

#[async_trait]
impl Queue for FaultyQueue {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64> {
        self.before("SendMessageBatch").await?;
        self.inner.send_messages(msgs).await
    }

    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Delivery>> {
        self.before("ReceiveMessage").await?;
        let got = self.inner.receive(max, wait).await?;
        // The answer of a process that crashed meanwhile never reaches it.
        self.life.check().await;
        if !got.is_empty() && std::mem::take(&mut fleet_io::lock(&self.faults).crash_mid_batch) {
            // Received, then gone: the simulation sees the ended life and restarts the process.
            self.world.trace(format!("CHAOS ctl{} crashes with {} messages of {} just received", self.ctl, got.len(), self.inner.name()));
            self.life.end();
            self.life.check().await;
        }
        if self.inner.name().contains("results") {
            self.world.read(self.inner.name(), self.ctl, &self.life, &self.faults);
        }
        if !got.is_empty() && self.inner.name().contains("-dlq") {
            self.world.dead_letters_received(self.inner.name(), got.iter().map(|d| d.id.as_str()));
        }
        self.said(|| {
            let each: Vec<String> = got.iter().map(|d| format!("{}(#{}) {}", d.id, d.receive_count, d.body.chars().take(70).collect::<String>())).collect();
            format!("RECEIVED {}", each.join("; "))
        });
        Ok(got)
    }

    async fn delete_receipts(&self, receipts: &[&Receipt]) -> Result<Vec<usize>> {
        self.before("DeleteMessageBatch").await?;
        self.said(|| format!("DELETE {:?}", receipts.iter().map(|r| r.as_str()).collect::<Vec<_>>()));
        self.own_receipts(receipts.iter().map(|r| r.as_str()));
        for r in receipts {
            self.world.deleted(self.ctl, r.as_str());
        }
        self.inner.delete_receipts(receipts).await
    }

    async fn change_visibility(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>> {
        self.before("ChangeMessageVisibilityBatch").await?;
        self.said(|| format!("VISIBILITY {entries:?}"));
        // Messages held through an outage (made invisible for the hold's time) and handed back
        // (visible again at once or soon): a graceful stop must leave none held (see
        // `World::holding`).
        let hold = controller::aggregate::hold::HOLD_VISIBILITY;
        for (r, d) in entries {
            // Any other change replaces the hold's invisibility (a hand-back, after a delay or not).
            // A hand-back deferred until a peer's lease runs out is no hold, however long that lease
            // (a controller misconfigured with a 120 s lease made it 120.25 s: seed 845129128): the
            // job cannot be taken before then by anyone, stopping or not.
            self.world.holding(self.ctl, r, *d == hold);
        }
        self.own_receipts(entries.iter().map(|(r, _)| *r));
        self.inner.change_visibility(entries).await
    }

    async fn depth(&self) -> Result<QueueDepth> {
        self.before("GetQueueAttributes").await?;
        self.inner.depth().await
    }

    async fn info(&self) -> Result<QueueInfo> {
        self.before("GetQueueAttributes").await?;
        self.inner.info().await
    }

    fn calls(&self) -> &CallCounter {
        self.inner.calls()
    }
}

/// What to do with one call.
enum Fate {
    Go,
    Fail,
    Hang(Duration),
    Lost,
    /// The write lands, but no answer ever comes: the call fails after it went through (a client's
    /// timeout on a PUT that S3 carried out). The writer does not know its write is in place.
    Landed,
}

/// One controller's way to the shared store, with the breaker its S3 client would have (every call's
/// result reported; no probe task of its own, whose jitter is not the seed's: the simulation probes).
pub struct FaultyStore {
    ctl: usize,
    /// The name the process runs under (a restart under a new name is another owner).
    owner: String,
    faults: Arc<Mutex<Faults>>,
    life: Life,
    world: Arc<World>,
    calls: CallCounter,
    breaker: Arc<Breaker>,
    /// The process runs the release before partitions: its checkpoints name no partition.
    previous_release: bool,
}

impl FaultyStore {
    pub fn new(
        inner: Arc<MemoryStore>,
        ctl: usize,
        owner: &str,
        faults: Arc<Mutex<Faults>>,
        life: Life,
        world: Arc<World>,
        previous_release: bool,
    ) -> Arc<Hooked<FaultyStore>> {
        let breaker = Breaker::new(Service::S3, BreakerPolicy::default());
        Hooked::new(inner, FaultyStore { ctl, owner: owner.to_string(), faults, life, world, calls: CallCounter::default(), breaker, previous_release })
    }

    /// A checkpoint as the release before partitions wrote it: the same, naming no partition (in its
    /// body and in its metadata).
    fn as_previous_release(key: &str, body: Bytes, meta: &BTreeMap<String, String>) -> (Bytes, BTreeMap<String, String>) {
        let checkpoint = key.starts_with(fleet_domain::layout::CHECKPOINTS_PREFIX) && key.ends_with("/checkpoint.json.zst");
        let old = checkpoint.then(|| fleet_domain::codec::from_zstd_json::<fleet_domain::model::Checkpoint>(&body, 1 << 30).ok()).flatten();
        let Some(mut cp) = old else { return (body, meta.clone()) };
        cp.partition = None;
        let body = Bytes::from(fleet_domain::codec::to_zstd_json(&cp).expect("a checkpoint serializes"));
        (body, meta.iter().filter(|(k, _)| *k != "partition").map(|(k, v)| (k.clone(), v.clone())).collect())
    }

    fn record<T>(&self, r: Result<T>) -> Result<T> {
        self.breaker.record(&r);
        r
    }

    /// Waits out a pause or an outage, then draws the call's fate.
    async fn before(&self, op: &'static str, key: &str) -> Fate {
        self.life.check().await;
        let paused = fleet_io::lock(&self.faults).paused_until.filter(|t| *t > Instant::now());
        if let Some(until) = paused {
            self.world.trouble(&self.owner, Instant::now(), until, true);
        }
        unpaused(&self.faults).await;
        if op == "PutObject" && key.starts_with(fleet_domain::layout::WAREHOUSE_PREFIX) {
            let armed = fleet_io::lock(&self.faults).pause_at_report.take();
            if let Some((d, margin, until_read)) = armed {
                self.world.trace(format!("CHAOS ctl{} paused for {:.1} s as it writes {}", self.ctl, d.as_secs_f64(), short(key)));
                let job = key[fleet_domain::layout::WAREHOUSE_PREFIX.len()..].split('/').next().unwrap_or_default();
                if until_read {
                    fleet_io::lock(&self.world.report_pauses).insert(job.to_string(), (self.ctl, self.faults.clone()));
                }
                let until = Instant::now() + d;
                {
                    let mut f = fleet_io::lock(&self.faults);
                    f.paused_until = Some(until);
                    f.last_pause_end = Some(until);
                }
                self.world.trouble(&self.owner, Instant::now(), until, true);
                self.world.fault_until(until - self.world.start + margin);
                unpaused(&self.faults).await;
            }
        }
        // A peer paused as it wrote this job's report resumes as this controller reads the job's
        // checkpoint parts, and this read hangs while it finishes the job.
        let mut resumed_peer = false;
        if let Some(job) = (op == "GetObject").then(|| fleet_domain::layout::checkpoint_part_of(key)).flatten().map(|(j, _)| j) {
            let paused = fleet_io::lock(&self.world.report_pauses).remove(job);
            match paused {
                Some((ctl, faults)) if ctl != self.ctl => {
                    self.world.trace(format!("PAUSE ENDS ctl{ctl} resumes as ctl{} reads job {job}'s checkpoint parts", self.ctl));
                    let mut f = fleet_io::lock(&faults);
                    let now = Instant::now() + Duration::from_millis(100);
                    f.paused_until = f.paused_until.map(|t| t.min(now));
                    f.last_pause_end = f.paused_until;
                    resumed_peer = true;
                }
                Some(mine) => {
                    fleet_io::lock(&self.world.report_pauses).insert(job.to_string(), mine);
                }
                None => {}
            }
        }
        let cut_off = fleet_io::lock(&self.faults).cut_off_until.filter(|t| *t > Instant::now());
        if let Some(end) = self.world.outage_until().max(cut_off) {
            // A hung store: the call waits out its deadline (or the outage), then fails.
            let deadline = Instant::now() + Duration::from_secs(30);
            self.world.trouble(&self.owner, Instant::now(), end.min(deadline), true);
            tokio::time::sleep_until(end.min(deadline)).await;
            if end > deadline {
                self.world.trace(format!("ctl{} {op} {} timed out (outage)", self.ctl, short(key)));
                return Fate::Fail;
            }
        }
        let fate = {
            let mut f = fleet_io::lock(&self.faults);
            let r: f64 = f.rng.random();
            let Rates { fail, hang, lost, list_fail, .. } = f.rates;
            let list_fails = op == "ListObjectsV2" && list_fail > 0.0 && f.list_rng.random_bool(list_fail);
            let burst = op == "ListObjectsV2" && f.list_burst && fleet_io::lock(&self.world.stops.1).get(&self.owner).is_some_and(|t| t.elapsed() < LIST_BURST);
            if burst {
                let end = fleet_io::lock(&self.world.stops.1).get(&self.owner).map(|t| *t + LIST_BURST).unwrap_or_else(Instant::now);
                self.world.fault_until(end - self.world.start);
            }
            let list_fails = list_fails || burst;
            let slow_part = f.slow_parts.filter(|_| op == "GetObject" && fleet_domain::layout::checkpoint_part_of(key).is_some());
            if resumed_peer {
                Fate::Hang(Duration::from_secs(20))
            } else if let Some(most) = slow_part {
                let ms = f.list_rng.random_range(100..most.as_millis().max(101) as u64);
                Fate::Hang(Duration::from_millis(ms))
            } else if r < fail || list_fails {
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
            Fate::Landed => unreachable!("decided after (see `put_if_inner`)"),
        };
        self.world.trace(format!("ctl{} {op} {}{what}", self.ctl, short(key)));
        match fate {
            Fate::Hang(d) => self.world.trouble(&self.owner, Instant::now(), Instant::now() + d, true),
            Fate::Fail | Fate::Lost if key == fleet_domain::layout::PARTITIONS_KEY => self.world.trouble(&self.owner, Instant::now(), Instant::now(), false),
            _ => {}
        }
        if let Fate::Hang(d) = fate {
            tokio::time::sleep(d).await;
        }
        self.life.check().await;
        fate
    }

    fn failed(op: &'static str) -> Error {
        Error::Timeout { service: Service::S3, operation: op, after: Duration::from_secs(30), attempts: 3 }
    }
}

/// A job's checkpoint document (not its parts).
fn is_checkpoint(key: &str) -> bool {
    key.strip_prefix(fleet_domain::layout::CHECKPOINTS_PREFIX).is_some_and(|k| k.ends_with("/checkpoint.json.zst"))
}

/// A key for the trace: checkpoint part keys end in a random id, cut off so that runs compare.
fn short(key: &str) -> &str {
    match fleet_domain::layout::checkpoint_part_of(key) {
        Some((_, name)) => &key[..name],
        None => key,
    }
}

#[async_trait]
impl Hook for FaultyStore {
    fn bucket<'a>(&'a self, _inner: &'a dyn BlobStore) -> &'a str {
        "simulated"
    }

    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        let Put { key, body, content_type, meta, cond } = put;
        let r = self.put_if_inner(inner, key, body, content_type, meta, cond).await;
        self.record(r)
    }

    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        let r = self.get_tagged_inner(inner, key).await;
        self.record(r)
    }

    async fn head(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        let r = self.head_inner(inner, key).await;
        self.record(r)
    }

    async fn list(&self, inner: &dyn BlobStore, prefix: &str, limit: usize) -> Result<Vec<String>> {
        let r = self.list_inner(inner, prefix, limit).await;
        self.record(r)
    }

    async fn delete(&self, inner: &dyn BlobStore, key: &str) -> Result<()> {
        let r = self.delete_inner(inner, key).await;
        self.record(r)
    }

    fn calls<'a>(&'a self, _inner: &'a dyn BlobStore) -> &'a CallCounter {
        &self.calls
    }

    fn breaker(&self, _inner: &dyn BlobStore) -> Option<Arc<Breaker>> {
        Some(self.breaker.clone())
    }
}

impl FaultyStore {
    /// Whether a checkpoint write that would go through lands unanswered: at the `lost` rate, and a
    /// quarter of the writes that commit a job's ending (whose writer keeps the job and tries again
    /// with what it knows of its earlier write), in runs that lose answers.
    fn lands_unanswered(&self, key: &str, body: &[u8]) -> bool {
        if !is_checkpoint(key) {
            return false;
        }
        let mut f = fleet_io::lock(&self.faults);
        let lost = f.rates.lost;
        if lost == 0.0 {
            return false;
        }
        // The job's ending: committed (`finishing`, before the report) or done.
        let cp = zstd::decode_all(body).ok().and_then(|b| serde_json::from_slice::<fleet_domain::model::Checkpoint>(&b).ok());
        let ending = cp.is_some_and(|c| c.finishing || c.status.is_finished());
        f.landed_rng.random_bool(if ending { 0.25 } else { lost })
    }

    async fn put_if_inner(
        &self,
        inner: &dyn BlobStore,
        key: &str,
        body: Bytes,
        content_type: &str,
        meta: &BTreeMap<String, String>,
        cond: &Cond,
    ) -> Result<Option<String>> {
        let mut fate = self.before("PutObject", key).await;
        if matches!(fate, Fate::Fail) {
            return Err(Self::failed("PutObject"));
        }
        if matches!(fate, Fate::Go) && self.lands_unanswered(key, &body) {
            self.world.trace(format!("ctl{} PutObject {} LANDS, ITS ANSWER LOST (the call fails)", self.ctl, short(key)));
            fate = Fate::Landed;
        }
        // (Not a write whose answer is lost: the writer reads it back and compares it with what it
        // sent, which the previous release sent without the partition.)
        let previous = self.previous_release && !matches!(fate, Fate::Lost | Fate::Landed);
        let (body, meta) = if previous { Self::as_previous_release(key, body, meta) } else { (body, meta.clone()) };
        let meta = &meta;
        let mut out = inner.put_if(key, body.clone(), content_type, meta, cond).await?;
        let written = out.is_some();
        if matches!(fate, Fate::Lost) {
            // The answer never came: the call policy tries again, and the retry meets the first write.
            out = inner.put_if(key, body.clone(), content_type, meta, cond).await?;
        }
        // A write whose answer was lost wrote all the same (seed 381: a lease so written made its
        // writer one of the job's two, and its later conclusion that the other owned the job right).
        if written || out.is_some() {
            // Who wrote a job's lease or checkpoint (only a writer can fence another).
            let job = key
                .strip_prefix("leases/")
                .and_then(|k| k.strip_suffix(".json"))
                .or_else(|| key.strip_prefix(fleet_domain::layout::CHECKPOINTS_PREFIX).and_then(|k| k.strip_suffix("/checkpoint.json.zst")));
            if let Some(job) = job {
                self.world.wrote(job, &self.owner);
            }
            let (now, run_time) = (tokio::time::Instant::now(), self.world.now());
            if let Some(job) = key.strip_prefix("leases/").and_then(|k| k.strip_suffix(".json")) {
                fleet_io::lock(&self.world.takeovers).lease(job, &body, now, run_time);
            } else if key == fleet_domain::layout::PARTITIONS_KEY {
                fleet_io::lock(&self.world.takeovers).table(&self.owner, &body, now, run_time);
                if let Ok(t) = serde_json::from_slice::<controller::partitions::Table>(&body) {
                    let owners: Vec<String> = t.owners.iter().map(|(p, o)| format!("{p}:{}", o.owner.as_deref().unwrap_or("-"))).collect();
                    self.world.trace(format!("{} TABLE members {:?} owners {}", self.owner, t.members.keys().collect::<Vec<_>>(), owners.join(" ")));
                }
            }
        }
        if out.is_some() && key.ends_with("/report.json") {
            self.world.report_written(self.ctl, key, body);
        }
        if matches!(fate, Fate::Landed) {
            return Err(Self::failed("PutObject"));
        }
        Ok(out)
    }

    async fn get_tagged_inner(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        if matches!(self.before("GetObject", key).await, Fate::Fail) {
            return Err(Self::failed("GetObject"));
        }
        inner.get_tagged(key).await
    }

    async fn head_inner(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<BTreeMap<String, String>>> {
        if matches!(self.before("HeadObject", key).await, Fate::Fail) {
            return Err(Self::failed("HeadObject"));
        }
        inner.head(key).await
    }

    async fn list_inner(&self, inner: &dyn BlobStore, prefix: &str, limit: usize) -> Result<Vec<String>> {
        if matches!(self.before("ListObjectsV2", prefix).await, Fate::Fail) {
            return Err(Self::failed("ListObjectsV2"));
        }
        inner.list(prefix, limit).await
    }

    async fn delete_inner(&self, inner: &dyn BlobStore, key: &str) -> Result<()> {
        let fate = self.before("DeleteObject", key).await;
        if matches!(fate, Fate::Fail) {
            return Err(Self::failed("DeleteObject"));
        }
        inner.delete(key).await
    }
}
