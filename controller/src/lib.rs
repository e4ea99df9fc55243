//! Why one file: the process's life (start, the timers, the readers gained and given up, the stop under
//! one deadline) is one sequence whose order matters; split, the order would have to be read across files.
//!
//! The controller service: the wiring of `aggregate` (per-job exactly-once aggregation), `partitions`
//! (which results partitions this controller reads) and `forward` (dead-lettered work items to their
//! partition) into listener engines and timers. Read it for the process's life: `run` starts the
//! listeners on the partitions it owns (each partition's results queue and dead-letter queue, started
//! and stopped by `Readers` as ownership changes) and on the work dead-letter queue, and the timers
//! (checkpoint and lease renewal, balancing, the hold's retries, expiry); `stop` ends it all under one
//! deadline. The handler checkpoints job state to S3 before the messages it applied are completed
//! (deleted, batched), and writes the report when every chunk of a job is accounted for.

pub mod aggregate;
pub mod clock;
pub mod events;
pub mod forward;
pub mod lease;
pub mod partitions;
pub mod purge;
pub mod sighting;
pub mod status;
pub mod timings;
pub mod undo;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fleet_domain::prices::Prices;
use fleet_engine::admin::AdminToken;
use fleet_engine::args::ListenerArgs;
use fleet_engine::dynamic_consumers::ScalingPolicy;
use fleet_engine::http::Engines;
use fleet_engine::{http, Completions, Engine, EngineConfig, Handler, Kept, Outcome};
use fleet_io::blob::BlobStore;
use fleet_io::queue::{Delivery, Queue};
use fleet_io::telemetry::Operation;
use fleet_io::trigger::{Notifier, Subscription, TriggerBus};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use aggregate::{Aggregator, Source, FLUSH_INTERVAL};

/// Controller settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub listener: ListenerArgs,
    /// The whole stop, seconds from the signal: the batch in hand, the last checkpoint, the leases
    /// given back and purges under way, under this one deadline (keep it below the pod's
    /// terminationGracePeriodSeconds, 45 in deploy/k8s).
    #[arg(long, env = "CONTROLLER_DRAIN_SECS", default_value_t = 30)]
    pub drain_secs: u64,
    /// A job that has not sealed (its initiator stopped mid-submission) is finished as `abandoned`,
    /// with what was processed, after this many seconds without a result (longer than a parked
    /// listener's safety poll, `--park-poll-secs`, so that a seal sent without a trigger is read first).
    #[arg(long, env = "CONTROLLER_ABANDON_AFTER", default_value_t = DEFAULT_ABANDON_AFTER, value_parser = clap::value_parser!(u64).range(1..=30 * 86_400))]
    pub abandon_after: u64,
    /// A sealed job that gets no news for this many seconds, once every message that was in the
    /// fleet's queues (work, results, their dead-letter queues) at its last news has left them (each
    /// queue seen empty in turn, in the order messages move), is finished as `partial`, its missing
    /// chunks named as failed: their work items were lost (queue retention, FIFO de-duplication) and
    /// can no longer arrive. Needs the work queue (`Deps::work`).
    #[arg(long, env = "CONTROLLER_STALL_AFTER", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=30 * 86_400))]
    pub stall_after: u64,
    /// A job whose chunks are all in but some failed (a failure report, a dead letter, an unreadable
    /// result) is finished this many seconds after its last news, so that a real result still on its
    /// way replaces a failure; keep it above the work queue's visibility timeout plus an S3 call
    /// deadline or two (the longest a controller losing S3 sits on a result before a peer gets it).
    #[arg(long, env = "CONTROLLER_SETTLE_SECS", default_value_t = aggregate::SETTLE.as_secs(), value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub settle_secs: u64,
    /// Lease time, seconds: of each job (one owner at a time) and of each controller's membership in
    /// the results partitions' ownership: a dead controller's partitions and jobs are taken over this
    /// long after its last renewal (renewed every third of it).
    #[arg(long, env = "CONTROLLER_LEASE_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(3..=3600))]
    pub lease_secs: u64,
    /// Name of this controller in job leases; unique per controller, stable across its restarts
    /// [default: $HOSTNAME, else controller-PID].
    #[arg(long, env = "CONTROLLER_ID")]
    pub id: Option<String>,
    /// A finished job's chunk and result blobs (its transactions) are deleted this many seconds after
    /// its report is written (0: at once); the report, accounts, manifest and checkpoint stay.
    #[arg(long, env = "CONTROLLER_BLOB_RETENTION_SECS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=365 * 86_400))]
    pub blob_retention_secs: u64,
    /// The keyring (a directory of `*.key` files, one key each: `ROLE BASE64`): every role's key,
    /// several of a role while one is rotated. With it, a message counts only when it is signed by a
    /// role that may send it (results by processors, seals by submitters, abandons by submitters or
    /// operators, forwarded dead letters by controllers, dead-lettered work items by submitters);
    /// anything else is quarantined. This controller signs what it forwards with the keyring's
    /// controller key. Without it, messages are not checked by role (a warning says so at start).
    /// See docs/security.md.
    #[arg(long = "role-keys", env = "FLEET_ROLE_KEYS", value_name = "DIR", value_parser = role_keys)]
    pub role_keys: Option<fleet_io::auth::Keyring>,
    /// Serve the status page (GET / and /status.json; with the page token, GET /jobs/{id} and
    /// /jobs/{id}/report) on this address (e.g. 127.0.0.1:9300), apart from the metrics and health on
    /// `--http-addr`, so that a monitoring system let in to scrape metrics reaches no billing data.
    #[arg(long, env = "CONTROLLER_PAGE_ADDR")]
    pub page_addr: Option<SocketAddr>,
    /// File holding the status page's bearer token (at least 16 characters), read at start: job
    /// reports (every account's totals) and per-job detail are served only to requests carrying it,
    /// and not at all without one.
    #[arg(long, env = "CONTROLLER_PAGE_TOKEN_FILE", value_name = "FILE", value_parser = AdminToken::from_file)]
    pub page_token_file: Option<AdminToken>,
    /// The status page's bearer token itself (prefer the file: a flag shows in `ps`).
    #[arg(long, env = "CONTROLLER_PAGE_TOKEN", hide_env_values = true, value_name = "TOKEN", value_parser = AdminToken::parse, conflicts_with = "page_token_file")]
    pub page_token: Option<AdminToken>,
    /// The scaling agent's state endpoint (e.g. http://scaling-agent:9090), read by the status page
    /// (`GET /` on `--page-addr`) for the fleet, its decisions and the queues' depths; without it
    /// the page reads the depths from SQS and shows no fleet.
    #[arg(long, env = "CONTROLLER_AGENT_URL")]
    pub agent_url: Option<String>,
    /// Memory budget of decoded results, MiB: the result payloads decompressed and decoded at once,
    /// across all jobs and batches, each counted for the most its chunk's records allow, stay within
    /// it whatever arrives (keep it well below the container's memory limit; a result larger than the
    /// whole budget is decoded alone).
    #[arg(long, env = "CONTROLLER_DECODE_BUDGET_MIB", default_value_t = aggregate::budget::DEFAULT_BUDGET_MIB, value_parser = clap::value_parser!(u64).range(16..=1 << 20))]
    pub decode_budget_mib: u64,
    /// The price table each report's request cost is computed with, USD: `key=value` pairs overriding
    /// AWS's us-east-1 list prices (`sqs` per million requests, `s3_put` and `s3_get` per thousand).
    #[arg(long, env = "FLEET_PRICES", default_value = "sqs=0.40,s3_put=0.005,s3_get=0.0004")]
    pub prices: Prices,
    /// Start even when the timings fail the start check (`controller::timings`: a settle time shorter
    /// than a held result can be away, an abandon time shorter than a parked listener's poll): for test
    /// rigs and demos with short waits; the failures are logged as warnings.
    #[arg(long, env = "CONTROLLER_UNCHECKED_TIMINGS", value_parser = clap::builder::FalseyValueParser::new())]
    pub unchecked_timings: bool,
}

