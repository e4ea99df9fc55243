//! The fleet's jitter: one generator per thread for every random wait (retry back-off, breaker
//! probes, the listeners' idle back-off and trigger spread), seeded from the OS unless a thread is
//! given a seed. A seeded thread draws the same waits in the same order every run, so a
//! current-thread runtime on it (the fleet simulation runs each seed so) replays exactly; services
//! never seed and draw as `rand::rng()` would.

use std::cell::RefCell;
use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

thread_local! {
    static RNG: RefCell<ChaCha8Rng> = RefCell::new(ChaCha8Rng::from_os_rng());
}

/// Draws this thread's jitter from `seed` from now on (until it is seeded again).
pub fn seed_this_thread(seed: u64) {
    RNG.with(|r| *r.borrow_mut() = ChaCha8Rng::seed_from_u64(seed));
}

/// A number uniformly in `range` (`0..n` for `n` = 0 or empty ranges: the start).
pub fn u64_in(range: Range<u64>) -> u64 {
    if range.is_empty() {
        return range.start;
    }
    RNG.with(|r| r.borrow_mut().random_range(range))
}

/// A factor uniformly in `range` (of floats).
pub fn f64_in(range: Range<f64>) -> f64 {
    if range.is_empty() {
        return range.start;
    }
    RNG.with(|r| r.borrow_mut().random_range(range))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seeded_thread_draws_the_same_waits_again() {
        seed_this_thread(7);
        let a: Vec<u64> = (0..8).map(|_| u64_in(0..1_000_000)).collect();
        seed_this_thread(7);
        let b: Vec<u64> = (0..8).map(|_| u64_in(0..1_000_000)).collect();
        assert_eq!(a, b);
        seed_this_thread(8);
        let c: Vec<u64> = (0..8).map(|_| u64_in(0..1_000_000)).collect();
        assert_ne!(a, c, "another seed, other waits");
        assert_eq!(u64_in(5..5), 5, "an empty range gives its start");
        assert!((0.8..1.2).contains(&f64_in(0.8..1.2)));
    }
}
