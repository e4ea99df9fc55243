//! Traces over real processes: an OTLP receiver (HTTP and protobuf, as a collector's port 4318)
//! started by the test gets every span of the `initiator`, a `processor` and the `controller`. Each
//! job is one trace from its submission (`submit`, its `send_work` PRODUCER spans) to the billing of
//! its chunks (`bill_chunk` CONSUMER spans, children of the send that carried each work item) and the
//! sending of their results (`send_results` PRODUCER): the W3C trace context went with every work
//! item and result as a message attribute (`traceparent`) on real SQS. The controller's batch span
//! (`apply_results`, CONSUMER) holds two jobs' results here, and links the context of each result
//! (OpenTelemetry's guidance for batch receive) instead of joining the first one's trace.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_io::provision::QueueSettings;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message as _;

use crate::support::*;

/// One span as the receiver got it: service, name, kind, ids (hex), attributes (strings and
/// integers, as text), links (trace id, span id), status code.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    name: String,
    kind: i32,
    trace: String,
    span: String,
    parent: String,
    attrs: BTreeMap<String, String>,
    links: Vec<(String, String)>,
    status: i32,
}

impl Got {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }
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
                    Some(Value::IntValue(i)) => Some(i.to_string()),
                    _ => None,
                };
                let mut got = sink.lock().unwrap();
                for rs in req.resource_spans {
                    let service =
                        rs.resource.iter().flat_map(|r| r.attributes.iter()).find(|a| a.key == "service.name").and_then(|a| text(&a.value)).unwrap_or_default();
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            got.push(Got {
                                service: service.clone(),
                                name: s.name.clone(),
                                kind: s.kind,
                                trace: hex::encode(&s.trace_id),
                                span: hex::encode(&s.span_id),
                                parent: hex::encode(&s.parent_span_id),
                                attrs: s.attributes.iter().filter_map(|a| Some((a.key.clone(), text(&a.value)?))).collect(),
                                links: s.links.iter().map(|l| (hex::encode(&l.trace_id), hex::encode(&l.span_id))).collect(),
                                status: s.status.as_ref().map_or(0, |st| st.code),
                            });
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

/// Waits (30 s at most) until `found` finds what it looks for in the spans received so far.
async fn until<T>(spans: &Mutex<Vec<Got>>, what: &str, found: impl Fn(&[Got]) -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        let got = spans.lock().unwrap().clone();
        if let Some(v) = found(&got) {
            return v;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{what}: not among the spans received: {got:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn messaging(s: &Got, operation: &str, queue: &str) {
    assert_eq!(s.attr("messaging.system"), Some("aws_sqs"), "{s:#?}");
    assert_eq!(s.attr("messaging.operation.type"), Some(operation), "{s:#?}");
    assert!(s.attr("messaging.destination.name").is_some_and(|d| d.starts_with(queue)), "destination {queue}: {s:#?}");
}

/// A child process killed when dropped (a failed assertion too leaves none behind).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_job_is_one_trace_and_the_controllers_batch_links_both_jobs() {
    let Some(st) = stack(QueueSettings::default()).await else { return };
    let (endpoint, spans) = receiver().await;
    // Exported within a fifth of a second of ending (the batch processor's delay).
    let otel = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "200")];
    let spawn = |name: &str| {
        let mut cmd = fleet_command(&st, name);
        cmd.envs(otel).env("LISTENER_RECEIVE_WAIT_SECS", "1").env("RUST_LOG", "warn").stdout(Stdio::null()).stderr(Stdio::inherit());
        Killed(cmd.spawn().expect("start the binary"))
    };
    // The processor bills both jobs before the controller starts: their results wait on the results
    // queue, and the controller's first receive takes them in one batch.
    let processor = spawn("processor");
    let dir = tempfile::tempdir().unwrap();
    let mut jobs = Vec::new();
    for (name, rows, seed) in [("two-chunks.csv", 2_000, 5), ("one-chunk.csv", 800, 6)] {
        let file = generated(dir.path(), name, rows, 40, seed);
        let mut submit = fleet_command(&st, "initiator");
        submit.envs(otel).args(["submit", file.to_str().unwrap(), "--chunk-size", "1000", "--json"]);
        let out = tokio::task::spawn_blocking(move || submit.output().expect("run the initiator")).await.unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        jobs.push((v["job_id"].as_str().unwrap().to_string(), v["chunks"].as_u64().unwrap() as usize));
    }

    // Each job: one trace, from its submission to the sending of its results.
    let mut traces = Vec::new();
    for (job, chunks) in &jobs {
        let (trace, got) = until(&spans, &format!("job {job}'s spans under one trace"), |got| {
            let submit = got.iter().find(|s| s.service == "initiator" && s.name == "submit" && s.attr("job_id") == Some(job))?;
            let of = |service: &str, name: &str| got.iter().filter(|s| s.trace == submit.trace && s.service == service && s.name == name).count();
            (of("processor", "bill_chunk") >= *chunks && of("processor", "send_results") >= 1).then(|| (submit.trace.clone(), got.to_vec()))
        })
        .await;
        assert_ne!(trace, "0".repeat(32));
        let in_trace = |name: &str| got.iter().filter(|s| s.trace == trace && s.name == name).cloned().collect::<Vec<_>>();
        let submit = &in_trace("submit")[0];
        let sends = in_trace("send_work");
        assert!(!sends.is_empty(), "no send_work span in trace {trace}");
        for s in &sends {
            assert_eq!(s.kind, SpanKind::Producer as i32, "{s:#?}");
            assert_eq!(s.parent, submit.span, "a send is a child of its submission: {s:#?}");
            messaging(s, "send", &st.names.work_queue);
            assert!(s.attr("messaging.batch.message_count").is_some(), "{s:#?}");
        }
        let send_ids: BTreeSet<&str> = sends.iter().map(|s| s.span.as_str()).collect();
        for b in in_trace("bill_chunk") {
            assert_eq!(b.kind, SpanKind::Consumer as i32, "{b:#?}");
            assert!(send_ids.contains(b.parent.as_str()), "a work item's processing is a child of the send that carried it: {b:#?}");
            messaging(&b, "process", &st.names.work_queue);
            assert!(b.attr("messaging.message.id").is_some_and(|id| !id.is_empty()), "{b:#?}");
            assert_ne!(b.status, StatusCode::Error as i32, "{b:#?}");
        }
        for r in in_trace("send_results") {
            assert_eq!(r.kind, SpanKind::Producer as i32, "{r:#?}");
            messaging(&r, "send", &st.names.results_queue);
            let n: usize = r.attr("messaging.batch.message_count").and_then(|n| n.parse().ok()).unwrap_or(0);
            assert!((1..=*chunks).contains(&n), "{r:#?}");
        }
        traces.push(trace);
    }

    // Now the controller: one batch with both jobs' results, linked to each (not a child of either).
    let controller = spawn("controller");
    let batch = until(&spans, "an apply_results batch linking both jobs' traces", |got| {
        got.iter()
            .find(|s| {
                let linked: BTreeSet<&str> = s.links.iter().map(|(t, _)| t.as_str()).collect();
                s.service == "controller" && s.name == "apply_results" && traces.iter().all(|t| linked.contains(t.as_str()))
            })
            .cloned()
    })
    .await;
    assert_eq!(batch.kind, SpanKind::Consumer as i32, "{batch:#?}");
    messaging(&batch, "process", &st.names.results_queue);
    let count: usize = batch.attr("messaging.batch.message_count").and_then(|n| n.parse().ok()).expect("messaging.batch.message_count");
    let results: usize = jobs.iter().map(|(_, n)| n).sum();
    assert!(count >= results, "the batch held {count} messages, fewer than the {results} results: {batch:#?}");
    assert!(!traces.contains(&batch.trace), "the batch span is in a trace of its own, not the first job's: {batch:#?}");
    assert_eq!(batch.parent, "", "{batch:#?}");
    // Each result's context once (the span that billed its chunk), and nothing else.
    let linked: BTreeSet<&(String, String)> = batch.links.iter().collect();
    assert_eq!(linked.len(), batch.links.len(), "links are deduplicated: {batch:#?}");
    let billed: BTreeSet<(String, String)> = {
        let got = spans.lock().unwrap();
        got.iter().filter(|s| s.name == "bill_chunk" && traces.contains(&s.trace)).map(|s| (s.trace.clone(), s.span.clone())).collect()
    };
    assert!(batch.links.iter().all(|l| billed.contains(l)), "every link is a result's billing span: {batch:#?} {billed:#?}");
    assert!((traces.len()..=results.min(count)).contains(&batch.links.len()), "one link per result in the batch: {batch:#?}");
    assert_ne!(batch.status, StatusCode::Error as i32, "{batch:#?}");
    drop((processor, controller));
}
