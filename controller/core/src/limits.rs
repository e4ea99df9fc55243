//! The job's own sizes and periods: when it asks to be checkpointed, how its rows are kept, and the
//! reason a dead-lettered chunk is recorded with (a leaf; the controller's other limits are in
//! `controller::aggregate::limits`, which re-exports those the controller's callers name).

use std::time::Duration;

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
