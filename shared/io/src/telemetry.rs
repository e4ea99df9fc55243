//! Tracing setup: RUST_LOG filter, human text (coloured only on a terminal) or JSON lines on stderr.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Services log at `info` by default; a CLI that draws progress bars passes `"warn"`.
pub fn init(json: bool, default_level: &str) {
    init_with(json, &format!("{default_level},aws_config=warn,aws_smithy_runtime=warn,lapin=warn"));
}

/// For a command a person runs: warnings of our own only, and a failed call said once, by the
/// command's error, not also by the retry loop's warning. The SDK's lookups of credentials and
/// region (instance metadata, a screen of warnings each where there is none) stay quiet; what is
/// missing is said once, by the command, in one line.
pub fn init_cli(json: bool) {
    init_with(json, "warn,fleet_io::call=error,aws_config=error,aws_smithy_runtime=error,aws_smithy_runtime_api=error,lapin=error");
}

fn init_with(json: bool, directives: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(directives));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
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
