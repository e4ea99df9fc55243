//! The aggregation's limits and periods, in one place: what a job, a checkpoint and a result may
//! weigh, and how often and how long the aggregator waits (a leaf: it imports nothing of its
//! siblings). The job's own (when it is checkpointed, how its rows are kept) are the core's
//! (`controller_core::limits`), re-exported here.

use std::time::Duration;

use fleet_domain::codec::accounts_cap;

pub use controller_core::limits::{DEAD_LETTER_REASON, FLUSH_INTERVAL, FLUSH_MESSAGES, INLINE_ROWS};
pub use controller_core::timings::{LEASE, SETTLE};

/// Largest decompressed checkpoint accepted.
pub(super) const MAX_DOC_BYTES: u64 = 1 << 30;
/// Largest decompressed result payload accepted, whatever its message declares: the account rows of
/// one chunk, which a processor reads only up to its `--max-chunk-bytes` (64 MiB by default) of
/// transactions, and an account row is no longer than the transaction row it sums.
pub const MAX_RESULT_BYTES: u64 = 64 << 20;
/// A message its job has no record of (see `records`) goes back to the results queue for this long ...
pub(super) const UNRECORDED_WAITS: Duration = Duration::from_secs(20);
/// ... until its receive this many times (below any maxReceiveCount the fleet provisions), then it is
/// quarantined; from a dead-letter queue, at once.
pub const UNRECORDED_RECEIVES: u32 = 3;
/// Result payloads decompressed at once (on the blocking pool).
pub(super) const DECODES: usize = 2;

/// Most open-job markers read back at start.
pub(super) const MAX_OPEN_JOBS: usize = 100_000;

/// A message of a job another controller owns goes back to the queue after this long (for its owner).
pub const HAND_BACK: Duration = Duration::from_secs(1);

/// A stray whose forward to its job's partition failed comes back after this long.
pub(super) const STRAY_RETRY: Duration = Duration::from_secs(5);

/// How long a job's messages are turned back without a try after its S3 calls failed.
pub(super) const FAILING_FOR: Duration = Duration::from_secs(2);

/// Bytes an account row may take beyond the account id and currency its chunk's rows already hold: a
/// count of 20 digits, gross and fees of 31 characters each, 4 commas and the newline.
pub(super) const ROW_FIGURES_BYTES: u64 = 20 + 2 * 31 + 5;

/// Bytes a decoded account row takes in memory besides its text (`RowBatch`'s 56-byte entry, twice
/// for the vector's growth).
const ROW_MEMORY_BYTES: u64 = 112;

/// The figures a message about a chunk is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Figures {
    pub(super) transactions: u64,
    /// The chunk's decompressed CSV size (`None`: a chunk of an older initiator, known from the
    /// manifest or not at all: the payload is capped by its transactions alone).
    pub(super) raw_bytes: Option<u64>,
}

impl Figures {
    /// Most account rows a result of the chunk can have (one per transaction).
    pub(super) fn max_rows(self) -> u64 {
        self.transactions.max(1)
    }

    /// Most bytes its account rows can decompress to: an account row holds an id and a currency that
    /// one of the chunk's rows holds, and its figures; never more than the rows' own bound.
    pub(super) fn max_bytes(self) -> u64 {
        let by_rows = accounts_cap(self.transactions, MAX_RESULT_BYTES);
        match self.raw_bytes {
            Some(raw) => by_rows.min(raw.saturating_add(self.max_rows().saturating_mul(ROW_FIGURES_BYTES))),
            None => by_rows,
        }
    }

    /// Most memory decoding a result of the chunk can hold at once: the compressed payload (no larger
    /// than what it decompresses to), the decompressed text (its buffer may double once), and the
    /// decoded rows.
    pub(super) fn max_memory(self) -> u64 {
        self.max_bytes().saturating_mul(3).saturating_add(self.max_rows().saturating_mul(ROW_MEMORY_BYTES))
    }
}
