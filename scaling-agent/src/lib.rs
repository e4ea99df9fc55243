//! Why: the agent's one loop (look, decide, scale, announce) and the state `/state`, `/metrics` and the
//! controller's status page read are here, together; what it decides with (`policy`, `signals`) and
//! what it scales (`backend`, `docker`, `keda`) are each in their own module.
//!
//! The scaling agent (seed 004's Dynamic Scaling Agent): watches the fleet's queues and the instance
//! reports processors publish while they hold work, decides with [`policy`] how many processor
//! instances the workload needs within the SLA, and has a [`backend`] start or stop them. It also
//! publishes a work-detected trigger when a queue turns non-empty (work nobody announced, such as work
//! items back after a killed processor's visibility timeout, or a dead letter moved by SQS redrive), so
//! parked listeners wake without waiting for their next poll.
//!
//! Its own polling slows down (doubling up to `--idle-interval-secs`) while every queue is empty and no
//! instance reports work, and quickens at once on a work-detected trigger (while busy it looks every
//! `--interval-secs` anyway: a trigger then only marks work as detected). While idle it reads the work
//! queue alone (one request a look, one per shard): nothing reaches the other queues but through work
//! items, which it would see first. By default the idle interval is the SLA less two busy intervals,
//! so that work arriving with no trigger at all is still seen, and processed, within the SLA. It is
//! the fleet's one watcher while idle: listeners park, and their own safety poll is hourly.
//!
//! A trigger can be lost (the bus restarted between a publish and a listener's subscription): a queue
//! that shows waiting messages and none in flight at two looks in a row is announced again, unless
//! the fleet is paused for a dependency.

pub mod backend;
pub mod cli;
pub mod docker;
pub mod factory;
pub mod health;
pub mod http;
pub mod keda;
pub mod policy;
pub mod signals;
pub mod simulate;
pub mod simulate_svg;
pub mod step;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_io::queue::{Queue, QueueDepth};
use fleet_io::trigger::{announce_on, Subscription, TriggerBus, WorkDetected};
use serde::Serialize;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::Backend;
use crate::policy::{Decision, PolicyConfig, Reason};
use crate::signals::{InstanceView, Observed};
use crate::step::{Brain, Cadence, Seen};

pub use health::{AgentHealth, LOOK_SLACK};

/// The agent's own source name on triggers it publishes.
pub const SOURCE: &str = "scaling-agent";

/// Agent settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Seconds between two looks at the queues while there is work.
    #[arg(long, env = "AGENT_INTERVAL_SECS", default_value_t = Settings::DEFAULT.interval_secs)]
    pub interval_secs: u64,
    /// Longest time between two looks while every queue is empty (the interval doubles up to it; a
    /// work-detected trigger brings the agent back at once). An idle look is one request per work
    /// queue shard. 0: the SLA less two --interval-secs, so that work that arrives with no trigger is
    /// still processed within the SLA (at the defaults, 50 s: 72 requests an hour).
    #[arg(long, env = "AGENT_IDLE_INTERVAL_SECS", default_value_t = Settings::DEFAULT.idle_interval_secs)]
    pub idle_interval_secs: u64,
    /// Fewest processor instances (0: none while there is no work).
    #[arg(long, env = "AGENT_MIN_INSTANCES", default_value_t = Settings::DEFAULT.min_instances)]
    pub min_instances: u32,
    /// Most processor instances.
    #[arg(long, env = "AGENT_MAX_INSTANCES", default_value_t = Settings::DEFAULT.max_instances)]
    pub max_instances: u32,
    /// The SLA: the longest a work item may wait before it is processed, seconds.
    #[arg(long, env = "AGENT_SLA_SECS", default_value_t = Settings::DEFAULT.sla_secs)]
    pub sla_secs: u64,
    /// Work items per second one instance processes, until instances report their own figure.
    #[arg(long, env = "AGENT_INSTANCE_THROUGHPUT", default_value_t = Settings::DEFAULT.instance_throughput)]
    pub instance_throughput: f64,
    /// The same starting figure as work items per instance within the SLA (throughput x SLA): the
    /// target KEDA's queue-length fallback uses, so Kubernetes can take both from one setting.
    /// Replaces --instance-throughput when given.
    #[arg(long, env = "AGENT_TARGET_PER_INSTANCE", conflicts_with = "instance_throughput", value_parser = positive)]
    pub target_per_instance: Option<f64>,
    /// Most instances added at once beyond doubling the fleet.
    #[arg(long, env = "AGENT_STEP_UP", default_value_t = Settings::DEFAULT.step_up)]
    pub step_up: u32,
    /// A scale-down waits until fewer instances have been enough for this long, seconds.
    #[arg(long, env = "AGENT_STABILIZATION_SECS", default_value_t = Settings::DEFAULT.stabilization_secs)]
    pub stabilization_secs: u64,
    /// State endpoint address (`GET /state`, `GET /metrics`); unset: none.
    #[arg(long, env = "AGENT_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
}

