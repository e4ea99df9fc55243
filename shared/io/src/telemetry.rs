//! Tracing setup: RUST_LOG filter, human text (coloured only on a terminal) or JSON lines on stderr;
//! and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, the fleet's spans exported over OTLP (HTTP and
//! protobuf, the collector's port 4318) with the W3C trace context carried between services in each
//! message's `traceparent` attribute, so one job is one trace: the initiator's submission and sends,
//! each processor's billing of a chunk and sending of its results; the controller's applying of a
//! batch of results (several jobs' at once) links each result's context. Nothing is exported, and no
//! exporter is built, when the variable is not set.
//!
//! Queue spans follow OpenTelemetry's messaging conventions ([`Messaging`]): a `send` is a PRODUCER
//! span, the processing of one message a CONSUMER span parented to the context the message came with,
//! and the processing of a batch a CONSUMER span that *links* every message's context ([`link_all`])
//! instead of taking one of them as its parent. Their attributes, links and error status go to the
//! exported span only (not the log lines); without an exporter none of it is computed.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{Status, TraceContextExt as _};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Keeps the OTLP exporter alive; dropping it sends the spans still buffered (at a process's end).
#[must_use = "dropping it stops the trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("trace export: the last spans were not sent: {e}");
            }
        }
    }
}

/// Services log at `info` by default; a CLI that draws progress bars passes `"warn"`.
pub fn init(json: bool, default_level: &str) -> Telemetry {
    init_with(json, &format!("{default_level},aws_config=warn,aws_smithy_runtime=warn,lapin=warn"))
}

/// For a command a person runs: warnings of our own only, and a failed call said once, by the
/// command's error, not also by the retry loop's warning. The SDK's lookups of credentials and
/// region (instance metadata, a screen of warnings each where there is none) stay quiet; what is
/// missing is said once, by the command, in one line.
pub fn init_cli(json: bool) -> Telemetry {
    init_with(json, "warn,fleet_io::call=error,aws_config=error,aws_smithy_runtime=error,aws_smithy_runtime_api=error,lapin=error")
}

/// The fleet's own spans, whatever the log filter says (a CLI logs warnings only, yet traces its job).
fn traced() -> Targets {
    Targets::new()
        .with_target("initiator", LevelFilter::INFO)
        .with_target("processor", LevelFilter::INFO)
        .with_target("controller", LevelFilter::INFO)
        .with_target("scaling_agent", LevelFilter::INFO)
        .with_target("fleet_engine", LevelFilter::INFO)
        .with_target("fleet_io", LevelFilter::INFO)
}

/// The exporter, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (it and the other `OTEL_EXPORTER_OTLP_*`
/// variables are read by the exporter itself).
fn otlp_provider() -> Option<SdkTracerProvider> {
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().filter(|e| !e.trim().is_empty())?;
    let exporter = match opentelemetry_otlp::SpanExporter::builder().with_http().build() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter cannot be built ({e}): no traces are exported");
            return None;
        }
    };
    let service = build_info()[0].1.clone();
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
    Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

fn init_with(json: bool, directives: &str) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(directives));
    let ansi = std::io::stderr().is_terminal();
    let fmt = if json {
        tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).boxed()
    } else {
        tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi).boxed()
    };
    // Built on a thread of its own: the exporter's blocking HTTP client must not be made (or dropped)
    // on an async runtime's thread.
    let provider = std::thread::spawn(otlp_provider).join().ok().flatten();
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("billing-fleet")).with_filter(traced()));
    if provider.is_some() {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    }
    let installed = tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).try_init().is_ok();
    EXPORTING.store(installed && provider.is_some(), Ordering::Relaxed);
    Telemetry { provider }
}

