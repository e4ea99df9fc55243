//! The simulation in CI: a few hundred seeds, each a whole run of the fleet (controllers running
//! `controller::run_with_clock` itself) under faults, every invariant checked, on every core
//! (`FLEET_SIM_SEEDS` sets how many, `FLEET_SIM_FROM` the first); a hundred fresh seeds, a range of
//! the commit's own; a seed run twice makes the same calls at the same instants; and undoing a fix
//! the simulation is known to catch fails a seed.

use controller::undo::Fix;
use fleet_sim::{first_failure, run_seed, soak, Options};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// As `fleet-sim` runs by default: work-detected triggers on an in-memory bus in half the runs.
fn opts() -> Options {
    Options { triggers: true, ..Options::default() }
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn seeds_keep_every_invariant() {
    let from = env("FLEET_SIM_FROM", 1);
    let n = env("FLEET_SIM_SEEDS", 300);
    let started = std::time::Instant::now();
    let s = soak(from, n, threads(), opts(), None, false, |run, _, _| {
        if !run.violations.is_empty() {
            eprint!("{}", run.failure());
        }
    });
    eprintln!(
        "{n} seeds in {:.1} s ({} at the shipped defaults, {} calm), {:.0} simulated hours",
        started.elapsed().as_secs_f64(),
        s.defaults,
        s.calm,
        s.simulated_secs / 3600.0
    );
    assert_eq!(s.ran, n);
    assert!(s.defaults > 0 && s.calm > 0, "the seeds cover the shipped defaults and calm runs");
    assert!(s.failed.is_empty(), "seeds breaking an invariant: {:?}", s.failed);
}

/// A seed replays step by step: every queue and store call, every fault, at the same simulated
/// instant, run after run (the fleet's jitter is drawn from the seed, every `select!` is biased, and
/// nothing runs off the seed's thread), so a failing seed is a regression test as it stands. Seeds
/// 1005 and 1016 went another way about one run in three before (an upload's compression finished on
/// the blocking pool in wall-clock order); the others exercise crashes, stops, upgrades and outages.
/// Seeds nobody ran before: a range derived from the commit under test (`FLEET_SIM_FRESH_FROM`, which
/// deploy/test.sh sets from `git rev-parse HEAD`) or, without it, from today's date, so that no two
/// commits soak the same range and a fix tuned to a fixed range shows. The range is printed, to
/// replay with `fleet-sim --seeds N --from F`.
#[test]
fn fresh_seeds_keep_every_invariant() {
    let days = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() / 86_400);
    let from = env("FLEET_SIM_FRESH_FROM", 1_000_000_000 + days * 10_000);
    let n = env("FLEET_SIM_FRESH", 100);
    eprintln!("fresh seeds: fleet-sim --seeds {n} --from {from}");
    let s = soak(from, n, threads(), opts(), None, false, |run, _, _| {
        if !run.violations.is_empty() {
            eprint!("{}", run.failure());
        }
    });
    assert_eq!(s.ran, n);
    assert!(s.failed.is_empty(), "fresh seeds from {from} breaking an invariant: {:?}", s.failed);
}

/// Every run of a seed is the same, call for call, run after run in one process. Seeds 26 (its
/// stray forwarded), 228229885, 228229896, 228229973 and 228230011 did not replay while the
/// breaker woke the listeners it held through a `watch` channel, in an order drawn from tokio's
/// unseeded generator (11 of 300 fresh seeds from 228229778 did not).
#[test]
fn a_seed_replays_every_call() {
    for seed in [26, 215, 303, 1005, 1016, 1019, 228_229_885, 228_229_896, 228_229_973, 228_230_011] {
        let every = Options { every_call: true, ..opts() };
        let a = run_seed(seed, every);
        assert!(a.trace_len > 50, "the run did something ({} trace lines)", a.trace_len);
        for _ in 0..2 {
            let b = run_seed(seed, every);
            assert_eq!((a.trace_len, a.trace_hash), (b.trace_len, b.trace_hash), "seed {seed} did not replay its trace");
            assert_eq!(a.violations, b.violations);
        }
    }
}