impl Settings {
    /// The defaults of every flag (what the simulation replays too).
    pub const DEFAULT: Settings = Settings {
        interval_secs: 5,
        idle_interval_secs: 0,
        min_instances: 1,
        max_instances: 10,
        sla_secs: 60,
        instance_throughput: 10.0,
        target_per_instance: None,
        step_up: 4,
        stabilization_secs: 120,
        http_addr: None,
    };

    pub fn policy(&self) -> PolicyConfig {
        PolicyConfig {
            min: self.min_instances,
            max: self.max_instances,
            sla: Duration::from_secs(self.sla_secs.max(1)),
            default_throughput: self.starting_throughput(),
            step_up: self.step_up,
            stabilization: Duration::from_secs(self.stabilization_secs),
        }
    }

    /// How often it looks, busy and idle (the idle interval from the SLA unless given).
    pub fn cadence(&self) -> Cadence {
        Cadence::from_secs(self.interval_secs, self.idle_secs())
    }

    fn idle_secs(&self) -> u64 {
        match self.idle_interval_secs {
            0 => self.sla_secs.saturating_sub(2 * self.interval_secs),
            s => s,
        }
    }

    /// Why work that arrives at an idle fleet with no trigger could wait past the SLA, if it could.
    pub fn idle_sla_warning(&self) -> Option<String> {
        let worst = self.cadence().idle_cap.as_secs() + 2 * self.interval_secs.max(1);
        (worst > self.sla_secs).then(|| {
            format!(
                "an idle look every {} s: work that arrives with no trigger may wait up to {worst} s, past the {} s SLA (set --idle-interval-secs 0 to derive it from the SLA)",
                self.cadence().idle_cap.as_secs(),
                self.sla_secs
            )
        })
    }

    /// Items per second per instance until instances report theirs: --target-per-instance / SLA when
    /// given, else --instance-throughput.
    pub fn starting_throughput(&self) -> f64 {
        match self.target_per_instance {
            Some(t) => t / self.sla_secs.max(1) as f64,
            None => self.instance_throughput,
        }
    }

    /// Settings for tests: one look per second, no HTTP endpoint.
    pub fn quick() -> Settings {
        Settings { interval_secs: 1, idle_interval_secs: 1, min_instances: 0, ..Settings::DEFAULT }
    }
}

/// The queues watched, by role.
pub struct Watched {
    pub work: Arc<dyn Queue>,
    pub work_dlq: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
    /// Results that exhausted their receives (S3 down for minutes): SQS moves them without anyone
    /// announcing it, so the agent's trigger is what wakes the controller's listener on it.
    pub results_dlq: Arc<dyn Queue>,
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("'{s}' is not a positive number of work items")),
    }
}

/// Depths of all watched queues.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Snapshot {
    pub work: QueueDepth,
    pub work_dlq: QueueDepth,
    pub results: QueueDepth,
    pub results_dlq: QueueDepth,
}

