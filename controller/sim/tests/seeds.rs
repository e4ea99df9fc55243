//! The simulation in CI: a few hundred seeds, each a whole run of the fleet under faults, every
//! invariant checked (`FLEET_SIM_SEEDS` sets how many, `FLEET_SIM_FROM` the first); and the same seed
//! twice gives the same run, step for step.

use fleet_sim::{run_seed, Options};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn seeds_keep_every_invariant() {
    let from = env("FLEET_SIM_FROM", 1);
    let n = env("FLEET_SIM_SEEDS", 400);
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    for seed in from..from + n {
        let run = run_seed(seed, Options::default());
        if !run.violations.is_empty() {
            eprint!("{}", run.failure());
            failed.push(seed);
        }
    }
    eprintln!("{n} seeds in {:.1} s", started.elapsed().as_secs_f64());
    assert!(failed.is_empty(), "seeds breaking an invariant: {failed:?}");
}

#[test]
fn a_seed_replays_exactly() {
    // 303: one controller cut off from S3 for 609 s while it holds a job's last real result.
    for seed in [26, 215, 303] {
        let a = run_seed(seed, Options::default());
        let b = run_seed(seed, Options::default());
        assert!(a.trace_len > 50, "the run did something ({} trace lines)", a.trace_len);
        assert_eq!((a.trace_hash, a.trace_len), (b.trace_hash, b.trace_len), "seed {seed} ran differently the second time");
        assert_eq!(a.violations, b.violations);
    }
}