/// Default `--abandon-after`, seconds: two hours, above a parked listener's hourly safety poll.
pub const DEFAULT_ABANDON_AFTER: u64 = 7200;

/// How often the partitions of jobs waiting here for results are looked at (and how long a job has
/// been quiet before its partition is): a receive per listener a minute while a job waits, instead
/// of an hour's wait for a result that comes back unannounced.
pub const WAITING_LOOK: Duration = Duration::from_secs(60);

impl Settings {
    /// The timings the start check reads: these settings', the fleet's call deadline and the work
    /// queue's visibility timeout (when read).
    pub fn timings(&self, call_deadline: Duration, work_visibility: Option<Duration>, results_visibility: Option<Duration>) -> timings::Timings {
        timings::Timings {
            settle: Duration::from_secs(self.settle_secs),
            lease: Duration::from_secs(self.lease_secs),
            abandon_after: Duration::from_secs(self.abandon_after),
            park_poll: (self.listener.park_poll_secs > 0).then(|| Duration::from_secs(self.listener.park_poll_secs)),
            receive_wait: Duration::from_secs(self.listener.receive_wait_secs),
            call_deadline,
            work_visibility,
            results_visibility,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            listener: ListenerArgs::default(),
            drain_secs: 30,
            abandon_after: DEFAULT_ABANDON_AFTER,
            stall_after: 3600,
            settle_secs: aggregate::SETTLE.as_secs(),
            lease_secs: 30,
            id: None,
            blob_retention_secs: 0,
            agent_url: None,
            page_addr: None,
            page_token_file: None,
            page_token: None,
            decode_budget_mib: aggregate::budget::DEFAULT_BUDGET_MIB,
            prices: Prices::default(),
            unchecked_timings: false,
            role_keys: None,
        }
    }
}

/// Reads the keyring directory given by `--role-keys` (an error names the file and line).
fn role_keys(dir: &str) -> Result<fleet_io::auth::Keyring, String> {
    fleet_io::auth::Keyring::from_dir(std::path::Path::new(dir)).map_err(|e| e.to_string())
}

