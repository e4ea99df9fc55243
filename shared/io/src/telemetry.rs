//! Tracing setup: RUST_LOG filter, human text (coloured only on a terminal) or JSON lines on stderr.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Services log at `info` by default; a CLI that draws progress bars passes `"warn"`.
pub fn init(json: bool, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(format!("{default_level},aws_config=warn,aws_smithy_runtime=warn,lapin=warn")));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}
