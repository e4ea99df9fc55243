//! The memory budget of decoded results: every result payload is decompressed and decoded only with a
//! share of one byte budget taken for the most it can hold (its chunk's recorded figures, see
//! `controller_core::limits::Figures::max_memory`), and keeps that share until it is applied to its job. So whatever
//! number of messages arrive, of whatever declared size, the decoded results in memory at once across all
//! jobs and batches stay within the budget (`--decode-budget-mib`), by construction. A share is taken
//! before its job is locked and given back after, so a task holding a job's lock never waits on it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Default budget (`--decode-budget-mib`): a quarter of the controller pod's 1 GiB limit.
pub const DEFAULT_BUDGET_MIB: u64 = 256;

/// Shares are counted in KiB (a semaphore's permits fit in a `u32` per acquire).
const UNIT: u64 = 1024;

/// One byte budget for decoded results.
pub struct Budget {
    sem: Arc<Semaphore>,
    units: u64,
    /// The most units in use at once (read by tests and the benchmark).
    high_water: AtomicU64,
}

/// A share of the budget, given back when dropped.
#[derive(Debug)]
pub struct Share {
    _permit: Option<OwnedSemaphorePermit>,
}

impl Budget {
    pub fn new(bytes: u64) -> Budget {
        let units = (bytes / UNIT).clamp(1, u64::from(u32::MAX));
        Budget { sem: Arc::new(Semaphore::new(units as usize)), units, high_water: AtomicU64::new(0) }
    }

    /// The budget, bytes.
    pub fn bytes(&self) -> u64 {
        self.units * UNIT
    }

    /// Takes a share of `bytes` (a share larger than the whole budget takes the whole budget: it is
    /// decoded alone), waiting until it is free.
    pub async fn take(&self, bytes: u64) -> Share {
        if bytes == 0 {
            return Share { _permit: None };
        }
        let units = bytes.div_ceil(UNIT).min(self.units) as u32;
        let permit = self.sem.clone().acquire_many_owned(units).await.expect("the budget's semaphore is never closed");
        let in_use = self.units - self.sem.available_permits() as u64;
        self.high_water.fetch_max(in_use, Ordering::Relaxed);
        Share { _permit: Some(permit) }
    }

    /// The most bytes in memory at once so far.
    pub fn high_water(&self) -> u64 {
        self.high_water.load(Ordering::Relaxed) * UNIT
    }

    /// Bytes in memory now.
    pub fn in_use(&self) -> u64 {
        (self.units - self.sem.available_permits() as u64) * UNIT
    }
}

/// Splits items with their shares (bytes) into consecutive runs whose shares add up to at most
/// `budget` each (an item larger than the budget alone in its run): each run is decoded and applied
/// before the next takes its share, so no run waits for shares its own items hold.
pub fn runs<T>(items: Vec<(T, u64)>, budget: u64) -> Vec<(Vec<T>, u64)> {
    let mut out: Vec<(Vec<T>, u64)> = Vec::new();
    for (item, bytes) in items {
        match out.last_mut() {
            Some((run, sum)) if sum.saturating_add(bytes) <= budget => {
                run.push(item);
                *sum += bytes;
            }
            _ => out.push((vec![item], bytes)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_fit_the_budget_and_keep_the_order() {
        let r = runs(vec![('a', 40), ('b', 50), ('c', 20), ('d', 500), ('e', 1)], 100);
        assert_eq!(r, vec![(vec!['a', 'b'], 90), (vec!['c'], 20), (vec!['d'], 500), (vec!['e'], 1)]);
    }

    #[tokio::test]
    async fn shares_never_exceed_the_budget() {
        let b = Arc::new(Budget::new(10 * UNIT));
        let held = futures::future::join_all((0..20).map(|i| {
            let b = b.clone();
            async move {
                let s = b.take((i % 4 + 1) * UNIT).await;
                assert!(b.in_use() <= b.bytes());
                tokio::task::yield_now().await;
                drop(s);
            }
        }));
        held.await;
        assert!(b.high_water() <= b.bytes());
        assert_eq!(b.in_use(), 0);
        let all = b.take(1 << 40).await;
        assert_eq!(b.in_use(), b.bytes(), "a share larger than the budget takes all of it");
        drop(all);
    }
}