/// The services a controller talks to.
#[derive(Clone)]
pub struct Deps {
    /// The results queue: one queue, or its partitions as one [`fleet_io::queue::Sharded`] queue
    /// (`Aws::results_queues`); the controller reads the partitions it owns.
    pub results: Arc<dyn Queue>,
    pub work_dlq: Arc<dyn Queue>,
    /// Where results go after maxReceiveCount failed attempts (S3 down for minutes), partitioned as
    /// the results queue: each partition's is read by the partition's owner.
    pub results_dlq: Arc<dyn Queue>,
    pub store: Arc<dyn BlobStore>,
    /// The work queue, read for its depth only: a sealed job is finished as stalled only once it and
    /// the other queues have emptied since the job's last news (none: stalled jobs are never finished).
    pub work: Option<Arc<dyn Queue>>,
    /// Work-detected triggers (RabbitMQ subscription): with them, idle listeners park (no requests)
    /// until processors or initiators announce results or dead letters.
    pub triggers: Option<Subscription>,
    /// Where to announce messages handed back to the queue for another controller (the job's owner),
    /// so that its parked listener wakes.
    pub publish: Option<Arc<dyn TriggerBus>>,
}

/// Deletes messages a checkpoint (or a report) covers, each on the queue it came from (batched).
fn complete(kept: Vec<Kept>) {
    for k in kept {
        k.delete();
    }
}

/// One notifier per queue (by name): announces messages handed back to it, so that the parked
/// listener of the controller they are for wakes when they are visible again.
type Notifiers = BTreeMap<String, Notifier>;

/// Announces hand-backs (each message with when it is visible again) on their queue's notifier.
fn announce<'a>(notifiers: &Notifiers, released: impl IntoIterator<Item = (&'a str, Duration)>) {
    let mut per_queue: BTreeMap<&str, (u64, Duration)> = BTreeMap::new();
    for (queue, after) in released {
        let e = per_queue.entry(queue).or_default();
        *e = (e.0 + 1, e.1.max(after));
    }
    for (queue, (n, after)) in per_queue {
        if let Some(notifier) = notifiers.get(queue) {
            notifier.notify_after(n, after + Duration::from_millis(100));
        }
    }
}

/// Completes what applying held messages again gave back: deletes, and hand-backs (to the job's
/// owner, or to any controller that reaches the store), announced.
fn complete_applied(applied: aggregate::Applied, notifiers: &Notifiers) {
    complete(applied.delete);
    announce(notifiers, applied.release.iter().map(|(k, after)| (k.queue(), *after)));
    for (k, after) in applied.release {
        k.release(after);
    }
}

/// What a batch's handler hands its engine: the outcomes of the messages of the engine's own queue
/// (`done`'s). A batch may also complete messages that came from another queue: a job's earlier
/// messages from a dead-letter queue (or its results queue), pending in the job until this batch's
/// checkpoint covered them. Those are completed here on the queue they came from; handed to this
/// engine they were deleted on the wrong queue (an invalid receipt on SQS, so they came back and
/// were received again; found by the simulation, seed 516, where the in-memory queues' receipts
/// collided and a seal was lost).
pub(crate) fn outcomes(done: &Completions, applied: aggregate::Applied) -> Vec<(Delivery, Outcome)> {
    let mut out = Vec::with_capacity(applied.release.len() + applied.delete.len());
    let own = |k: &Kept| k.queue() == done.queue() || undo::is(undo::Fix::OwnQueueCompletes);
    for (k, after) in applied.release {
        if own(&k) {
            out.push((k.into_delivery(), Outcome::Release(after)));
        } else {
            k.release(after);
        }
    }
    for k in applied.delete {
        if own(&k) {
            out.push((k.into_delivery(), Outcome::Done));
        } else {
            k.delete();
        }
    }
    out
}

struct ResultsHandler {
    source: Source,
    /// The queue it reads (`messaging.destination.name` of its spans).
    queue: String,
    agg: Arc<Aggregator>,
    /// Announces messages handed back for another controller (shared with the hold's retry).
    notifiers: Arc<Notifiers>,
    /// The store's breaker: while S3 does not answer, nothing is received (checkpoints cannot be
    /// written).
    store_breaker: Option<Arc<fleet_io::breaker::Breaker>>,
}

#[async_trait]
impl Handler for ResultsHandler {
    fn batch_size(&self) -> usize {
        10
    }

    fn dependencies(&self) -> Vec<Arc<fleet_io::breaker::Breaker>> {
        self.store_breaker.iter().cloned().collect()
    }

    fn holding(&self) -> usize {
        self.agg.held(Some(self.source))
    }

    async fn handle(&self, msgs: Vec<Delivery>, done: &Completions) -> Vec<(Delivery, Outcome)> {
        // Applied in memory, checkpointed, then deleted; a crash anywhere before the delete redelivers
        // the messages and the checkpoint makes the replay a no-op. Only this batch's jobs are locked.
        // What `apply` does not return waits in its job for the next checkpoint (or, when the job
        // could not be saved, is dropped and comes back after the visibility timeout).
        // One CONSUMER span for the batch, which may hold several jobs' messages: it links the context
        // of every message (the spans that billed or forwarded them), each job's trace reaching it by
        // its link, rather than being a child of any one (exported when OTEL_EXPORTER_OTLP_ENDPOINT is
        // set; see `fleet_io::telemetry`).
        let n = msgs.len();
        let span = tracing::info_span!("apply_results", otel.kind = "consumer", source = ?self.source, messages = n);
        fleet_io::telemetry::Messaging { operation: Operation::Process, destination: &self.queue, message_id: None, batch: Some(n) }.set(&span);
        fleet_io::telemetry::link_all(&span, msgs.iter().map(|m| m.attrs.trace.as_deref()));
        let kept = msgs.into_iter().map(|d| done.keep(d)).collect();
        // A job that could not be applied marks it failed (`Aggregator::apply`).
        let applied = tracing::Instrument::instrument(self.agg.apply(self.source, kept), span).await;
        events::ResultsApplied { open_jobs: self.agg.open_jobs() }.emit();
        // Announced when they are visible again, so that the owner's parked listener finds them.
        announce(&self.notifiers, applied.release.iter().map(|(k, after)| (k.queue(), *after)));
        outcomes(done, applied)
    }
}

