//! The `scaling-agent` binary's command line: the fleet's shared flags, the agent's settings and
//! scaling backend, the log flags and `simulate` (read by `src/bin/main.rs`, and by the README's
//! configuration test).

use clap::Parser;
use fleet_io::config::{FleetArgs, LogArgs};

use crate::factory::BackendArgs;

/// Billing fleet scaling agent: watches queue depths and instance reports, scales processor instances
/// to the SLA, and publishes work-detected triggers.
#[derive(Parser)]
#[command(version)]
pub struct Cli {
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub settings: crate::Settings,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Print one snapshot of the queue depths as JSON and exit.
    #[arg(long)]
    pub once: bool,
    #[command(flatten)]
    pub log: LogArgs,
    #[command(subcommand)]
    pub command: Option<Cmd>,
}

/// The agent's subcommands (without one, it runs).
#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Replay a simulated day of seed 004's workload at several volumes under this agent's policy, a
    /// KEDA-like default and a fixed fleet; print SLA misses, instance-hours, requests and cost
    /// (`--svg FILE`: also draw the day).
    Simulate(crate::simulate::SimArgs),
}
