//! The agent's state endpoint: `GET /state` (JSON: depths, signals, instances, the last decision with
//! its inputs and reason) and `GET /metrics` (the same in the Prometheus text format).

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::header;
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::{lock, AgentState, SharedState};

type Labels = Vec<(String, String)>;

fn gauge(reg: &mut Registry, name: &str, help: &str, v: f64) {
    let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    g.set(v);
    reg.register(name, help, g);
}

fn counter(reg: &mut Registry, name: &str, help: &str, v: u64) {
    let c = Counter::<u64>::default();
    c.inc_by(v);
    reg.register(name, help, c);
}

/// A gauge whose value may be unknown: left out then (not a made-up -1).
fn maybe_gauge(reg: &mut Registry, name: &str, help: &str, v: Option<f64>) {
    if let Some(v) = v {
        gauge(reg, name, help, v);
    }
}

/// Renders the state in the OpenMetrics text format, with `fleet_build_info`. A series whose value
/// is unknown (no decision yet, nothing waiting) is left out.
pub fn render_metrics(s: &AgentState) -> String {
    let mut root = Registry::default();
    let info = Family::<Labels, Gauge>::default();
    info.get_or_create(&fleet_io::telemetry::build_info().to_vec()).set(1);
    root.register("fleet_build_info", "Which binary and version this is (always 1)", info);
    fleet_io::metrics::register(&mut root);
    let reg = root.sub_registry_with_prefix("agent");
    let d = s.last_decision;
    maybe_gauge(reg, "desired_instances", "Instances the last decision asked for", d.map(|d| f64::from(d.desired)));
    maybe_gauge(reg, "actual_instances", "Instances running at the last decision", d.map(|d| f64::from(d.actual)));
    maybe_gauge(reg, "recommended_instances", "Instances the workload needs now (before stabilization and step limits)", d.map(|d| f64::from(d.recommended)));
    gauge(reg, "stopping_instances", "Instances draining", f64::from(s.stopping));
    gauge(reg, "reporting_instances", "Instances that reported work lately", f64::from(s.observed.reporting_instances));
    gauge(reg, "busy_instances", "Instances holding work", f64::from(s.observed.busy_instances));
    gauge(reg, "arrival_rate", "Work items arriving per second (smoothed)", s.observed.arrival_rate);
    gauge(
        reg,
        "instance_throughput",
        "Work items per second of one saturated instance (measured, else the default)",
        d.map_or(s.policy.default_throughput, |d| d.throughput),
    );
    maybe_gauge(reg, "oldest_age_seconds", "Age of the oldest waiting work item (absent: none waiting)", s.observed.oldest_age.map(|a| a.as_secs_f64()));
    gauge(reg, "sla_seconds", "The SLA's maximum delay", s.policy.sla.as_secs_f64());
    gauge(reg, "interval_seconds", "Time until the agent's next look", s.interval_s);
    gauge(reg, "bus_live", "1 while the agent's bus subscription is live", f64::from(u8::from(s.bus_live)));
    gauge(reg, "bus_configured", "1 when the agent subscribes to the bus (AMQP_URL given)", f64::from(u8::from(s.bus_configured)));
    let depth = Family::<Labels, Gauge>::default();
    if let Some(q) = s.depths {
        for (name, d) in [("work", q.work), ("work_dlq", q.work_dlq), ("results", q.results), ("results_dlq", q.results_dlq)] {
            for (state, v) in [("visible", d.visible), ("in_flight", d.in_flight), ("delayed", d.delayed)] {
                depth.get_or_create(&vec![("queue".into(), name.into()), ("state".into(), state.into())]).set(v as i64);
            }
        }
    }
    reg.register("queue_messages", "Approximate messages of the watched queues", depth);
    counter(reg, "decisions", "Scaling decisions taken", s.decisions);
    counter(reg, "scale_ups", "Decisions that added instances", s.scale_ups);
    counter(reg, "scale_downs", "Decisions that removed instances", s.scale_downs);
    counter(reg, "sqs_requests", "SQS requests the agent made", s.requests);
    counter(reg, "triggers_received", "Work-detected triggers received", s.triggers_received);
    counter(reg, "triggers_announced", "Work-detected triggers announced (a queue newly waiting, or waiting with nobody taking it)", s.announced);
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = encode(&mut out, &root);
    out
}

/// 200 with the agent's health when `ok` holds, 503 otherwise.
fn probe(s: &SharedState, ok: fn(&crate::AgentHealth) -> bool) -> axum::response::Response {
    use axum::response::IntoResponse;
    let h = lock(s).health(tokio::time::Instant::now());
    let code = if ok(&h) { axum::http::StatusCode::OK } else { axum::http::StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(h)).into_response()
}

pub fn router(state: SharedState) -> Router {
    Router::new()
        .route("/state", get(|State(s): State<SharedState>| async move { Json(lock(&s).clone()) }))
        .route(
            "/metrics",
            get(|State(s): State<SharedState>| async move { ([(header::CONTENT_TYPE, fleet_io::telemetry::OPENMETRICS_CONTENT_TYPE)], render_metrics(&lock(&s))) }),
        )
        .route("/livez", get(|State(s): State<SharedState>| async move { probe(&s, |h| h.live) }))
        .route("/readyz", get(|State(s): State<SharedState>| async move { probe(&s, |h| h.ready) }))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(state)
}

/// Serves the router on `addr` until `stop`. Returns the bound address (port 0 picks one).
pub async fn serve(addr: SocketAddr, state: SharedState, stop: CancellationToken) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(%bound, "agent state endpoint: GET /state, /metrics, /livez, /readyz, /healthz");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(state)).with_graceful_shutdown(async move { stop.cancelled().await }).await {
            tracing::warn!(error = %e, "agent state endpoint failed");
        }
    });
    Ok(bound)
}