/// The results partitions this controller reads: for each, a listener on its results queue and one on
/// its dead-letter queue, started when the partition is gained and stopped (the batch in hand
/// applied, its jobs checkpointed and their leases given back) when it is given up.
struct Readers {
    /// Every partition's results queue and dead-letter queue, by number.
    parts: Vec<(Arc<dyn Queue>, Arc<dyn Queue>)>,
    running: BTreeMap<u16, (Vec<Engine>, CancellationToken)>,
    cfg: EngineConfig,
    dlq_cfg: EngineConfig,
    agg: Arc<Aggregator>,
    notifiers: Arc<Notifiers>,
    store_breaker: Option<Arc<fleet_io::breaker::Breaker>>,
    triggers: Option<Subscription>,
    /// What the state endpoint answers for.
    engines: Engines,
    shutdown: CancellationToken,
    /// This controller's name (in its partition events).
    owner: String,
}

impl Readers {
    fn running(&self) -> BTreeSet<u16> {
        self.running.keys().copied().collect()
    }

    async fn start(&mut self, p: u16) -> fleet_io::Result<()> {
        let Some((results, dlq)) = self.parts.get(usize::from(p)).cloned() else { return Ok(()) };
        let token = self.shutdown.child_token();
        self.agg.reading(p);
        // In `running` from the first listener on, so that a start cut short (an error, the stop) is
        // stopped like any other.
        self.running.insert(p, (Vec::with_capacity(2), token.clone()));
        // Gained as its first listener may receive (a start cut short gives it up again).
        events::PartitionChanged { owner: &self.owner, partition: p, owned: true }.emit();
        for (source, q, cfg) in [(Source::Results, results, self.cfg.clone()), (Source::ResultsDeadLetter, dlq, self.dlq_cfg.clone())] {
            let handler = Arc::new(ResultsHandler {
                source,
                queue: q.name().to_string(),
                agg: self.agg.clone(),
                notifiers: self.notifiers.clone(),
                store_breaker: self.store_breaker.clone(),
            });
            let e = match Engine::start(q, None, handler, cfg).await {
                Ok(e) => e,
                Err(err) => {
                    self.stop(p, Duration::ZERO).await;
                    return Err(err);
                }
            };
            if let Some(sub) = &self.triggers {
                e.follow_triggers(sub, token.clone());
            }
            self.engines.add(e.clone());
            if let Some((engines, _)) = self.running.get_mut(&p) {
                engines.push(e);
            }
        }
        let engines = self.running.get(&p).map(|(e, _)| e.clone()).unwrap_or_default();
        // Its quiet jobs, known to its last reader only, are found by the next expiry tick.
        if !undo::is(undo::Fix::RescanOnGain) {
            self.agg.rescan_soon();
        }
        if undo::is(undo::Fix::HeirWakes) {
            return Ok(());
        }
        // Messages the partition's last reader held when it died are invisible for a while yet (its
        // receives for a visibility timeout, its hold for longer) and nobody announces them when they
        // are visible again: the new listeners look then, instead of parking until their safety poll.
        let wakes = engines;
        let stop = token;
        let results = self.parts[usize::from(p)].0.clone();
        tokio::spawn(async move {
            let visibility = results.info().await.map(|i| i.visibility_timeout).unwrap_or(Duration::from_secs(30));
            let mut at = vec![visibility, visibility * 2, aggregate::hold::HOLD_VISIBILITY];
            at.sort();
            let started = tokio::time::Instant::now();
            for after in at {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep_until(started + after + Duration::from_secs(1)) => {}
                }
                for e in &wakes {
                    e.wake(None).await;
                }
            }
        });
        Ok(())
    }

    /// Stops reading partition `p`: its listeners quiesce (within `grace`), the jobs of the partition
    /// are checkpointed and their messages deleted, their leases given back, what was held for them
    /// handed back, the listeners finish. It leaves `running` last (a stop cut short is done again).
    async fn stop(&mut self, p: u16, grace: Duration) {
        let Some((engines, token)) = self.running.get(&p).cloned() else { return };
        futures::future::join_all(engines.iter().map(|e| e.quiesce(grace))).await;
        // Held first: letting go checkpoints the partition's jobs, which may wait out a hung store.
        hand_back_held(&self.agg, Some(p));
        complete(self.agg.let_go(p).await);
        hand_back_held(&self.agg, Some(p));
        for e in &engines {
            e.finish(true).await;
            self.engines.remove(e.queue_name());
        }
        token.cancel();
        self.running.remove(&p);
        events::PartitionChanged { owner: &self.owner, partition: p, owned: false }.emit();
    }

    /// Stops reading every partition, all listeners quiescing at once.
    async fn stop_all(&mut self, grace: Duration) {
        self.stop_some(&self.running(), grace).await;
    }

    /// Stops reading the partitions of `which`, all their listeners quiescing at once.
    async fn stop_some(&mut self, which: &BTreeSet<u16>, grace: Duration) {
        let engines: Vec<Engine> = self.running.iter().filter(|(p, _)| which.contains(p)).flat_map(|(_, (e, _))| e.clone()).collect();
        futures::future::join_all(engines.iter().map(|e| e.quiesce(grace))).await;
        for p in which {
            self.stop(*p, Duration::ZERO).await;
        }
    }
}

