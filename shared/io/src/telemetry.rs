//! Tracing setup: RUST_LOG filter, human text (coloured only on a terminal) or JSON lines on stderr;
//! and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, the fleet's spans exported over OTLP (HTTP and
//! protobuf, the collector's port 4318) with the W3C trace context carried between services in each
//! message's `traceparent` attribute, so one job is one trace: the initiator's submission, each
//! processor's billing of a chunk, the controller's applying of its results. Nothing is exported, and
//! no exporter is built, when the variable is not set.

use std::io::IsTerminal;

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
    let _ = tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).try_init();
    Telemetry { provider }
}

/// The W3C `traceparent` of `span`, to send with a message (`None` when nothing is exported or the
/// span is not recorded).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let mut carrier = std::collections::HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` a child of the span that sent a message with this `traceparent` (if any).
pub fn follow(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent else { return };
    let carrier: std::collections::HashMap<String, String> = [("traceparent".to_string(), tp.to_string())].into();
    let cx = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(cx);
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
