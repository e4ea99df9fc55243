//! Ordered submission on a FIFO work queue (seed 003's partitions): with `--group-by account`, every
//! account's transactions go to one of `groups` partitions (a stable hash of the account id), each
//! partition is chunked on its own, and its work items carry the partition as their MessageGroupId.
//! Processors then bill one partition's chunks one at a time, in file order, and different partitions
//! in parallel. Without grouping, each chunk on a FIFO queue is its own group (no order, full
//! parallelism).

/// What work items are grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GroupBy {
    /// The transaction's account: one account's transactions are processed in order.
    Account,
}

/// How a submission assigns transactions to partitions and work items to message groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping {
    /// One partition; on a FIFO queue every chunk gets its own group.
    None,
    /// `groups` partitions by account.
    Account { groups: u32 },
}

impl Grouping {
    pub fn new(by: Option<GroupBy>, groups: u32) -> Grouping {
        match by {
            None => Grouping::None,
            Some(GroupBy::Account) => Grouping::Account { groups: groups.max(1) },
        }
    }

    /// Number of partitions (chunk writers) the reader keeps.
    pub fn partitions(self) -> usize {
        match self {
            Grouping::None => 1,
            Grouping::Account { groups } => groups as usize,
        }
    }

    /// The partition of a transaction.
    pub fn partition(self, account_id: &str) -> usize {
        match self {
            Grouping::None => 0,
            Grouping::Account { groups } => (xxhash_rust::xxh3::xxh3_64(account_id.as_bytes()) % u64::from(groups)) as usize,
        }
    }

    /// The MessageGroupId of a chunk's work item on a FIFO queue. Account partitions do not name the
    /// job, so one account's chunks stay in order across jobs submitted with the same `groups`.
    pub fn group_id(self, job_id: &str, chunk: u32, partition: usize) -> String {
        match self {
            Grouping::None => format!("{job_id}-{chunk}"),
            Grouping::Account { groups } => format!("accounts-{partition}-of-{groups}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_map_to_stable_partitions_within_bounds() {
        let g = Grouping::new(Some(GroupBy::Account), 8);
        assert_eq!(g.partitions(), 8);
        let mut seen = std::collections::HashSet::new();
        for i in 0..1000 {
            let a = format!("ACC{i:05}");
            let p = g.partition(&a);
            assert!(p < 8);
            assert_eq!(p, g.partition(&a), "stable");
            seen.insert(p);
        }
        assert_eq!(seen.len(), 8, "1,000 accounts use every partition");
        assert_eq!(g.group_id("j", 3, 5), "accounts-5-of-8");
        assert_eq!(Grouping::new(None, 8).partitions(), 1);
        assert_eq!(Grouping::new(None, 8).group_id("j", 3, 0), "j-3");
        assert_eq!(Grouping::new(Some(GroupBy::Account), 0).partitions(), 1, "0 groups means one");
    }
}