/// One balancing round (see `partitions`): partitions asked for are stopped and handed over, free ones
/// claimed and started; a controller that could not renew its membership in time stops reading first.
async fn balance(own: &tokio::sync::Mutex<partitions::Ownership>, readers: &tokio::sync::Mutex<Readers>, leaving: bool) {
    let mut own = own.lock().await;
    let mut readers = readers.lock().await;
    // A partition is given up within half a lease (what its listeners still hold comes back after
    // its visibility timeout), so that the membership renewed before it stays valid meanwhile.
    let grace = own.ttl() / 2;
    if !own.fresh() && !readers.running.is_empty() && !undo::is(undo::Fix::StaleStopsReading) {
        stop_stale(&mut readers, grace).await;
    }
    // The partitions a round says to stop are stopped at once, their listeners quiescing together
    // (one taken while this controller could not renew is read by its new owner already: one per
    // round, each waiting out its grace, kept a paused controller reading three partitions it had
    // lost for a minute); then the round is planned again, renewing the membership first.
    for _ in 0..readers.parts.len() + 3 {
        let running = readers.running();
        let stale_at = own.stale_at();
        let round = own.round(&running, leaving);
        tokio::pin!(round);
        let mut stopped = running.is_empty() || stale_at.is_none() || undo::is(undo::Fix::StaleStopsReading);
        let result = loop {
            tokio::select! {
                biased;
                // The membership goes stale while the round hangs (a read, then a write, each up to
                // the store's call deadline): reading stops then,
                // not when the round gives up (a round that hung kept a controller reading on for
                // 67 s in the simulation, seed 369).
                _ = tokio::time::sleep_until(stale_at.unwrap_or_else(tokio::time::Instant::now)), if !stopped => {
                    stopped = true;
                    stop_stale(&mut readers, grace).await;
                }
                r = &mut round => break r,
            }
        };
        match result {
            Ok(plan) if !plan.stop.is_empty() => {
                events::PartitionsToStop { owner: &readers.owner, partitions: &plan.stop, stale: false }.emit();
                if undo::is(undo::Fix::StopAtOnce) {
                    if let Some(p) = plan.stop.first() {
                        readers.stop(*p, grace).await;
                    }
                } else {
                    readers.stop_some(&plan.stop, grace).await;
                }
            }
            Ok(plan) => {
                for p in plan.start {
                    if let Err(e) = readers.start(p).await {
                        tracing::warn!(partition = p, error = %e, "could not start reading a partition; tried again next round");
                    }
                }
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "partition balancing round failed; tried again next round");
                return;
            }
        }
    }
}

/// The membership was not renewed in time: every partition stops (within `grace`) until it is.
async fn stop_stale(readers: &mut Readers, grace: Duration) {
    tracing::warn!(partitions = ?readers.running(), "partition ownership not renewed in time: reading none until it is");
    events::PartitionsToStop { owner: &readers.owner, partitions: &readers.running(), stale: true }.emit();
    readers.stop_all(grace).await;
}

/// Hands what is held through a store outage for partition `p` (`None`: all) back to its queue, visible
/// at once.
fn hand_back_held(agg: &Aggregator, p: Option<u16>) {
    for k in agg.hand_back_held(p) {
        k.release(Duration::ZERO);
    }
}