/// The W3C `traceparent` of `span`, to send with a message (`None` when nothing is exported or the
/// span is not recorded).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    // Without the exporting layer a span has no context to carry: nothing is made per message.
    if !exporting() {
        return None;
    }
    let cx = span.context();
    let mut carrier = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` a child of the span that sent a message with this `traceparent` (if any).
pub fn follow(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent.filter(|_| exporting()) else { return };
    let _ = span.set_parent(extract(tp));
}

/// Links `span` to the context each message came with (each distinct one once; messages without one,
/// or with one that does not parse, are skipped): how a span that handles a batch of messages from
/// several traces shows where each came from (OpenTelemetry's guidance for batch receive). Returns
/// how many links were added (0 when nothing is exported).
pub fn link_all<'a>(span: &tracing::Span, traceparents: impl IntoIterator<Item = Option<&'a str>>) -> usize {
    if !exporting() {
        return 0;
    }
    let mut seen = std::collections::HashSet::new();
    let mut linked = 0;
    for tp in traceparents.into_iter().flatten() {
        if !seen.insert(tp) {
            continue;
        }
        let cx = extract(tp);
        let sc = cx.span().span_context().clone();
        if sc.is_valid() {
            span.add_link(sc);
            linked += 1;
        }
    }
    linked
}

fn extract(traceparent: &str) -> opentelemetry::Context {
    let carrier: std::collections::HashMap<String, String> = [("traceparent".to_string(), traceparent.to_string())].into();
    TraceContextPropagator::new().extract(&carrier)
}

/// Whether spans are exported (an OTLP endpoint is configured and the exporting layer installed).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// The `messaging.system` of the fleet's queues.
pub const MESSAGING_SYSTEM: &str = "aws_sqs";

/// What a queue span does (`messaging.operation.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Sending messages (a PRODUCER span).
    Send,
    /// Processing received messages, one or a batch (a CONSUMER span).
    Process,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Send => "send",
            Operation::Process => "process",
        }
    }
}

/// The OpenTelemetry messaging attributes of a queue span: `messaging.system` (`aws_sqs`),
/// `messaging.operation.type` and `.name`, `messaging.destination.name`, and either
/// `messaging.message.id` (one message) or `messaging.batch.message_count` (a batch). The span's kind
/// is its `otel.kind` field (`"producer"` or `"consumer"`), given where it is made.
#[derive(Debug, Clone, Copy)]
pub struct Messaging<'a> {
    pub operation: Operation,
    /// The queue's name.
    pub destination: &'a str,
    /// One message: its id.
    pub message_id: Option<&'a str>,
    /// A batch: how many messages.
    pub batch: Option<usize>,
}

impl Messaging<'_> {
    /// Sets the attributes on the exported `span` (nothing when nothing is exported).
    pub fn set(&self, span: &tracing::Span) {
        if !exporting() {
            return;
        }
        span.set_attribute("messaging.system", MESSAGING_SYSTEM);
        span.set_attribute("messaging.operation.type", self.operation.as_str());
        span.set_attribute("messaging.operation.name", self.operation.as_str());
        span.set_attribute("messaging.destination.name", self.destination.to_string());
        if let Some(id) = self.message_id {
            span.set_attribute("messaging.message.id", id.to_string());
        }
        if let Some(n) = self.batch {
            span.set_attribute("messaging.batch.message_count", n as i64);
        }
    }
}

/// Marks the exported `span` as failed (`ERROR` status, with why as its description).
pub fn fail(span: &tracing::Span, why: impl std::fmt::Display) {
    if exporting() {
        span.set_status(Status::error(why.to_string()));
    }
}

/// The content type every `/metrics` answers with (prometheus-client writes OpenMetrics text).
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The labels of `fleet_build_info`: the binary's name as it was started (`processor`,
/// `controller`, `scaling-agent`, ...) and the workspace version.
pub fn build_info() -> [(String, String); 2] {
    let service = std::env::args()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "unknown".into());
    [("service".to_string(), service), ("version".to_string(), env!("CARGO_PKG_VERSION").to_string())]
}