impl Snapshot {
    fn all_empty(&self) -> bool {
        [self.work, self.work_dlq, self.results, self.results_dlq].iter().all(|d| d.visible + d.in_flight + d.delayed == 0)
    }
}

pub async fn snapshot(w: &Watched) -> fleet_io::Result<Snapshot> {
    let (work, work_dlq, results, results_dlq) = tokio::try_join!(w.work.depth(), w.work_dlq.depth(), w.results.depth(), w.results_dlq.depth())?;
    Ok(Snapshot { work, work_dlq, results, results_dlq })
}

/// An idle look: the work queue alone (the others were empty at the look that found the fleet idle,
/// and only work items lead to messages on them).
pub async fn work_snapshot(w: &Watched) -> fleet_io::Result<Snapshot> {
    Ok(Snapshot { work: w.work.depth().await?, ..Snapshot::default() })
}

/// What the agent talks to.
pub struct Deps {
    pub watched: Watched,
    /// Where it publishes work-detected triggers.
    pub publish: Option<Arc<dyn TriggerBus>>,
    /// Its subscription to every trigger and to the work queue's instance reports.
    pub subscription: Option<Subscription>,
    pub backend: Arc<dyn Backend>,
}

/// What the agent knows, for `/state` and `/metrics`.
#[derive(Debug, Clone, Serialize)]
pub struct AgentState {
    pub backend: &'static str,
    pub policy: PolicyConfig,
    pub depths: Option<Snapshot>,
    pub observed: Observed,
    pub instances: Vec<InstanceView>,
    /// Instances of the backend draining now.
    pub stopping: u32,
    pub last_decision: Option<Decision>,
    /// The last decision that changed the count, and when (seconds since the agent started).
    pub last_change: Option<(f64, Decision)>,
    pub decisions: u64,
    pub scale_ups: u64,
    pub scale_downs: u64,
    /// Seconds until the next look.
    pub interval_s: f64,
    /// SQS requests the agent made.
    pub requests: u64,
    pub triggers_received: u64,
    /// Work-detected triggers it announced (a queue newly waiting, or waiting with nobody taking it).
    pub announced: u64,
    pub bus_live: bool,
    /// Dependencies the fleet is paused for (instances' reports, the agent's own SQS breaker): no
    /// instance is added while this is not empty.
    pub paused_for: Vec<String>,
    /// The agent subscribes to the bus (its liveness counts for readiness then).
    pub bus_configured: bool,
    /// Whether the last look read every watched queue.
    pub last_look_ok: bool,
    /// When the last look ended (liveness: the loop keeps looking).
    #[serde(skip)]
    pub last_look: Option<Instant>,
    /// The last [`HISTORY`] looks that decided, oldest first (the status page's chart).
    pub history: std::collections::VecDeque<Look>,
}

/// Looks kept in [`AgentState::history`].
pub const HISTORY: usize = 180;

/// One look of the agent, as the status page charts it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Look {
    /// Seconds since the agent started.
    pub t: f64,
    /// Work items waiting and in flight.
    pub visible: u64,
    pub in_flight: u64,
    pub actual: u32,
    pub desired: u32,
}

/// Shared handle on the agent's state.
pub type SharedState = Arc<Mutex<AgentState>>;

fn lock(s: &SharedState) -> std::sync::MutexGuard<'_, AgentState> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs the agent until `shutdown`; then the backend stops what it started.
pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> fleet_io::Result<()> {
    let state = new_state(&settings, deps.backend.name());
    if let Some(addr) = settings.http_addr {
        http::serve(addr, state.clone(), shutdown.clone()).await.map_err(|e| fleet_io::Error::Config(format!("state endpoint on {addr}: {e}")))?;
    }
    run_with_state(settings, deps, state, shutdown).await
}