/// Two fixes the simulation catches within a few dozen seeds (see docs/mutations.md for all): with
/// one undone, some seed fails; this keeps the harness itself honest.
#[test]
fn an_undone_fix_fails_a_seed() {
    for fix in [Fix::SealAgainstManifest, Fix::ReportOnce] {
        let found = first_failure(1, 300, threads(), opts(), Some(fix));
        assert!(found.is_some(), "{} undone: no seed of 300 failed", fix.name());
    }
}

/// Seeds that failed once, each kept as a regression: issue 58's 7000529 and 7002198 (a held
/// message's retry loaded a job after its controller let go of the partition: its new reader handed
/// its messages back for ever; `applied-only-where-read`), 9104710 (a chunk with a hostile result
/// ahead and its real result dead-lettered past the settle time: the plan now treats it as it treats
/// a failure report ahead). 7000529 failed with its fix undone until the checkpoints moved under
/// `checkpoints/` (a new job's load now also looks where an earlier release kept it, which altered
/// its run; 2,000 seeds from 7000000 then passed with it undone: the controller's unit test
/// `a_batch_that_fails_after_its_partition_was_let_go_is_handed_back_not_held` catches it), and
/// 7002198 did too before the plan's change for 9104710 altered its run. Seed 1 failed when expiry moved to one clock: a dormant job
/// whose dead owner's lease was first seen busy waited for the next scan, an abandon time later.
/// 61207294 (fresh, 2026-12-06): a hold's visibility extension in flight landed after the hand-back
/// that followed it and left two messages invisible through a graceful stop (the completions now
/// send a release after any extension of its message in flight). 9103683 (the issue's): a result of
/// a dormant job dead-lettered with the scaling agent down waited for the hourly safety poll (the
/// minute's look now covers dormant jobs too). 26121503 (fresh, 2026-12-06): a dead-lettered
/// duplicate of a finished job, unannounced while the scaling agent looked at the work queue alone,
/// held a stalled job an hour (the stall look now announces messages nobody takes;
/// `stall-look-announces`). 171054357 (fresh, the commit's range): a retry of held messages stopped
/// after its partition's listeners had ended showed its message on a call of its own, which failed
/// once and was not tried again (such a call is now tried three times). 171046692 (fresh, the
/// commit's range): a stalled processor's duplicate result 394 s late restarted the job's stall time
/// (a duplicate is no longer news; `duplicates-not-news`). From 845120000 (fresh, the fifteenth
/// stop): 845122901, a dormant job whose checkpoint names no partition, written by the release
/// before partitions, was looked at an abandon time apart and abandoned two abandon times after
/// its news (`unpartitioned-looked-at-each-tick`; the seed stopped reaching that path once a stopping
/// listener returned its polls' messages together); 845123411, a finish whose checkpoint landed
/// unanswered and whose read-back failed took its own write for another controller's at the next
/// try (`earlier-write-read-back`; the seed stopped reaching that path once the stray sender sent
/// again; `fleet_io`'s unit test covers the read-back); 845127842, a graceful stop whose deadline passed while the
/// timer's checkpoint hung left messages applied after a hold invisible for the hold's time (they
/// are now shown shortly before the deadline; `hand-back-held`); 845129128, a hand-back deferred
/// until a misconfigured peer's 120 s lease ran out, which the simulation took for a hold.
/// 228242485 (fresh, the fifteenth stop): a dormant job whose lease a batch found busy was
/// forgotten, so when its messages were dead-lettered nobody looked until the hourly safety poll
/// (`busy-stays-dormant`). 471546826 and 471549780 (fresh, 20,000 from 471530000): no controller
/// read on without ownership, but the co-read check chained three legitimate hand-overs 10-25 s
/// apart into one 68 s co-read; it now measures the overlap of the two controllers' reading runs.
/// 160658493 (fresh, the sixteenth stop, 20,000 from 160646738): the oracle dated a job's quiet
/// from a copy of a chunk's result that reached the results queue 180 s after the chunk's dead
/// letter had landed and been applied (a duplicate to the controller, news to the oracle, which
/// assumed the dead letter always lands after such a copy); the job was abandoned 46 s "early".
/// 283986117 (fresh, the seventeenth stop): a rogue processor's larger count for chunk 0 of a job
/// of the release before records, which died before its manifest, was billed: nothing bounds such
/// a count but the message's own (the upgrade window's documented limit), so the plan no longer
/// forges counts on such a job.
///
/// And the seventeenth stop's participants, each the first seed of 1-1,000 that fails with its fix
/// undone: a rogue submitter's manifest (`complete-only-when-counted`, seed 1), a bomb declaring a
/// million transactions for a chunk without a record (`refuse-over-budget`, 105), a job's ending
/// checkpoint landed unanswered (`earlier-write-read-back`, 142), a copy of a result sent minutes
/// after its job's news by a processor that billed its work item again after its delete was lost
/// (`duplicates-not-news`, 47). Seed 516 failed while that copy was drawn wrongly: a batch sent
/// again after a failure report ahead of it was taken for the copy and stalled, though the oracle
/// had dated its chunks' news from the first try. 168173223 and 168174453 (fresh, 5,000 from
/// 168172415 at 4103a7f): a finish whose first ending write landed unanswered, followed by four more
/// tries without an answer, took its own first write for another controller's (a job remembered the
/// last four bodies of such writes; it now keeps the digests of every one since its last confirmed
/// write, up to 1,024).
///
/// The eighteenth stop's: half the late copies of a chunk whose delete was lost land on the results
/// dead-letter queue, and a quarter of the runs with faults are buggified (lost work items and lost
/// deletes several times as common, at least two jobs); `stall-look-announces` undone now fails
/// seed 519 (a finished job's late copy dead-lettered on a partition nobody waited on held another
/// job's stall an hour). Seed 171046692 is buggified, so its run changed: it still passes, but no
/// longer fails with `duplicates-not-news` undone (seed 47 does).
#[test]
fn regression_seeds_pass() {
    for seed in [
        1,
        7_000_529,
        7_002_198,
        9_103_683,
        9_104_710,
        26_121_503,
        61_207_294,
        160_658_493,
        171_046_692,
        171_054_357,
        516,
        168_173_223,
        168_174_453,
        283_986_117,
        845_122_901,
        845_123_411,
        845_127_842,
        845_129_128,
        342_656_978,
    ] {
        let run = run_seed(seed, opts());
        assert!(run.violations.is_empty(), "seed {seed}: {:?}", run.violations);
    }
    assert!(first_failure(26_121_503, 1, 1, opts(), Some(Fix::StallLookAnnounces)).is_some(), "seed 26121503 passes with the fix undone");
    // (Since issue 60's plans, whose runs carry the tariff's write and, one in four, a twin job,
    // seeds 845127842 and 228242485 no longer meet their faults: seed 5 fails `hand-back-held`, and
    // `busy-stays-dormant` is guarded by its unit test, `CONTROLLER_UNDO=busy-stays-dormant cargo
    // test -p controller-undoable --lib`; both seeds still pass above.)
    assert!(first_failure(5, 1, 1, opts(), Some(Fix::HandBackHeld)).is_some(), "seed 5 passes with the fix undone");
    assert!(first_failure(1, 1, 1, opts(), Some(Fix::CompleteOnlyWhenCounted)).is_some(), "seed 1 passes with the fix undone");
    assert!(first_failure(105, 1, 1, opts(), Some(Fix::RefuseOverBudget)).is_some(), "seed 105 passes with the fix undone");
    assert!(first_failure(214, 1, 1, opts(), Some(Fix::EarlierWriteReadBack)).is_some(), "seed 214 passes with the fix undone");
    assert!(first_failure(47, 1, 1, opts(), Some(Fix::DuplicatesNotNews)).is_some(), "seed 47 passes with the fix undone");
    assert!(first_failure(519, 1, 1, opts(), Some(Fix::StallLookAnnounces)).is_some(), "seed 519 passes with the fix undone");
    assert!(first_failure(1, 1, 1, opts(), Some(Fix::FailedChunksKept)).is_some(), "seed 1 passes with the fix undone");
}
