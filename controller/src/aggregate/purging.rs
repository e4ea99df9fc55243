//! Where finished jobs' purges are recorded: a finished job's open marker goes only once the purge of
//! its blobs is recorded (the marker is the purge's one trace should this controller die before the
//! purger wrote its own), so a finish asks here first.

use std::sync::Mutex;
use std::time::Duration;

use fleet_io::lock;
use tokio::sync::mpsc::UnboundedSender;

use crate::purge::ToPurge;

/// How long a finish waits for its purge to be recorded (a marker's write, behind purges at once
/// under way) before it keeps the job's open marker for a later scan.
const PURGE_RECORDED_WITHIN: Duration = Duration::from_secs(90);

/// Where finished jobs' purges are recorded, under one lock.
#[derive(Default)]
pub struct Purging(Mutex<To>);

/// Who records them.
#[derive(Default)]
enum To {
    /// No purger (tests, tools): a finished job's open marker goes at once.
    #[default]
    Nowhere,
    /// The purger, told each finished job and answering whether its purge is recorded.
    Purger(UnboundedSender<ToPurge>),
    /// Stopped: nothing is recorded any more, so open markers stay for the next controller's scan.
    Stopped,
}

impl Purging {
    /// Sends the id of every job finished from now on to `tx` (the purger).
    pub fn notify(&self, tx: UnboundedSender<ToPurge>) {
        *lock(&self.0) = To::Purger(tx);
    }

    /// Stops sending finished jobs (the receiver ends once it has what was sent).
    pub fn stop(&self) {
        *lock(&self.0) = To::Stopped;
    }

    /// Whether finished job `job_id`'s purge is recorded (or there is no purger to record it): its
    /// open marker may go. Not when the purger failed, timed out or stopped: the marker stays for a
    /// later scan.
    pub(super) async fn recorded(&self, job_id: &str) -> bool {
        let tx = match &*lock(&self.0) {
            To::Nowhere => return true,
            To::Purger(tx) => tx.clone(),
            To::Stopped => return false,
        };
        let (recorded, heard) = tokio::sync::oneshot::channel();
        let sent = tx.send((job_id.to_string(), recorded)).is_ok();
        if !sent || !matches!(tokio::time::timeout(PURGE_RECORDED_WITHIN, heard).await, Ok(Ok(true))) {
            tracing::warn!(job = %job_id, "the finished job's purge is not recorded yet: its open marker stays for the next scan");
            return false;
        }
        true
    }
}
