//! One trace per job, over real processes: an OTLP receiver (HTTP and protobuf, as a collector's port
//! 4318) started by the test gets the `initiator`'s submission span, a `processor`'s billing spans and
//! the `controller`'s spans applying the results of one job, all under one trace id: the W3C trace
//! context went with every work item and result as a message attribute (`traceparent`) on real SQS.

use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_io::provision::QueueSettings;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

use crate::support::*;

/// One span as the receiver got it: service, name, trace id (hex), its `job_id` attribute if any.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    name: String,
    trace: String,
    job: Option<String>,
}

/// Serves `POST /v1/traces` on a free port; every span it gets goes into the returned list.
async fn receiver() -> (String, Arc<Mutex<Vec<Got>>>) {
    let spans: Arc<Mutex<Vec<Got>>> = Arc::default();
    let sink = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: bytes::Bytes| {
            let sink = sink.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export");
                let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                };
                let mut got = sink.lock().unwrap();
                for rs in req.resource_spans {
                    let service =
                        rs.resource.iter().flat_map(|r| r.attributes.iter()).find(|a| a.key == "service.name").and_then(|a| text(&a.value)).unwrap_or_default();
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            let job = s.attributes.iter().find(|a| a.key == "job_id").and_then(|a| text(&a.value));
                            got.push(Got { service: service.clone(), name: s.name.clone(), trace: hex::encode(&s.trace_id), job });
                        }
                    }
                }
                ([(axum::http::header::CONTENT_TYPE, "application/x-protobuf")], Vec::<u8>::new())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), spans)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_is_one_trace_across_initiator_processor_and_controller() {
    let Some(st) = stack(QueueSettings::default()).await else { return };
    let (endpoint, spans) = receiver().await;
    // Exported within a fifth of a second of ending (the batch processor's delay).
    let otel = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "200")];
    let spawn = |name: &str| {
        let mut cmd = fleet_command(&st, name);
        cmd.envs(otel).env("LISTENER_RECEIVE_WAIT_SECS", "1").env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::inherit());
        cmd.spawn().expect("start the binary")
    };
    let mut processor = spawn("processor");
    let mut controller = spawn("controller");
    let dir = tempfile::tempdir().unwrap();
    let file = generated(dir.path(), "traced.csv", 3_000, 40, 5);
    let mut submit = fleet_command(&st, "initiator");
    submit.envs(otel).args(["submit", file.to_str().unwrap(), "--chunk-size", "1000", "--wait", "--json"]);
    let out = tokio::task::spawn_blocking(move || submit.output().expect("run the initiator")).await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let job = report["job_id"].as_str().unwrap().to_string();

    let t = Instant::now();
    let (trace, services) = loop {
        let got = spans.lock().unwrap().clone();
        let trace = got.iter().find(|s| s.service == "initiator" && s.name == "submit" && s.job.as_deref() == Some(job.as_str())).map(|s| s.trace.clone());
        if let Some(trace) = trace {
            let of = |service: &str, name: &str| got.iter().filter(|s| s.trace == trace && s.service == service && s.name == name).count();
            if of("processor", "bill_chunk") >= 3 && of("controller", "apply_results") >= 1 {
                let services: BTreeSet<String> = got.iter().filter(|s| s.trace == trace).map(|s| s.service.clone()).collect();
                break (trace, services);
            }
        }
        assert!(t.elapsed() < Duration::from_secs(30), "the job's spans did not all arrive under one trace: {got:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(services, ["controller", "initiator", "processor"].map(String::from).into(), "trace {trace}");
    assert_ne!(trace, "0".repeat(32));
    for child in [&mut processor, &mut controller] {
        let _ = child.kill();
        let _ = child.wait();
    }
}
