//! The controller service: per-job exactly-once aggregation of the results partitions it owns into
//! the warehouse. This file is the process's life, top-down: [`run_with_clock`] wires the parts
//! (below) into listener engines and timers, and `stop` ends it all under one deadline. Where each
//! thing lives:
//!
//! - `aggregate`: the jobs (apply a batch, checkpoint, finish, expire, hold through a store outage);
//! - `handler`: a results listener's batch handed to `aggregate`, its messages completed;
//! - `partitions`: which results partitions this controller reads (the ownership table and its
//!   balancing round), and their readers;
//! - `forward`: dead-lettered work items sent to their job's partition;
//! - `timers`: every periodic action, in one table;
//! - `settings`, `cli`, `lease`, `purge`, `status` (the page), `events` (typed logs and metrics),
//!   `clock`;
//! - from `controller-core` (the decisions without I/O): the partitions' plan, `sighting`, `timings`
//!   (the start check), `undo` (the mutation harness's switches, compiled only into
//!   `controller-core-undoable`).
//!
//! The handler checkpoints job state to S3 before the messages it applied are completed (deleted,
//! batched), and writes the report when every chunk of a job is accounted for.

pub mod aggregate;
pub mod cli;
pub mod clock;
pub mod events;
pub mod forward;
mod handler;
pub mod lease;
pub mod partitions;
pub mod purge;
mod settings;
pub mod status;
pub mod timers;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use fleet_engine::dynamic_consumers::ScalingPolicy;
use fleet_engine::http::Engines;
use fleet_engine::{http, Engine};
use fleet_io::blob::BlobStore;
use fleet_io::queue::Queue;
use fleet_io::trigger::{Notifier, Subscription, TriggerBus};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use handler::{complete, Notifiers};
use partitions::{hand_back_held, rebalance, Readers};

pub use aggregate::{Aggregator, Source, FLUSH_INTERVAL};
/// The decisions without I/O, in the `controller-core` crate.
pub use controller_core::{sighting, timings, undo};
pub(crate) use handler::outcomes;
pub use settings::{Settings, DEFAULT_ABANDON_AFTER};
pub use timers::WAITING_LOOK;

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
        agg.reading().stop();
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
            let unsaved = agg.memory().unsaved_visibility();
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
        let unsaved = agg.memory().unsaved_visibility();
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
        agg.release_leases(|_| true).await;
        drop(readers);
        if let Err(e) = own.lock().await.round(&BTreeSet::new(), true).await {
            tracing::warn!(error = %e, "could not hand the partitions back; they are taken over when this controller's membership runs out");
        }
        agg.purging().stop();
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
            agg.holding().show_retried();
            tokio::time::timeout_at(deadline, &mut steps).await
        }
    };
    match ended {
        Ok(()) => tracing::info!(secs = started.elapsed().as_secs_f64(), "stopped within the deadline"),
        Err(_) => {
            tracing::warn!(
                drain_secs = settings.drain_secs,
                pending = agg.memory().pending(),
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
    let keyring = match &settings.role_keys {
        Some(ring) => {
            let roles: Vec<String> = ring.roles().iter().map(|(r, n)| format!("{r}: {n}")).collect();
            if ring.signing_key(fleet_io::auth::Role::Controller).is_none() {
                tracing::warn!("the keyring holds no controller key: dead letters this controller forwards will not count");
            }
            tracing::info!(keys = %roles.join(", "), "messages count only when signed by a role that may send them");
            Some(ring.clone())
        }
        None => {
            tracing::warn!(
                "no keyring (--role-keys / FLEET_ROLE_KEYS): messages are not checked by role, so anyone who may send to the results queue can end or bill a job (docs/security.md)"
            );
            None
        }
    };
    let stall = match &deps.work {
        Some(work) => Some(aggregate::StallLimit {
            after: Duration::from_secs(settings.stall_after),
            queues: aggregate::FleetQueues {
                work: work.clone(),
                work_dlq: deps.work_dlq.clone(),
                results: deps.results.clone(),
                results_dlq: deps.results_dlq.clone(),
                announce: deps.publish.clone(),
            },
        }),
        None => {
            tracing::info!("no work queue given: sealed jobs that stall are not finished");
            None
        }
    };
    let queues = [(Source::Results, parts[0].0.name()), (Source::ResultsDeadLetter, parts[0].1.name()), (Source::WorkDeadLetter, deps.work_dlq.name())];
    let aggregator = Aggregator::with(
        deps.store.clone(),
        aggregate::Options {
            owner: owner.clone(),
            lease: Duration::from_secs(settings.lease_secs),
            clock,
            settle: Duration::from_secs(settings.settle_secs),
            prices: settings.prices,
            decode_budget: settings.decode_budget_mib << 20,
            stall,
            queues: queues.into_iter().map(|(s, q)| (s, q.to_string())).collect(),
            partition_queues: parts
                .iter()
                .enumerate()
                .flat_map(|(p, (q, dlq))| [(q.name().to_string(), p as u16), (dlq.name().to_string(), p as u16)])
                .collect(),
            strays_to: parts.iter().enumerate().map(|(p, (q, _))| (p as u16, q.clone())).collect(),
            keyring,
        },
    );
    let agg = Arc::new(aggregator);
    // Finished jobs' blobs are purged in the background; a stop waits for the purges under way.
    let retention = Duration::from_secs(settings.blob_retention_secs);
    let (finished_tx, finished_rx) = tokio::sync::mpsc::unbounded_channel();
    agg.purging().notify(finished_tx);
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
    rebalance(&own, &readers, false).await;
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
    let actions = Arc::new(timers::Actions {
        agg: agg.clone(),
        own: own.clone(),
        readers: readers.clone(),
        notifiers: notifiers.clone(),
        abandon_after: Duration::from_secs(settings.abandon_after),
    });
    timers::spawn(&tracker, &timers::Table::new(&settings), &actions, &shutdown);
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