/// The stop, under one deadline (`--drain-secs` from the signal, below the pod's
/// terminationGracePeriodSeconds): listeners quiesce (the batch in hand finishes), the timers stop,
/// every job with pending messages is checkpointed (or finished) and those messages deleted, the
/// leases are given back and the partitions handed back so other controllers take the jobs at once,
/// and purges under way end. Whatever the deadline cuts off is safe to lose: the messages of a last
/// checkpoint that did not finish in time are made visible again at once (any other unsaved message
/// comes back after its visibility timeout), a lease not given back expires, a purge left halfway is
/// redone from its marker or the bucket's lifecycle rule.
async fn stop(
    settings: &Settings,
    forward: &Engine,
    readers: &tokio::sync::Mutex<Readers>,
    own: &tokio::sync::Mutex<partitions::Ownership>,
    agg: &Arc<Aggregator>,
    tracker: TaskTracker,
    purger: tokio::task::JoinHandle<()>,
) {
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(settings.drain_secs);
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    tracker.close();
    let steps = async {
        // What is held through a store outage goes back to its queue first, for whoever reads it
        // next: nothing below (a balancing round under way, a flush) may wait out a hung store with
        // it invisible. Nothing is held from now on.
        agg.stopping();
        hand_back_held(agg, None);
        // The timers first (a balancing round under way ends), then every listener at once: each may
        // wait for its long poll to end (up to 20 s).
        tracker.wait().await;
        let mut readers = readers.lock().await;
        let parts = readers.running();
        let engines: Vec<Engine> = readers.running.values().flat_map(|(e, _)| e.clone()).chain([forward.clone()]).collect();
        // What is applied and waiting for its checkpoint is saved while the long polls end, not after
        // them: a poll may take up to 20 s, longer than a short stop deadline, and messages applied
        // again after a hold are invisible for the hold's two minutes (found by the simulation, seed
        // 18814094: a graceful stop with a 17 s deadline left eight of them so). Jobs in a batch's
        // hands are the last flush's; one that does not finish in time shows its messages at once.
        let early = async {
            if undo::is(undo::Fix::HandBackHeld) {
                return;
            }
            let unsaved = agg.unsaved_visibility();
            match tokio::time::timeout(left() / 2, agg.flush_idle()).await {
                Ok(done) => complete(done),
                Err(_) => unsaved.iter().for_each(fleet_engine::Visibility::show),
            }
        };
        let (quiesced, ()) = tokio::join!(futures::future::join_all(engines.iter().map(|e| e.quiesce(left()))), early);
        if quiesced.iter().any(|done| !done) {
            tracing::warn!("the stop deadline passed with batches in hand; their messages come back after their visibility timeout");
        }
        // Held by the batches that ended meanwhile.
        hand_back_held(agg, None);
        // The last checkpoint, within most of what is left: one that waits out a hung store gives
        // its messages back (visible at once) and the stop goes on to the listeners' last
        // completions and the hand-over.
        let unsaved = agg.unsaved_visibility();
        match tokio::time::timeout(left() * 3 / 4, agg.flush()).await {
            Ok(done) => complete(done),
            Err(_) if !undo::is(undo::Fix::HandBackHeld) => {
                tracing::warn!(messages = unsaved.len(), "the last checkpoint did not finish in time: its messages go back to their queue for the next owner");
                unsaved.iter().for_each(fleet_engine::Visibility::show);
            }
            Err(_) => {}
        }
        hand_back_held(agg, None);
        for p in parts {
            readers.stop(p, Duration::ZERO).await;
        }
        forward.finish(true).await;
        // Other controllers may take this one's jobs and partitions over at once.
        agg.release_leases().await;
        drop(readers);
        if let Err(e) = own.lock().await.round(&BTreeSet::new(), true).await {
            tracing::warn!(error = %e, "could not hand the partitions back; they are taken over when this controller's membership runs out");
        }
        agg.stop_notifying();
        let _ = purger.await;
    };
    // Shortly before the deadline, what a hold extended and nothing has saved yet is made visible
    // (the calls still land within the deadline): a step stuck on a hung store, such as the timer's
    // checkpoint of the job they were applied to, would leave them invisible for the hold's time.
    let last_calls = deadline - (deadline - started).div_f64(10.0).clamp(Duration::from_millis(500), Duration::from_secs(3));
    tokio::pin!(steps);
    let ended = match tokio::time::timeout_at(last_calls, &mut steps).await {
        Ok(()) => Ok(()),
        Err(_) => {
            hand_back_held(agg, None);
            agg.show_retried();
            tokio::time::timeout_at(deadline, &mut steps).await
        }
    };
    match ended {
        Ok(()) => tracing::info!(secs = started.elapsed().as_secs_f64(), "stopped within the deadline"),
        Err(_) => {
            tracing::warn!(
                drain_secs = settings.drain_secs,
                pending = agg.pending(),
                "the stop deadline passed: what was not checkpointed comes back after its visibility timeout (at once if it had been \
                 held), leases not given back expire, a purge left halfway is redone from its marker (or by the bucket's lifecycle rule)"
            );
        }
    }
}

/// Runs until `shutdown`: listeners on the results partitions it owns (balanced with the other
/// controllers) and on the work dead-letter queue, a timer that checkpoints pending work and one that
/// abandons jobs that never seal; on shutdown the last checkpoint is written, its messages deleted and
/// the partitions handed back.
pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> fleet_io::Result<()> {
    run_with_clock(settings, deps, clock::Clock::System, shutdown).await
}

