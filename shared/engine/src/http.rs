//! The engine's HTTP endpoints (feature `http`). The state endpoint is read-only and makes no request
//! to AWS (it reports the last look): `GET /state` (JSON), `GET /metrics` (Prometheus), `GET /livez`
//! and `GET /readyz` (200 or 503 with the reasons, for an orchestrator's probes) and `GET /healthz`.
//! The admin endpoint serves `PUT /throttle`, which changes the throttle limits at runtime; it binds
//! to localhost unless given another address, starts only with a token, and answers 401 to a request
//! without `Authorization: Bearer <token>`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::routing::{get, put};
use axum::{Json, Router};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::admin::AdminToken;
use super::args::ListenerArgs;
use super::state::{Health, ListenerState};
use super::throttle::{LimitsChange, ThrottleLimits};
use super::Engine;

/// A metric: name, help text and how to read it from a state.
type Metric<T> = (&'static str, &'static str, fn(&ListenerState) -> T);

/// A breaker metric: name, help text and how to read it from a breaker's state.
type BreakerMetric<T> = (&'static str, &'static str, fn(&fleet_io::breaker::BreakerState) -> T);

/// Renders states in the OpenMetrics text format, with the process's own metrics
/// ([`crate::metrics`]). A series whose value is unknown (no depth looked at yet) is left out.
pub fn render_metrics(states: &[ListenerState]) -> String {
    let mut root = Registry::default();
    crate::metrics::register_build_info(&mut root);
    fleet_io::metrics::register(&mut root);
    crate::metrics::register_service(&mut root);
    let listener = root.sub_registry_with_prefix("listener");
    render_listeners(states, listener);
    crate::metrics::register_handling(listener);
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = encode(&mut out, &root);
    out
}

fn render_listeners(states: &[ListenerState], reg: &mut Registry) {
    let depths: [Metric<Option<i64>>; 2] = [
        ("queue_visible", "Approximate visible messages in the queue", |s| s.depth.map(|d| d.visible as i64)),
        ("queue_in_flight", "Approximate in-flight messages of the queue", |s| s.depth.map(|d| d.in_flight as i64)),
    ];
    for (name, help, f) in depths {
        let fam = Family::<Vec<(String, String)>, Gauge>::default();
        for s in states {
            if let Some(v) = f(s) {
                fam.get_or_create(&vec![("queue".to_string(), s.queue.clone())]).set(v);
            }
        }
        reg.register(name, help, fam);
    }
    let gauges: [Metric<i64>; 11] = [
        ("consumers_active", "Consumers receiving now", |s| s.consumers_active as i64),
        ("consumers", "Consumer tasks alive (active, parked or stopping)", |s| s.consumers_total as i64),
        ("consumers_max", "Upper bound of consumers", |s| s.consumers_max as i64),
        ("concurrency_in_use", "Messages being processed", |s| s.concurrency_in_use as i64),
        ("concurrency_limit", "Maximum messages processed at once", |s| s.concurrency_limit as i64),
        ("buffer_len", "Messages waiting in the priority buffer", |s| s.buffer_len as i64),
        ("buffer_capacity", "Capacity of the priority buffer", |s| s.buffer_capacity as i64),
        ("in_hand", "Messages received and not yet completed", |s| s.in_hand as i64),
        ("pending_deletes", "Deletes waiting for a batch", |s| s.pending_deletes as i64),
        ("paused", "1 while a dependency's breaker is open (nothing is received)", |s| i64::from(!s.paused_for.is_empty())),
        ("held", "Messages held through a dependency's outage", |s| s.held as i64),
    ];
    for (name, help, f) in gauges {
        let fam = Family::<Vec<(String, String)>, Gauge>::default();
        for s in states {
            fam.get_or_create(&vec![("queue".to_string(), s.queue.clone())]).set(f(s));
        }
        reg.register(name, help, fam);
    }
    let counters: [Metric<u64>; 10] = [
        ("receives", "Receive calls", |s| s.receives),
        ("empty_receives", "Receive calls that returned nothing", |s| s.empty_receives),
        ("received", "Messages received", |s| s.received),
        ("processed", "Messages processed", |s| s.processed),
        ("failed", "Messages that failed", |s| s.failed),
        ("expired", "Messages expired in the buffer", |s| s.expired),
        ("evicted", "Messages evicted from a full buffer", |s| s.evicted),
        ("extended", "Visibility extensions", |s| s.extended),
        ("holds", "Times a message was held for a dependency's outage", |s| s.held_total),
        ("pauses", "Times a consumer paused for an open breaker", |s| s.paused_total),
    ];
    for (name, help, f) in counters {
        let fam = Family::<Vec<(String, String)>, Counter>::default();
        for s in states {
            fam.get_or_create(&vec![("queue".to_string(), s.queue.clone())]).inc_by(f(s));
        }
        reg.register(name, help, fam);
    }
    let down = Family::<Vec<(String, String)>, Gauge>::default();
    for s in states {
        for d in &s.paused_for {
            down.get_or_create(&vec![("queue".to_string(), s.queue.clone()), ("dependency".to_string(), d.clone())]).set(1);
        }
    }
    reg.register("dependency_down", "1 for each dependency whose breaker is open", down);
    let breaker_gauges: [BreakerMetric<i64>; 2] = [
        ("breaker_open", "1 while the dependency's breaker is open", |b| i64::from(b.open)),
        ("breaker_failures", "Failed calls in a row to the dependency", |b| i64::from(b.failures)),
    ];
    for (name, help, f) in breaker_gauges {
        let fam = Family::<Vec<(String, String)>, Gauge>::default();
        for s in states {
            for b in &s.breakers {
                fam.get_or_create(&vec![("queue".to_string(), s.queue.clone()), ("dependency".to_string(), b.dependency.clone())]).set(f(b));
            }
        }
        reg.register(name, help, fam);
    }
    let breaker_counters: [BreakerMetric<u64>; 2] =
        [("breaker_trips", "Times the dependency's breaker opened", |b| b.trips), ("breaker_probes", "Probes sent while the breaker was open", |b| b.probes)];
    for (name, help, f) in breaker_counters {
        let fam = Family::<Vec<(String, String)>, Counter>::default();
        for s in states {
            for b in &s.breakers {
                fam.get_or_create(&vec![("queue".to_string(), s.queue.clone()), ("dependency".to_string(), b.dependency.clone())]).inc_by(f(b));
            }
        }
        reg.register(name, help, fam);
    }
}

