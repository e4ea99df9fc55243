//! The job's own sizes and periods: when it asks to be checkpointed, how its rows are kept, the
//! reason a dead-lettered chunk is recorded with, and the figures a message about a chunk is held to (a leaf; the controller's other limits are in
//! `controller::aggregate::limits`, which re-exports those the controller's callers name).

use std::time::Duration;

use fleet_domain::codec::accounts_cap;

/// A job with pending messages is checkpointed at least this often (by the controller's timer while
/// it is idle, by its own next batch while busy) ...
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(250);
/// ... and as soon as this many of its messages are pending.
pub const FLUSH_MESSAGES: usize = 100;

/// Jobs with at most this many (account, currency) rows keep them inside the checkpoint document
/// (one PUT per checkpoint); larger ones keep them in parts.
pub const INLINE_ROWS: usize = 4096;
/// A new base part is written when the parts after the last one hold more rows than the job has (so
/// restoring reads at most about twice the job's rows), or when there are this many parts.
pub const MAX_PARTS: usize = 64;

/// Reason recorded for a chunk known only from its dead-lettered work item.
pub const DEAD_LETTER_REASON: &str = "work item reached the dead-letter queue: processing failed on every allowed attempt";

/// Largest decompressed result payload accepted, whatever its message declares: the account rows of
/// one chunk, which a processor reads only up to its `--max-chunk-bytes` (64 MiB by default) of
/// transactions, and an account row is no longer than the transaction row it sums.
pub const MAX_RESULT_BYTES: u64 = 64 << 20;

/// Bytes an account row may take beyond the account id and currency its chunk's rows already hold: a
/// count of 20 digits, gross and fees of 31 characters each, 4 commas and the newline.
pub const ROW_FIGURES_BYTES: u64 = 20 + 2 * 31 + 5;

/// Bytes a decoded account row takes in memory besides its text (`RowBatch`'s 56-byte entry, twice
/// for the vector's growth).
pub const ROW_MEMORY_BYTES: u64 = 112;

/// The figures a message about a chunk is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figures {
    pub transactions: u64,
    /// The chunk's decompressed CSV size (`None`: a chunk of an older initiator, known from the
    /// manifest or not at all: the payload is capped by its transactions alone).
    pub raw_bytes: Option<u64>,
}

impl Figures {
    /// Most account rows a result of the chunk can have (one per transaction).
    pub fn max_rows(self) -> u64 {
        self.transactions.max(1)
    }

    /// Most bytes its account rows can decompress to: an account row holds an id and a currency that
    /// one of the chunk's rows holds, and its figures; never more than the rows' own bound.
    pub fn max_bytes(self) -> u64 {
        let by_rows = accounts_cap(self.transactions, MAX_RESULT_BYTES);
        match self.raw_bytes {
            Some(raw) => by_rows.min(raw.saturating_add(self.max_rows().saturating_mul(ROW_FIGURES_BYTES))),
            None => by_rows,
        }
    }

    /// Most memory decoding a result of the chunk can hold at once: the compressed payload (no larger
    /// than what it decompresses to), the decompressed text (its buffer may double once), and the
    /// decoded rows.
    pub fn max_memory(self) -> u64 {
        self.max_bytes().saturating_mul(3).saturating_add(self.max_rows().saturating_mul(ROW_MEMORY_BYTES))
    }
}

/// A message its job has no record of goes back to the results queue until its receive this many times (below any maxReceiveCount the fleet provisions), then it is
/// quarantined; from a dead-letter queue, at once.
pub const UNRECORDED_RECEIVES: u32 = 3;