/// [`run`] with every wall-clock reading (leases, checkpoints, partition ownership, purge markers)
/// taken from `clock`: the deterministic simulation (`fleet-sim`) runs this very function on tokio's
/// paused clock, each controller with a clock of its own (skewed from the others').
pub async fn run_with_clock(settings: Settings, deps: Deps, clock: clock::Clock, shutdown: CancellationToken) -> fleet_io::Result<()> {
    // Stable across restarts of one container (its hostname), so a restarted controller takes its own
    // leases back at once; a host process is told apart by its pid (its jobs wait for lease expiry).
    let owner = settings.id.clone().unwrap_or_else(|| match std::env::var("HOSTNAME") {
        Ok(h) if !h.is_empty() => h,
        _ => format!("controller-{}", std::process::id()),
    });
    events::register_metrics();
    let parts: Vec<(Arc<dyn Queue>, Arc<dyn Queue>)> =
        fleet_io::queue::partitions(&deps.results).into_iter().zip(fleet_io::queue::partitions(&deps.results_dlq)).collect();
    if parts.len() != fleet_io::queue::partitions(&deps.results_dlq).len() {
        return Err(fleet_io::Error::Config("the results queue and its dead-letter queue must have as many partitions".into()));
    }
    let mut aggregator = Aggregator::with_clock(deps.store.clone(), owner.clone(), Duration::from_secs(settings.lease_secs), clock);
    aggregator.set_settle(Duration::from_secs(settings.settle_secs));
    aggregator.set_prices(settings.prices);
    aggregator.set_decode_budget(settings.decode_budget_mib << 20);
    match &settings.role_keys {
        Some(ring) => {
            let roles: Vec<String> = ring.roles().iter().map(|(r, n)| format!("{r}: {n}")).collect();
            if ring.signing_key(fleet_io::auth::Role::Controller).is_none() {
                tracing::warn!("the keyring holds no controller key: dead letters this controller forwards will not count");
            }
            tracing::info!(keys = %roles.join(", "), "messages count only when signed by a role that may send them");
            aggregator.check_roles(ring.clone());
        }
        None => tracing::warn!(
            "no keyring (--role-keys / FLEET_ROLE_KEYS): messages are not checked by role, so anyone who may send to the results queue can end or bill a job (docs/security.md)"
        ),
    }
    aggregator.set_queue(Source::Results, parts[0].0.name());
    aggregator.set_queue(Source::ResultsDeadLetter, parts[0].1.name());
    aggregator.set_queue(Source::WorkDeadLetter, deps.work_dlq.name());
    for (p, (q, dlq)) in parts.iter().enumerate() {
        aggregator.set_partition_queue(q.name(), p as u16);
        aggregator.set_partition_queue(dlq.name(), p as u16);
        aggregator.forward_strays_to(p as u16, q.clone());
    }
    match &deps.work {
        Some(work) => aggregator.set_stall_limit(
            Duration::from_secs(settings.stall_after),
            aggregate::FleetQueues {
                work: work.clone(),
                work_dlq: deps.work_dlq.clone(),
                results: deps.results.clone(),
                results_dlq: deps.results_dlq.clone(),
                announce: deps.publish.clone(),
            },
        ),
        None => tracing::info!("no work queue given: sealed jobs that stall are not finished"),
    }
    let agg = Arc::new(aggregator);
    // Finished jobs' blobs are purged in the background; a stop waits for the purges under way.
    let retention = Duration::from_secs(settings.blob_retention_secs);
    let (finished_tx, finished_rx) = tokio::sync::mpsc::unbounded_channel();
    agg.notify_finished(finished_tx);
    // Without a retention the tick only tries again purges that failed at once.
    let purge_tick = if retention.is_zero() { Duration::from_secs(30) } else { (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60)) };
    let purger = tokio::spawn(purge::Purger::with_clock(deps.store.clone(), retention, clock).run(finished_rx, purge_tick));
    let cfg = settings.listener.engine(deps.triggers.is_some());
    // Dead letters are rare: one consumer each is plenty.
    let dlq_cfg = fleet_engine::EngineConfig { scaling: ScalingPolicy { min_consumers: 1, max_consumers: 1, ..cfg.scaling }, ..cfg.clone() };
    let queue_names: Vec<&Arc<dyn Queue>> = parts.iter().flat_map(|(q, d)| [q, d]).chain([&deps.work_dlq]).collect();
    let notifiers: Arc<Notifiers> = Arc::new(match &deps.publish {
        Some(bus) => {
            queue_names.iter().map(|q| (q.name().to_string(), Notifier::new(bus.clone(), q.name(), "controller", Duration::from_millis(100)))).collect()
        }
        None => Notifiers::new(),
    });
    let forwarder = forward::Forwarder {
        partitions: parts.iter().map(|(q, _)| q.clone()).collect(),
        // The controller's own notifiers of the partitions' results queues (one rate limit per queue).
        notifiers: parts.iter().filter_map(|(q, _)| notifiers.get(q.name()).cloned()).collect(),
        agg: agg.clone(),
        store_breaker: deps.store.breaker(),
    };
    let forward = Engine::start(deps.work_dlq.clone(), None, Arc::new(forwarder), dlq_cfg.clone()).await?;
    if let Some(sub) = &deps.triggers {
        forward.follow_triggers(sub, shutdown.clone());
    }
    let engines = Engines::new(vec![forward.clone()]);
    let readers = Arc::new(tokio::sync::Mutex::new(Readers {
        parts: parts.clone(),
        running: BTreeMap::new(),
        cfg: cfg.clone(),
        dlq_cfg,
        agg: agg.clone(),
        notifiers: notifiers.clone(),
        store_breaker: deps.store.breaker(),
        triggers: deps.triggers.clone(),
        engines: engines.clone(),
        shutdown: shutdown.clone(),
        owner: owner.clone(),
    }));
    let own = Arc::new(tokio::sync::Mutex::new(partitions::Ownership::new(
        deps.store.clone(),
        owner.clone(),
        Duration::from_secs(settings.lease_secs),
        parts.len() as u16,
        clock,
    )));
    // The first round before anything else: this controller's partitions are read from the start.
    balance(&own, &readers, false).await;
    let mut roles: Vec<(&'static str, Arc<dyn Queue>)> =
        vec![("results", deps.results.clone()), ("work_dlq", deps.work_dlq.clone()), ("results_dlq", deps.results_dlq.clone())];
    if let Some(work) = &deps.work {
        roles.insert(0, ("work", work.clone()));
    }
    http::serve_from_args_with(&settings.listener, &engines, &shutdown).await?;
    if let Some(addr) = settings.page_addr {
        let token = settings.page_token_file.clone().or_else(|| settings.page_token.clone());
        let page = status::StatusSource::new(owner.clone(), deps.store.clone(), roles, engines.clone(), settings.agent_url.clone(), token.clone());
        let bound = http::serve_app("status page", addr, page.router(), shutdown.clone())
            .await
            .map_err(|e| fleet_io::Error::Config(format!("status page on {addr}: {e}")))?;
        tracing::info!(%bound, reports = if token.is_some() { "with the page token" } else { "not served (no page token)" }, "status page: GET /, /status.json, /jobs/{{id}}, /jobs/{{id}}/report");
        if token.is_some() && !bound.ip().is_loopback() {
            tracing::warn!(%bound, "the status page listens beyond this host on plain HTTP: its token and the reports cross the network in clear; \
                keep it behind TLS (an ingress, a sidecar, a service mesh) or bind it to 127.0.0.1");
        }
    }
    let tracker = TaskTracker::new();
    {
        let (own, readers, stop) = (own.clone(), readers.clone(), shutdown.clone());
        tracker.spawn(async move {
            loop {
                // When is the ownership's to say: an interval after the last round, sooner after
                // one that failed.
                let next = own.lock().await.next_round_at();
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep_until(next) => tokio::select! {
                        biased;
                        _ = stop.cancelled() => return,
                        () = balance(&own, &readers, false) => {}
                    },
                }
            }
        });
    }
    {
        let (agg, stop) = (agg.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(FLUSH_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {
                        complete(agg.flush_idle().await);
                        agg.renew_leases().await;
                        events::open_jobs(agg.open_jobs());
                    }
                }
            }
        });
    }
    {
        // Results held through a store outage: their visibility kept (on its own timer: a retry may
        // wait out several call deadlines), applied again when it answers.
        let (agg, stop) = (agg.clone(), shutdown.clone());
        let notifiers = notifiers.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    // A retry that waits on a hung store does not hold up the stop (what it had in
                    // hand comes back after its extended visibility).
                    _ = tick.tick() => tokio::select! {
                        biased;
                        _ = stop.cancelled() => return,
                        applied = agg.retry_held() => complete_applied(applied, &notifiers),
                    },
                }
            }
        });
    }
    {
        let (agg, stop) = (agg.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => agg.extend_held(),
                }
            }
        });
    }
    if !undo::is(undo::Fix::WaitingLooks) {
        // A job waiting here for results: its partition's listeners look every minute, parked or
        // not. What it waits for may come back unannounced (SQS moves a result to the dead-letter
        // queue after its last receive; with the scaling agent down nobody announces it), and a
        // parked listener would see it only at its safety poll, an hour later (found by the
        // simulation, seed 608 with a quiet rolling upgrade and the agent down).
        let (agg, readers, stop) = (agg.clone(), readers.clone(), shutdown.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(WAITING_LOOK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {
                        let waiting = agg.waiting(WAITING_LOOK);
                        if waiting == aggregate::Waiting::default() {
                            continue;
                        }
                        // A balancing round under way (it may wait out a stop's grace) skips this look.
                        let Ok(r) = readers.try_lock() else { continue };
                        let engines: Vec<Engine> = r
                            .running
                            .iter()
                            .filter(|(p, _)| waiting.any || waiting.partitions.contains(p))
                            .flat_map(|(_, (e, _))| e.clone())
                            .collect();
                        drop(r);
                        for e in engines {
                            // Depth 0: the parked consumer looks once; no depth query, no new consumer.
                            e.wake(Some(0)).await;
                        }
                    }
                }
            }
        });
    }
    {
        let (agg, stop) = (agg.clone(), shutdown.clone());
        let after = Duration::from_secs(settings.abandon_after);
        tracker.spawn(async move {
            let mut tick = tokio::time::interval((after / 10).clamp(Duration::from_millis(200), Duration::from_secs(60)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {
                        complete(agg.expire(after).await);
                    }
                }
            }
        });
    }
    let reading = readers.lock().await.running();
    tracing::info!(
        results = deps.results.name(),
        partitions = parts.len(),
        reading = ?reading,
        work_dlq = deps.work_dlq.name(),
        results_dlq = deps.results_dlq.name(),
        bucket = deps.store.bucket(),
        abandon_after_secs = settings.abandon_after,
        %owner,
        lease_secs = settings.lease_secs,
        "controller started"
    );
    shutdown.cancelled().await;
    stop(&settings, &forward, &readers, &own, &agg, tracker, purger).await;
    let stats = agg.stats();
    tracing::info!(
        checkpoint_writes = stats.writes.load(Ordering::Relaxed),
        checkpoint_bytes = stats.bytes.load(Ordering::Relaxed),
        full_parts = stats.full_parts.load(Ordering::Relaxed),
        delta_parts = stats.delta_parts.load(Ordering::Relaxed),
        "controller stopped"
    );
    Ok(())
}
