//! `fleet-sim`: runs seeds of the deterministic simulation (`fleet_sim`) on every core and reports
//! the ones that break an invariant, each with its fault schedule and the command that reruns it
//! alone (RUST_LOG prints the controllers' logs); `--undo` runs them with one fix of the controller undone (`controller::undo`), to measure
//! what the simulation catches.
//!
//! ```sh
//! cargo run --release -p fleet-sim -- --seeds 10000        # a soak; prints seeds per second
//! cargo run --release -p fleet-sim -- --seed 1234 --trace  # one seed, its whole trace
//! cargo run --release -p fleet-sim -- --mutations          # every fix undone in turn: seeds to the first failure
//! ```

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use controller::undo::Fix;

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
    /// No work-detected triggers: every listener long-polls (by default half the runs put triggers
    /// on an in-memory bus, and idle listeners park and wake on them, as with RabbitMQ).
    #[arg(long)]
    no_triggers: bool,
    /// Stop at the first failing seed.
    #[arg(long)]
    fail_fast: bool,
    /// Threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Undo this fix of the controller (see `controller::undo::Fix`; `--undo list` names them).
    #[arg(long)]
    undo: Option<String>,
    /// Undo every fix in turn and print, for each, the seeds run to its first failure (up to --seeds).
    #[arg(long, conflicts_with_all = ["seed", "undo"])]
    mutations: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let opts = fleet_sim::Options { echo: args.trace, no_hostile: args.no_hostile, triggers: !args.no_triggers, every_call: false };
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let undo = match args.undo.as_deref() {
        None => None,
        Some("list") => {
            for f in Fix::ALL {
                println!("{:<24} {}", f.name(), f.describe());
            }
            return ExitCode::SUCCESS;
        }
        Some(name) => match Fix::ALL.into_iter().find(|f| f.name() == name) {
            Some(f) => Some(f),
            None => {
                eprintln!("no fix named {name:?}; `--undo list` names them");
                return ExitCode::from(2);
            }
        },
    };
    if args.mutations {
        println!("| fix undone | seeds to the first failure (of {}) | failing seed | what failed |", args.seeds);
        println!("|---|---|---|---|");
        for f in Fix::ALL {
            let started = Instant::now();
            let first = fleet_sim::first_failure(args.from, args.seeds, threads, opts, Some(f));
            let secs = started.elapsed().as_secs_f64();
            match first {
                Some((ran, run)) => {
                    let what = run.violations.first().map(|v| v.chars().take(110).collect::<String>()).unwrap_or_default();
                    println!("| {} | {ran} | {} | {} |", f.describe(), run.seed, what.replace('|', "/"));
                }
                None => println!("| {} | not caught in {} seeds ({secs:.0} s) | | |", f.describe(), args.seeds),
            }
        }
        return ExitCode::SUCCESS;
    }
    if let Some(seed) = args.seed {
        let run = fleet_sim::run_seed_undone(seed, opts, undo);
        if !args.trace {
            for l in &run.schedule {
                println!("  {l}");
            }
        }
        println!(
            "seed {seed}: {} controllers, {} partitions, {} jobs, {:.0} s simulated, trace {} lines (hash {:016x})",
            run.setup.controllers,
            run.setup.partitions,
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
    let soak = fleet_sim::soak(args.from, args.seeds, threads, opts, undo, args.fail_fast, |run, ran, failed| {
        if !run.violations.is_empty() {
            print!("{}", run.failure());
        }
        if ran % 200 == 0 {
            eprintln!("{ran} seeds, {failed} failed, {:.1} seeds/s", ran as f64 / started.elapsed().as_secs_f64());
        }
    });
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{} seeds in {secs:.1} s on {threads} threads: {:.1} seeds/s, {:.0} simulated hours ({} at the shipped defaults, {} calm); {} failed{}; latest report {:.0} s past its bound's base; the largest inflated payload held {} KiB; two controllers read one partition for {:.0} s at most; {} runs with a graceful stop that left messages held",
        soak.ran,
        soak.ran as f64 / secs,
        soak.simulated_secs / 3600.0,
        soak.defaults,
        soak.calm,
        soak.failed.len(),
        if soak.failed.is_empty() { String::new() } else { format!(": {:?}", soak.failed) },
        soak.worst_lateness,
        soak.most_inflated.div_ceil(1024),
        soak.longest_co_read,
        soak.left_held,
    );
    if soak.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
