//! The `keda` backend: the agent serves KEDA's external scaler gRPC protocol, so Kubernetes (KEDA and
//! the HPA it manages) scales the processor Deployment by this agent's policy.
//!
//! - `IsActive` / `StreamIsActive`: whether the fleet should run at all (the policy wants instances).
//!   The stream pushes `true` the moment a work-detected trigger arrives, before the agent's next look,
//!   so a Deployment at zero gets its first pod at once (KEDA's `external-push` trigger).
//! - `GetMetricSpec` / `StreamMetricSpec`: the target per replica, derived from the SLA: the work items
//!   one instance clears within it (throughput x SLA seconds, the measured throughput once instances
//!   report it). It is whole items and changes only when it moves by [`TARGET_STEP`] or more; the
//!   stream sends the current spec when it opens and each change, and `GetMetricSpec` always equals
//!   the last spec streamed, so the HPA's target follows the policy live.
//! - `GetMetrics`: desired instances x that target, so the HPA's `ceil(value / target)` is exactly the
//!   policy's desired count (the HPA's own tolerance and windows apply on top; deploy/k8s sets them
//!   out of the way).
//!
//! The endpoint can serve TLS with a given certificate, and require KEDA's client certificate (mTLS)
//! signed by a given CA; without them it is plaintext and must be kept to KEDA by the network policy.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use futures::Stream;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::backend::{Backend, BackendError};

/// The generated protocol code (`proto/externalscaler.proto`).
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("externalscaler");
}

use proto::external_scaler_server::{ExternalScaler, ExternalScalerServer};
/// The smallest relative move of the SLA-derived target that is pushed to KEDA (smaller ones would
/// only churn the HPA).
pub const TARGET_STEP: f64 = 0.10;

/// The endpoint's TLS: PEM certificate chain and key, and the CA that signs the clients' certificates
/// when they must present one.
#[derive(Clone)]
pub struct KedaTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for KedaTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KedaTls").field("client_ca", &self.client_ca_pem.is_some()).finish_non_exhaustive()
    }
}

use proto::{GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec, MetricValue, ScaledObjectRef};

/// What KEDA is told, shared by the backend (which the agent's decisions update) and the gRPC service.
#[derive(Debug)]
pub struct KedaBackend {
    desired: watch::Sender<u32>,
    active: watch::Sender<bool>,
    /// Work items one replica clears within the SLA (whole items, at least 1).
    target: watch::Sender<f64>,
    metric: String,
}

impl KedaBackend {
    /// `target`: work items per replica (throughput x SLA seconds); `metric`: the metric's name.
    pub fn new(initial: u32, target: f64, metric: impl Into<String>) -> Arc<KedaBackend> {
        Arc::new(KedaBackend {
            desired: watch::Sender::new(initial),
            active: watch::Sender::new(initial > 0),
            target: watch::Sender::new(target.round().max(1.0)),
            metric: metric.into(),
        })
    }

    fn set_active(&self, on: bool) {
        self.active.send_if_modified(|a| std::mem::replace(a, on) != on);
    }

    pub fn target(&self) -> f64 {
        *self.target.borrow()
    }

    /// Sets the target per replica to `items` (rounded to whole items, at least 1) when it moved by
    /// [`TARGET_STEP`] or more from the current one; returns whether it changed (and was pushed).
    pub fn set_target(&self, items: f64) -> bool {
        if !items.is_finite() {
            return false;
        }
        let t = items.round().max(1.0);
        let changed = self.target.send_if_modified(|cur| {
            if (t - *cur).abs() >= TARGET_STEP * *cur {
                *cur = t;
                true
            } else {
                false
            }
        });
        if changed {
            tracing::info!(target = t, metric = %self.metric, "KEDA metric target changed (throughput x SLA)");
        }
        changed
    }

    fn spec(&self) -> GetMetricSpecResponse {
        let t = self.target();
        GetMetricSpecResponse { metric_specs: vec![MetricSpec { metric_name: self.metric.clone(), target_size: t as i64, target_size_float: t }] }
    }

    /// The metric value for the HPA: desired replicas x target.
    pub fn value(&self) -> f64 {
        *self.desired.borrow() as f64 * self.target()
    }