#[derive(Deserialize)]
struct Which {
    /// Only this queue (default: all).
    queue: Option<String>,
}

/// The listeners a service's endpoints answer for: fixed (a processor's shards), or changing while it
/// runs (a controller's results partitions, started and stopped as it gains and gives them up). Clones
/// share one set.
#[derive(Clone, Default)]
pub struct Engines(Arc<std::sync::RwLock<Vec<Engine>>>);

impl Engines {
    pub fn new(engines: Vec<Engine>) -> Engines {
        Engines(Arc::new(std::sync::RwLock::new(engines)))
    }

    /// The listeners now.
    pub fn all(&self) -> Vec<Engine> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn add(&self, engine: Engine) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).push(engine);
    }

    /// Removes the listener on `queue` (the endpoints no longer answer for it).
    pub fn remove(&self, queue: &str) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).retain(|e| e.queue_name() != queue);
    }
}

impl From<Vec<Engine>> for Engines {
    fn from(engines: Vec<Engine>) -> Engines {
        Engines::new(engines)
    }
}

fn states(engines: &[Engine], which: &Which) -> Vec<ListenerState> {
    engines.iter().filter(|e| which.queue.as_deref().is_none_or(|q| q == e.queue_name())).map(Engine::state).collect()
}

/// 200 with the listeners' health when `ok` holds for every one, 503 otherwise.
fn probe(engines: &[Engine], ok: fn(&Health) -> bool) -> axum::response::Response {
    let h: Vec<Health> = engines.iter().map(Engine::health).collect();
    let code = if h.iter().all(ok) { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(h)).into_response()
}

/// The read-only router for a set of engines: state, metrics, probes.
pub fn router(engines: impl Into<Engines>) -> Router {
    Router::new()
        .route("/state", get(|State(e): State<Engines>, Query(w): Query<Which>| async move { Json(states(&e.all(), &w)) }))
        .route(
            "/metrics",
            get(|State(e): State<Engines>, Query(w): Query<Which>| async move {
                ([(header::CONTENT_TYPE, fleet_io::telemetry::OPENMETRICS_CONTENT_TYPE)], render_metrics(&states(&e.all(), &w)))
            }),
        )
        .route("/livez", get(|State(e): State<Engines>| async move { probe(&e.all(), |h| h.live) }))
        .route("/readyz", get(|State(e): State<Engines>| async move { probe(&e.all(), |h| h.ready) }))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(engines.into())
}

/// Largest body the admin endpoint reads (a limits change is a few dozen bytes).
pub const ADMIN_BODY_LIMIT: usize = 4096;

