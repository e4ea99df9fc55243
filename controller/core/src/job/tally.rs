//! What a job has counted: its checkpoint without rows (chunks accounted for, transactions, failed
//! chunks, parts, calls, partition) and its rows (the per-account totals). Read through
//! [`super::Job::tally`]; changed only by the job's transitions (an item applied, a call counted or
//! withdrawn, its partition recorded, a checkpoint written).

use fleet_domain::billing::CheckedTotals;
use fleet_domain::model::Checkpoint;
use fleet_domain::requests::RequestCounts;

pub struct Tally {
    /// Its checkpoint's form, without rows (those are `totals`). While the job is open its `status`,
    /// `note` and `finishing` are not read: the job's phase says them.
    pub(super) cp: Checkpoint,
    pub(super) totals: CheckedTotals,
}

impl Tally {
    /// The results partition its messages travel on, as its checkpoint recorded it.
    pub fn partition(&self) -> Option<u16> {
        self.cp.partition
    }

    /// Its size, once sealed.
    pub fn total_chunks(&self) -> Option<u32> {
        self.cp.total_chunks
    }

    /// Chunks accounted for (processed or failed).
    pub fn accounted(&self) -> usize {
        self.cp.accounted.len()
    }

    /// The chunks accounted for (processed or failed), by number.
    pub fn accounted_chunks(&self) -> &std::collections::BTreeSet<u32> {
        &self.cp.accounted
    }

    /// Its claims, once settled: the rows another job billed first (see `Job::settle_claims`).
    pub fn duplicates(&self) -> Option<&[fleet_domain::model::Rejected]> {
        self.cp.duplicates.as_deref()
    }

    /// Sealed, with every chunk accounted for (processed or failed).
    pub fn all_in(&self) -> bool {
        self.cp.total_chunks == Some(self.cp.accounted.len() as u32)
    }

    /// Checkpoint parts its last checkpoint names (a large job's rows).
    pub fn parts(&self) -> usize {
        self.cp.parts.len()
    }

    /// Transactions counted so far.
    pub fn processed(&self) -> u64 {
        self.cp.processed_transactions
    }

    /// Its rows: the per-account totals.
    pub fn totals(&self) -> &CheckedTotals {
        &self.totals
    }

    /// The calls counted for it so far (by the initiator's manifest aside: by processors and the
    /// controllers), each where it was made.
    pub fn requests(&self) -> &RequestCounts {
        &self.cp.requests
    }
}