    /// Serves the protocol on `addr` until `shutdown` (open streams end then too); returns the bound
    /// address (port 0: a free one).
    /// With `tls`, only TLS connections are served (and with its client CA, only clients that present
    /// a certificate it signed).
    pub async fn serve(self: &Arc<Self>, addr: SocketAddr, tls: Option<KedaTls>, shutdown: CancellationToken) -> std::io::Result<SocketAddr> {
        let mut server = tonic::transport::Server::builder();
        let secure = tls.is_some();
        if let Some(t) = &tls {
            let mut cfg = tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(&t.cert_pem, &t.key_pem));
            if let Some(ca) = &t.client_ca_pem {
                cfg = cfg.client_ca_root(tonic::transport::Certificate::from_pem(ca));
            }
            server = server.tls_config(cfg).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("TLS settings: {e}")))?;
        }
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let svc = ExternalScalerServer::new(Service { keda: self.clone(), shutdown: shutdown.clone() });
        tokio::spawn(async move {
            if let Err(e) = server.add_service(svc).serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned()).await {
                tracing::error!(error = %e, "the KEDA external scaler endpoint failed");
            }
        });
        let client_certs = tls.as_ref().is_some_and(|t| t.client_ca_pem.is_some());
        tracing::info!(addr = %bound, metric = %self.metric, target = self.target(), tls = secure, client_certs, "serving KEDA's external scaler protocol");
        Ok(bound)
    }
}

#[async_trait]
impl Backend for KedaBackend {
    fn name(&self) -> &'static str {
        "keda"
    }

    /// What KEDA was last told (it and the HPA start and stop the pods).
    async fn actual(&self) -> Result<u32, BackendError> {
        Ok(*self.desired.borrow())
    }

    async fn scale(&self, desired: u32) -> Result<(), BackendError> {
        self.desired.send_replace(desired);
        self.set_active(desired > 0);
        Ok(())
    }

    fn work_detected(&self) {
        self.set_active(true);
    }

    fn sla_target(&self, items_per_instance: f64) {
        self.set_target(items_per_instance);
    }
}

struct Service {
    keda: Arc<KedaBackend>,
    shutdown: CancellationToken,
}

type ActiveStream = Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send>>;
type SpecStream = Pin<Box<dyn Stream<Item = Result<GetMetricSpecResponse, Status>> + Send>>;

/// The watched value at once, then every change, until `stop` (or the sender goes away).
fn follow<T: Clone + Send + Sync + 'static, R: Send + 'static>(
    mut rx: watch::Receiver<T>,
    stop: CancellationToken,
    f: impl Fn(&T) -> R + Send + Sync + Clone + 'static,
) -> Pin<Box<dyn Stream<Item = Result<R, Status>> + Send>> {
    let first = f(&rx.borrow_and_update());
    let g = f.clone();
    let rest = futures::stream::unfold((rx, stop, g), |(mut rx, stop, g)| async move {
        tokio::select! {
            _ = stop.cancelled() => None,
            changed = rx.changed() => {
                changed.ok()?;
                let v = g(&rx.borrow_and_update());
                Some((Ok(v), (rx, stop, g)))
            }
        }
    });
    Box::pin(futures::StreamExt::chain(futures::stream::once(async move { Ok(first) }), rest))
}

#[tonic::async_trait]
impl ExternalScaler for Service {
    async fn is_active(&self, _: Request<ScaledObjectRef>) -> Result<Response<IsActiveResponse>, Status> {
        Ok(Response::new(IsActiveResponse { result: *self.keda.active.borrow() }))
    }

    type StreamIsActiveStream = ActiveStream;

    /// The current activity at once, then every change, until the agent stops.
    async fn stream_is_active(&self, req: Request<ScaledObjectRef>) -> Result<Response<ActiveStream>, Status> {
        let r = req.into_inner();
        tracing::info!(scaled_object = %r.name, namespace = %r.namespace, "KEDA opened an activity stream");
        Ok(Response::new(follow(self.keda.active.subscribe(), self.shutdown.clone(), |on: &bool| IsActiveResponse { result: *on })))
    }

    async fn get_metric_spec(&self, _: Request<ScaledObjectRef>) -> Result<Response<GetMetricSpecResponse>, Status> {
        Ok(Response::new(self.keda.spec()))
    }

    type StreamMetricSpecStream = SpecStream;

    /// The current spec at once, then each change of the SLA-derived target, until the agent stops.
    async fn stream_metric_spec(&self, req: Request<ScaledObjectRef>) -> Result<Response<SpecStream>, Status> {
        let r = req.into_inner();
        tracing::info!(scaled_object = %r.name, namespace = %r.namespace, "KEDA opened a metric spec stream");
        let keda = self.keda.clone();
        Ok(Response::new(follow(self.keda.target.subscribe(), self.shutdown.clone(), move |_: &f64| keda.spec())))
    }

    async fn get_metrics(&self, req: Request<GetMetricsRequest>) -> Result<Response<GetMetricsResponse>, Status> {
        let r = req.into_inner();
        let k = &self.keda;
        if !r.metric_name.is_empty() && !r.metric_name.ends_with(&k.metric) {
            return Err(Status::not_found(format!("no metric {:?}; this scaler serves {:?}", r.metric_name, k.metric)));
        }
        let v = k.value();
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue { metric_name: k.metric.clone(), metric_value: v.ceil() as i64, metric_value_float: v }],
        }))
    }
}
