//! `fleet-sim`: runs seeds of the deterministic simulation (`fleet_sim`) and reports the ones that
//! break an invariant, each with its fault schedule and the command that reruns it alone.
//!
//! ```sh
//! cargo run --release -p fleet-sim -- --seeds 100000        # a soak; prints seeds per second
//! cargo run --release -p fleet-sim -- --seed 1234 --trace   # one seed, its whole trace
//! ```

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Deterministic simulation of the billing fleet's controllers: seeds, faults, invariants")]
struct Args {
    /// Run this one seed (and print its schedule, or with --trace its whole trace).
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run this many seeds, from --from on.
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed of --seeds.
    #[arg(long, default_value_t = 1)]
    from: u64,
    /// Print every step of the run (with --seed).
    #[arg(long)]
    trace: bool,
    /// Send no hostile results.
    #[arg(long)]
    no_hostile: bool,
    /// Stop at the first failing seed.
    #[arg(long)]
    fail_fast: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    }
    let opts = fleet_sim::Options { echo: args.trace, no_hostile: args.no_hostile };
    if let Some(seed) = args.seed {
        let run = fleet_sim::run_seed(seed, opts);
        if !args.trace {
            for l in &run.schedule {
                println!("  {l}");
            }
        }
        println!(
            "seed {seed}: {} controllers, {} jobs, {:.0} s simulated, trace {} lines (hash {:016x})",
            run.controllers,
            run.jobs.len(),
            run.simulated_secs,
            run.trace_len,
            run.trace_hash
        );
        for v in &run.violations {
            println!("  VIOLATION {v}");
        }
        return if run.violations.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    let started = Instant::now();
    let (mut failed, mut simulated) = (Vec::new(), 0.0);
    let mut ran = 0;
    for seed in args.from..args.from + args.seeds {
        let run = fleet_sim::run_seed(seed, opts);
        ran += 1;
        simulated += run.simulated_secs;
        if !run.violations.is_empty() {
            print!("{}", run.failure());
            failed.push(seed);
            if args.fail_fast {
                break;
            }
        }
        if ran % 100 == 0 {
            eprintln!("{ran} seeds, {} failed, {:.1} seeds/s", failed.len(), ran as f64 / started.elapsed().as_secs_f64());
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{ran} seeds in {secs:.1} s: {:.1} seeds/s, {:.0} simulated hours; {} failed{}",
        ran as f64 / secs,
        simulated / 3600.0,
        failed.len(),
        if failed.is_empty() { String::new() } else { format!(": {failed:?}") }
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