/// The admin router: `PUT /throttle`, for requests that carry `token`. The token is checked from the
/// headers before a byte of the body is read, and a body is read only up to [`ADMIN_BODY_LIMIT`].
pub fn admin_router(engines: impl Into<Engines>, token: AdminToken) -> Router {
    let guard = move |method: Method, uri: Uri, headers: HeaderMap, req: axum::extract::Request, next: axum::middleware::Next| {
        let token = token.clone();
        async move {
            if !token.authorizes(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes())) {
                // Method and path only: nothing of what was sent.
                tracing::warn!(%method, path = uri.path(), "admin request refused: no valid bearer token");
                return (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")], "a bearer token is required").into_response();
            }
            next.run(req).await
        }
    };
    Router::new()
        .route(
            "/throttle",
            put(|State(e): State<Engines>, Query(w): Query<Which>, body: axum::body::Bytes| async move {
                let e = e.all();
                let change: LimitsChange = match serde_json::from_slice(&body) {
                    Ok(c) => c,
                    Err(err) => return (StatusCode::BAD_REQUEST, format!("limits: {err}")).into_response(),
                };
                if let Err(why) = change.check() {
                    return (StatusCode::BAD_REQUEST, why).into_response();
                }
                let changed: Vec<(String, ThrottleLimits)> = e
                    .iter()
                    .filter(|e| w.queue.as_deref().is_none_or(|q| q == e.queue_name()))
                    .map(|e| (e.queue_name().to_string(), e.set_limits(&change)))
                    .collect();
                if changed.is_empty() {
                    return (StatusCode::NOT_FOUND, "no listener on that queue").into_response();
                }
                tracing::info!(?changed, "throttle limits changed");
                Json(changed).into_response()
            }),
        )
        .layer(axum::extract::DefaultBodyLimit::max(ADMIN_BODY_LIMIT))
        .route_layer(axum::middleware::from_fn(guard))
        .with_state(engines.into())
}

/// Serves `app` on `addr` until `stop` (`what` names it in logs). Returns the bound address.
pub async fn serve_app(what: &'static str, addr: SocketAddr, app: Router, stop: CancellationToken) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await {
            tracing::warn!(error = %e, what, "endpoint failed");
        }
    });
    Ok(bound)
}

/// Serves the read-only router on `addr` until `stop`. Returns the bound address (port 0 picks one).
pub async fn serve(addr: SocketAddr, engines: impl Into<Engines>, stop: CancellationToken) -> std::io::Result<SocketAddr> {
    let bound = serve_app("state", addr, router(engines), stop).await?;
    tracing::info!(%bound, "state endpoint: GET /state, /metrics, /livez, /readyz, /healthz");
    Ok(bound)
}

/// Serves the admin router on `addr` until `stop`. Returns the bound address.
pub async fn serve_admin(addr: SocketAddr, engines: impl Into<Engines>, token: AdminToken, stop: CancellationToken) -> std::io::Result<SocketAddr> {
    let bound = serve_app("admin", addr, admin_router(engines, token), stop).await?;
    tracing::info!(%bound, "admin endpoint: PUT /throttle (bearer token)");
    if !bound.ip().is_loopback() {
        tracing::warn!(%bound, "the admin endpoint listens beyond this host on plain HTTP: its bearer token crosses the network in clear; \
            keep it behind TLS (a sidecar, an ingress, a service mesh) or bind it to 127.0.0.1");
    }
    Ok(bound)
}

/// The endpoints a listener's flags ask for: the state endpoint on `--http-addr`, the admin endpoint
/// on `--admin-addr` when a token is given. Returns their bound addresses.
pub async fn serve_from_args(args: &ListenerArgs, engines: &[Engine], stop: &CancellationToken) -> fleet_io::Result<(Option<SocketAddr>, Option<SocketAddr>)> {
    serve_from_args_with(args, &Engines::new(engines.to_vec()), stop).await
}

/// [`serve_from_args`] for a set of listeners that may change while served (the controller's).
pub async fn serve_from_args_with(
    args: &ListenerArgs,
    engines: &Engines,
    stop: &CancellationToken,
) -> fleet_io::Result<(Option<SocketAddr>, Option<SocketAddr>)> {
    let config = |what: &str, addr: SocketAddr, e: std::io::Error| fleet_io::Error::Config(format!("{what} endpoint on {addr}: {e}"));
    let state = match args.http_addr {
        Some(addr) => Some(serve(addr, engines.clone(), stop.clone()).await.map_err(|e| config("state", addr, e))?),
        None => None,
    };
    let admin = match args.admin_token() {
        Some(token) => Some(serve_admin(args.admin_addr, engines.clone(), token, stop.clone()).await.map_err(|e| config("admin", args.admin_addr, e))?),
        None => None,
    };
    Ok((state, admin))
}
