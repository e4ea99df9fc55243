//! The agent's `keda` backend against a real gRPC client and the real stack (LocalStack queues, a
//! RabbitMQ trigger bus): all four calls of KEDA's external scaler protocol, a StreamIsActive push
//! within 1 s of a work-detected trigger (with the agent idle, its next look minutes away), back to
//! inactive once there is no work, and an SLA-derived metric that follows a real burst. Over TLS (and
//! mTLS): the metric spec stream that follows the SLA-derived target.

use crate::support::Fleet as _;
use std::time::{Duration, Instant};

use fleet_io::provision::QueueSettings;
use fleet_io::queue::Queue;
use fleet_io::trigger::{announce, instance_report_key, WorkDetected, ALL_WORK};
use scaling_agent::keda::proto::external_scaler_client::ExternalScalerClient;
use scaling_agent::keda::proto::{GetMetricsRequest, ScaledObjectRef};
use scaling_agent::keda::KedaBackend;
use tokio_util::sync::CancellationToken;

fn so() -> ScaledObjectRef {
    ScaledObjectRef { name: "processor".into(), namespace: "billing-fleet".into(), scaler_metadata: Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_external_scaler_serves_the_policy_and_pushes_activity_on_a_trigger() {
    let Some(s) = crate::support::stack(QueueSettings::default()).await else { return };
    let stop = CancellationToken::new();
    let settings = scaling_agent::Settings {
        interval_secs: 1,
        // Idle looks slow to 5 minutes: only the trigger can make the push arrive in time.
        idle_interval_secs: 300,
        min_instances: 0,
        max_instances: 5,
        sla_secs: 5,
        instance_throughput: 2.0,
        target_per_instance: None,
        step_up: 4,
        stabilization_secs: 2,
        http_addr: None,
    };
    let target = settings.starting_throughput() * settings.sla_secs as f64;
    let metric = format!("{}-sla-backlog", s.work.name());
    let keda = KedaBackend::new(0, target, metric.clone());
    let addr = keda.serve("127.0.0.1:0".parse().unwrap(), None, stop.clone()).await.unwrap();
    let deps = scaling_agent::Deps {
        watched: scaling_agent::Watched { work: s.work.clone(), work_dlq: s.work_dlq.clone(), results: s.results.clone(), results_dlq: s.results_dlq.clone() },
        publish: s.names.trigger_bus(),
        subscription: s.names.subscribe(vec![ALL_WORK.into(), instance_report_key(s.work.name())], &stop),
        backend: keda.clone(),
    };
    let state = scaling_agent::new_state(&settings, "keda");
    let agent = tokio::spawn(scaling_agent::run_with_state(settings, deps, state.clone(), stop.clone()));

    let mut client = ExternalScalerClient::connect(format!("http://{addr}")).await.unwrap();
    assert!(!client.is_active(so()).await.unwrap().into_inner().result, "active with nothing to do");
    let spec = client.get_metric_spec(so()).await.unwrap().into_inner();
    assert_eq!(spec.metric_specs.len(), 1);
    assert_eq!(spec.metric_specs[0].metric_name, metric);
    assert_eq!(spec.metric_specs[0].target_size_float, target, "the target is throughput x SLA");
    assert_eq!(spec.metric_specs[0].target_size, target as i64);
    let req = |name: &str| GetMetricsRequest { scaled_object_ref: Some(so()), metric_name: name.into() };
    let m = client.get_metrics(req(&format!("s0-{metric}"))).await.unwrap().into_inner();
    assert_eq!(m.metric_values[0].metric_value_float, 0.0);
    assert_eq!(client.get_metrics(req("another")).await.unwrap_err().code(), tonic_code_not_found());

    let mut stream = client.stream_is_active(so()).await.unwrap().into_inner();
    let first = tokio::time::timeout(Duration::from_secs(2), stream.message()).await.unwrap().unwrap().unwrap();
    assert!(!first.result, "the stream starts with the current activity (inactive)");
    // Let the agent slow down (idle), and the bus connect.
    let t = Instant::now();
    while !state.lock().unwrap().bus_live || state.lock().unwrap().interval_s < 4.0 {
        assert!(t.elapsed() < Duration::from_secs(20), "the agent did not go idle: {:?}", state.lock().unwrap().interval_s);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A trigger (work announced by an initiator): "active" is pushed at once.
    let bus = s.names.trigger_bus().unwrap();
    let t0 = Instant::now();
    announce(bus.as_ref(), &WorkDetected { queue: s.work.name().to_string(), messages: 1, source: "initiator".into() }).await;
    let pushed = tokio::time::timeout(Duration::from_secs(1), stream.message()).await.expect("no push within 1 s of the trigger").unwrap().unwrap();
    let latency = t0.elapsed();
    assert!(pushed.result, "the push after a trigger says active");
    assert!(client.is_active(so()).await.unwrap().into_inner().result);
    eprintln!("trigger published -> StreamIsActive push: {:.1} ms", latency.as_secs_f64() * 1e3);

    // Nothing came: inactive again once the stabilization window has passed.
    let off = tokio::time::timeout(Duration::from_secs(15), stream.message()).await.expect("never inactive again").unwrap().unwrap();
    assert!(!off.result);

    // A real burst: 100 work items; the metric asks for as many replicas as the SLA needs (capped).
    let dir = tempfile::tempdir().unwrap();
    let files = vec![crate::support::generated(dir.path(), "burst.csv", 20_000, 100, 3)];
    let t1 = Instant::now();
    let job = s.submit(&files, 200).await;
    assert_eq!(job.total_chunks, 100);
    let on = tokio::time::timeout(Duration::from_secs(1), stream.message()).await.expect("no push within 1 s of the submission's trigger").unwrap().unwrap();
    assert!(on.result);
    eprintln!("submission (upload + enqueue + trigger) -> push: {:.1} ms", t1.elapsed().as_secs_f64() * 1e3);
    let t = Instant::now();
    let value = loop {
        let v = client.get_metrics(req(&metric)).await.unwrap().into_inner().metric_values[0].metric_value_float;
        if v >= 5.0 * target {
            break v;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the metric did not rise to the cap: {v}; {:?}", state.lock().unwrap().last_decision);
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // ceil(value / target) is the HPA's replica count: the policy's capped desire.
    assert_eq!((value / target).ceil() as u32, 5, "100 items at 2/s within 5 s need 10 instances, capped at 5");
    let d = state.lock().unwrap().last_decision.unwrap();
    assert_eq!(d.desired, 5);

    stop.cancel();
    agent.await.unwrap().unwrap();
    // The stream ends with the agent (KEDA then reconnects to the next one).
    let end = tokio::time::timeout(Duration::from_secs(5), async { while let Ok(Some(_)) = stream.message().await {} }).await;
    assert!(end.is_ok(), "the activity stream outlived the agent");
}

fn tonic_code_not_found() -> tonic::Code {
    tonic::Code::NotFound
}

/// A gRPC client of the scaler at `addr` over TLS trusting `ca` (with a client certificate: mTLS).
async fn tls_client(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    identity: Option<&fleet_test_support::tls::Leaf>,
) -> Result<ExternalScalerClient<tonic::transport::Channel>, tonic::transport::Error> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap())).domain_name("localhost");
    if let Some(l) = identity {
        tls = tls.identity(Identity::from_pem(std::fs::read(&l.cert).unwrap(), std::fs::read(&l.key).unwrap()));
    }
    let channel = Endpoint::from_shared(format!("https://localhost:{}", addr.port())).unwrap().tls_config(tls)?.connect().await?;
    Ok(ExternalScalerClient::new(channel))
}

/// StreamMetricSpec over TLS with client certificates: the current spec when the stream opens, nothing
/// for a move under 10 %, the new target pushed for a larger one; GetMetricSpec equals the last spec
/// streamed and GetMetrics keeps ceil(value / target) the policy's count. A plaintext client, and a
/// TLS client without a certificate, get nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metric_spec_stream_follows_the_sla_target_over_mtls() {
    use scaling_agent::backend::Backend;
    use scaling_agent::keda::KedaTls;
    let dir = tempfile::tempdir().unwrap();
    let ca = fleet_test_support::tls::TestCa::new(dir.path(), "fleet test CA");
    let server = ca.leaf("localhost", true);
    let client_cert = ca.leaf("keda-operator", false);
    let stop = CancellationToken::new();
    let keda = KedaBackend::new(0, 600.0, "billing-work-sla-backlog");
    let tls = KedaTls {
        cert_pem: std::fs::read(&server.cert).unwrap(),
        key_pem: std::fs::read(&server.key).unwrap(),
        client_ca_pem: Some(std::fs::read(&ca.ca_cert).unwrap()),
    };
    let addr = keda.serve("127.0.0.1:0".parse().unwrap(), Some(tls), stop.clone()).await.unwrap();

    let mut client = tls_client(addr, &ca.ca_cert, Some(&client_cert)).await.unwrap();
    let mut stream = client.stream_metric_spec(so()).await.unwrap().into_inner();
    let next = async |s: &mut tonic::Streaming<scaling_agent::keda::proto::GetMetricSpecResponse>, within: Duration| {
        tokio::time::timeout(within, s.message()).await.ok().map(|m| m.unwrap().unwrap().metric_specs[0].target_size_float)
    };
    assert_eq!(next(&mut stream, Duration::from_secs(2)).await, Some(600.0), "the current spec when the stream opens");
    assert!(!keda.set_target(630.0), "a 5 % move is not pushed");
    assert_eq!(next(&mut stream, Duration::from_millis(500)).await, None, "nothing streamed for a 5 % move");
    // As the agent's loop does after a decision: throughput x SLA.
    keda.sla_target(299.6);
    assert_eq!(next(&mut stream, Duration::from_secs(2)).await, Some(300.0), "the new target, in whole items");
    let spec = client.get_metric_spec(so()).await.unwrap().into_inner();
    assert_eq!((spec.metric_specs[0].target_size, spec.metric_specs[0].target_size_float), (300, 300.0), "GetMetricSpec equals the last spec streamed");
    keda.scale(3).await.unwrap();
    let m = client.get_metrics(GetMetricsRequest { scaled_object_ref: Some(so()), metric_name: "billing-work-sla-backlog".into() }).await.unwrap().into_inner();
    assert_eq!((m.metric_values[0].metric_value_float / 300.0).ceil(), 3.0, "ceil(value / target) is the policy's count");

    // Plaintext, or TLS without a client certificate: refused.
    let plain = async { ExternalScalerClient::connect(format!("http://127.0.0.1:{}", addr.port())).await.ok()?.get_metric_spec(so()).await.ok() };
    assert!(tokio::time::timeout(Duration::from_secs(5), plain).await.ok().flatten().is_none(), "a plaintext client was served");
    let anonymous = async { tls_client(addr, &ca.ca_cert, None).await.ok()?.get_metric_spec(so()).await.ok() };
    assert!(tokio::time::timeout(Duration::from_secs(5), anonymous).await.ok().flatten().is_none(), "a client without a certificate was served");
    stop.cancel();
}
