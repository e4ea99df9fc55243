//! The `controller` binary's command line: the fleet's shared flags, the controller's settings and
//! the log flags (read by `src/bin/main.rs`, and by the README's configuration test).

use clap::Parser;
use fleet_io::config::{FleetArgs, LogArgs};

/// Billing fleet controller: aggregates chunk results per job into the S3 warehouse.
#[derive(Parser)]
#[command(version)]
pub struct Cli {
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub settings: crate::Settings,
    #[command(flatten)]
    pub log: LogArgs,
}
