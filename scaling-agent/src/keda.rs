//! The `keda` backend: the agent serves KEDA's external scaler gRPC protocol, so Kubernetes (KEDA and
//! the HPA it manages) scales the processor Deployment by this agent's policy.
//!
//! - `IsActive` / `StreamIsActive`: whether the fleet should run at all (the policy wants instances).
//!   The stream pushes `true` the moment a work-detected trigger arrives, before the agent's next look,
//!   so a Deployment at zero gets its first pod at once (KEDA's `external-push` trigger).
//! - `GetMetricSpec`: the target per replica, derived from the SLA: the work items one instance clears
//!   within it (throughput x SLA seconds).
//! - `GetMetrics`: desired instances x that target, so the HPA's `ceil(value / target)` is exactly the
//!   policy's desired count (the HPA's own tolerance and windows apply on top; deploy/k8s sets them
//!   out of the way).

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
use proto::{GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec, MetricValue, ScaledObjectRef};

/// What KEDA is told, shared by the backend (which the agent's decisions update) and the gRPC service.
#[derive(Debug)]
pub struct KedaBackend {
    desired: watch::Sender<u32>,
    active: watch::Sender<bool>,
    /// Work items one replica clears within the SLA.
    target: f64,
    metric: String,
}

impl KedaBackend {
    /// `target`: work items per replica (throughput x SLA seconds); `metric`: the metric's name.
    pub fn new(initial: u32, target: f64, metric: impl Into<String>) -> Arc<KedaBackend> {
        Arc::new(KedaBackend { desired: watch::Sender::new(initial), active: watch::Sender::new(initial > 0), target: target.max(1.0), metric: metric.into() })
    }

    fn set_active(&self, on: bool) {
        self.active.send_if_modified(|a| std::mem::replace(a, on) != on);
    }

    pub fn target(&self) -> f64 {
        self.target
    }

    /// The metric value for the HPA: desired replicas x target.
    pub fn value(&self) -> f64 {
        *self.desired.borrow() as f64 * self.target
    }

    /// Serves the protocol on `addr` until `shutdown` (open streams end then too); returns the bound
    /// address (port 0: a free one).
    pub async fn serve(self: &Arc<Self>, addr: SocketAddr, shutdown: CancellationToken) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let svc = ExternalScalerServer::new(Service { keda: self.clone(), shutdown: shutdown.clone() });
        tokio::spawn(async move {
            if let Err(e) = tonic::transport::Server::builder().add_service(svc).serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned()).await {
                tracing::error!(error = %e, "the KEDA external scaler endpoint failed");
            }
        });
        tracing::info!(addr = %bound, metric = %self.metric, target = self.target, "serving KEDA's external scaler protocol");
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
}

struct Service {
    keda: Arc<KedaBackend>,
    shutdown: CancellationToken,
}

type ActiveStream = Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send>>;

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
        let mut rx = self.keda.active.subscribe();
        let stop = self.shutdown.clone();
        let first = *rx.borrow_and_update();
        let rest = futures::stream::unfold((rx, stop), |(mut rx, stop)| async move {
            tokio::select! {
                _ = stop.cancelled() => None,
                changed = rx.changed() => {
                    changed.ok()?;
                    let on = *rx.borrow_and_update();
                    Some((Ok(IsActiveResponse { result: on }), (rx, stop)))
                }
            }
        });
        let stream = futures::StreamExt::chain(futures::stream::once(async move { Ok(IsActiveResponse { result: first }) }), rest);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_metric_spec(&self, _: Request<ScaledObjectRef>) -> Result<Response<GetMetricSpecResponse>, Status> {
        let k = &self.keda;
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec { metric_name: k.metric.clone(), target_size: k.target.round() as i64, target_size_float: k.target }],
        }))
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
