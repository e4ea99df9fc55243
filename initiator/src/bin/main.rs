//! `initiator`: the CLI. Parses arguments, sets up tracing, runs the command (`initiator::commands`)
//! and turns its outcome into the exit code (`initiator::Exit`): 0 complete; 1 usage or input; 2 job
//! partial or abandoned; 3 infrastructure; 4 `--wait` timed out.

use std::process::ExitCode;

use clap::Parser;
use initiator::cli::Cli;
use initiator::Exit;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version on stdout, exit 0; a usage error on stderr, exit 1 (clap's own 2 is
            // the code of a partial job here).
            let _ = e.print();
            return if e.use_stderr() { Exit::Input.into() } else { Exit::Complete.into() };
        }
    };
    let telemetry = fleet_io::telemetry::init_cli(cli.log.log_json);
    let outcome = initiator::commands::run(cli).await;
    fleet_io::call::write_called();
    let code = match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    };
    // The job's spans still buffered are sent before the process ends.
    drop(telemetry);
    code
}