pub fn new_state(settings: &Settings, backend: &'static str) -> SharedState {
    Arc::new(Mutex::new(AgentState {
        backend,
        policy: settings.policy(),
        depths: None,
        observed: Observed::default(),
        instances: Vec::new(),
        stopping: 0,
        last_decision: None,
        last_change: None,
        decisions: 0,
        scale_ups: 0,
        scale_downs: 0,
        interval_s: settings.interval_secs as f64,
        requests: 0,
        triggers_received: 0,
        announced: 0,
        bus_live: false,
        paused_for: Vec::new(),
        bus_configured: false,
        last_look_ok: false,
        last_look: None,
        history: std::collections::VecDeque::new(),
    }))
}

/// [`run`] with a state handle the caller holds (tests read it).
pub async fn run_with_state(settings: Settings, deps: Deps, state: SharedState, shutdown: CancellationToken) -> fleet_io::Result<()> {
    let started = Instant::now();
    lock(&state).bus_configured = deps.subscription.is_some();
    let mut brain = Brain::new(settings.policy(), settings.cadence(), started);
    let w = &deps.watched;
    if let Some(warning) = settings.idle_sla_warning() {
        tracing::warn!("{warning}");
    }
    let mut was_empty = [true; 4];
    // Per queue: the last look saw messages waiting and none in flight (nobody is taking them).
    let mut was_stuck = [false; 4];
    let (mut events, mut reports) = match &deps.subscription {
        Some(s) => (Some(s.events.subscribe()), Some(s.reports.subscribe())),
        None => (None, None),
    };
    loop {
        let now = Instant::now();
        if let Some(rx) = reports.as_mut() {
            loop {
                match rx.try_recv() {
                    // A processor reports once for all shards, under the work queue's name (shard 0's).
                    Ok(r) if r.queue == w.work.name() => brain.report(now, r),
                    Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                    Err(_) => break,
                }
            }
        }
        let look = if brain.idle() { work_snapshot(w).await } else { snapshot(w).await };
        let snap = match look {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "could not read queue depths");
                None
            }
        };
        let mut paused_for = brain.paused_for(now);
        if w.work.breaker().is_some_and(|b| b.is_open()) && !paused_for.iter().any(|d| d == "SQS") {
            paused_for.push("SQS".into());
        }
        if !paused_for.is_empty() && lock(&state).paused_for.is_empty() {
            tracing::warn!(paused_for = ?paused_for, "the fleet is paused for a dependency that does not answer: no instances are added until it does");
        } else if paused_for.is_empty() && !lock(&state).paused_for.is_empty() {
            tracing::info!("the fleet's dependencies answer again: scaling resumes");
        }
        lock(&state).paused_for = paused_for.clone();
        let requests: u64 = [&w.work, &w.work_dlq, &w.results, &w.results_dlq].iter().map(|q| q.calls().snapshot().total()).sum();
        let actual = match snap {
            None => None,
            Some(_) => match deps.backend.actual().await {
                Ok(actual) => Some(actual),
                Err(e) => {
                    tracing::warn!(error = %e, "the backend could not count instances");
                    None
                }
            },
        };
        let seen = snap.map(|s| Seen { work: s.work, all_empty: s.all_empty(), actual, paused: !paused_for.is_empty() });
        let step = brain.step(now, seen);
        if let Some(d) = step.decision {
            log_decision(&d);
            deps.backend.sla_target(d.throughput * brain.policy().sla.as_secs_f64());
            if d.desired != d.actual {
                if let Err(e) = deps.backend.scale(d.desired).await {
                    tracing::warn!(error = %e, desired = d.desired, "the backend could not scale");
                }
            }
        }
        if let (Some(s), Some(observed)) = (snap, step.observed) {
            let seen = [(&w.work, s.work), (&w.results, s.results), (&w.work_dlq, s.work_dlq), (&w.results_dlq, s.results_dlq)];
            for (((queue, depth), was_empty), was_stuck) in seen.into_iter().zip(was_empty.iter_mut()).zip(was_stuck.iter_mut()) {
                let stuck = depth.visible > 0 && depth.in_flight == 0 && paused_for.is_empty();
                // Newly waiting, or waiting with nobody taking it since the last look (a lost trigger).
                if (*was_empty && depth.visible > 0) || (*was_stuck && stuck) {
                    if let Some(t) = &deps.publish {
                        // A sharded queue's depth is its shards' sum: every shard's listeners look.
                        announce_on(t.as_ref(), queue.as_ref(), depth.visible, SOURCE).await;
                    }
                    lock(&state).announced += 1;
                    *was_stuck = false;
                } else {
                    *was_stuck = stuck;
                }
                *was_empty = depth.visible == 0;
            }
            let stopping = deps.backend.stopping().await;
            let mut st = lock(&state);
            st.depths = Some(s);
            st.observed = observed;
            st.instances = brain.instances(now);
            st.stopping = stopping;
            if let Some(d) = step.decision {
                st.decisions += 1;
                if d.desired > d.actual {
                    st.scale_ups += 1;
                } else if d.desired < d.actual {
                    st.scale_downs += 1;
                }
                let t = now.duration_since(started).as_secs_f64();
                if d.desired != d.actual {
                    st.last_change = Some((t, d));
                }
                st.last_decision = Some(d);
                st.history.push_back(Look { t, visible: s.work.visible, in_flight: s.work.in_flight, actual: d.actual, desired: d.desired });
                if st.history.len() > HISTORY {
                    st.history.pop_front();
                }
            }
        }
        {
            let mut st = lock(&state);
            st.interval_s = step.interval.as_secs_f64();
            st.requests = requests;
            st.bus_live = deps.subscription.as_ref().is_some_and(|s| *s.live.borrow());
            st.last_look_ok = snap.is_some();
            st.last_look = Some(Instant::now());
        }
        let wake_at = Instant::now() + step.interval;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    deps.backend.shutdown().await;
                    return Ok(());
                }
                _ = tokio::time::sleep_until(wake_at) => break,
                ev = recv_event(&mut events) => {
                    match ev {
                        Some(ev) if ev.source != SOURCE => {
                            lock(&state).triggers_received += 1;
                            let at_once = if w.work.shard_names().contains(&ev.queue) {
                                deps.backend.work_detected();
                                brain.work_detected()
                            } else {
                                brain.trigger()
                            };
                            // Idle: look at once, work is coming. Busy: the next look is near anyway.
                            if at_once {
                                break;
                            }
                        }
                        Some(_) => {}
                        None => events = None,
                    }
                }
            }
        }
    }
}

