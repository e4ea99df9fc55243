//! `initiator`: the CLI. Parses arguments, sets up tracing, runs the command (`initiator::commands`)
//! and turns its outcome into the exit code: 0 job complete; 1 usage or input error (nothing
//! enqueued); 2 job finished partial; 3 infrastructure error.

use std::process::ExitCode;

use clap::Parser;
use initiator::cli::Cli;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    fleet_io::telemetry::init(cli.log.log_json, "warn");
    let outcome = initiator::commands::run(cli).await;
    fleet_io::call::write_called();
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}
