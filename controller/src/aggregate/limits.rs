//! The aggregation's limits and periods, in one place: what a job, a checkpoint and a result may
//! weigh, and how often and how long the aggregator waits (a leaf: it imports nothing of its
//! siblings). The job's own (when it is checkpointed, how its rows are kept) are the core's
//! (`controller_core::limits`), re-exported here.

use std::time::Duration;

pub use controller_core::limits::{Figures, DEAD_LETTER_REASON, FLUSH_INTERVAL, FLUSH_MESSAGES, INLINE_ROWS, MAX_RESULT_BYTES, UNRECORDED_RECEIVES};
pub use controller_core::timings::{LEASE, SETTLE};

/// Largest decompressed checkpoint accepted.
pub(super) const MAX_DOC_BYTES: u64 = 1 << 30;
/// A message its job has no record of (see `records`) goes back to the results queue for this long,
/// until its receive [`UNRECORDED_RECEIVES`] times (the core's rule).
pub(super) const UNRECORDED_WAITS: Duration = Duration::from_secs(20);
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