/// The next trigger; `None` once the channel closed (and then never again: the caller drops it).
async fn recv_event(events: &mut Option<broadcast::Receiver<WorkDetected>>) -> Option<WorkDetected> {
    let Some(rx) = events.as_mut() else {
        return std::future::pending().await;
    };
    loop {
        match rx.recv().await {
            Ok(ev) => return Some(ev),
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => return None,
        }
    }
}

fn log_decision(d: &Decision) {
    let s = &d.signals;
    macro_rules! decision {
        ($level:ident, $msg:literal) => {
            tracing::$level!(
                actual = d.actual,
                desired = d.desired,
                recommended = d.recommended,
                reason = ?d.reason,
                backlog = s.backlog,
                in_flight = s.in_flight,
                arrival_rate = s.arrival_rate,
                throughput = d.throughput,
                busy_instances = s.busy_instances,
                oldest_age_s = s.oldest_age.map(|a| a.as_secs_f64()),
                work_detected = s.work_detected,
                $msg
            )
        };
    }
    if d.desired != d.actual {
        decision!(info, "scaling decision");
    } else if d.reason == Reason::HoldPaused {
        decision!(info, "holding: more instances are needed, but the fleet is paused for a dependency that does not answer");
    } else if d.reason == Reason::HoldStabilizing {
        decision!(debug, "holding: fewer instances are needed, not yet for the whole stabilization window");
    } else {
        decision!(debug, "scaling decision");
    }
}

#[cfg(test)]
mod tests;
