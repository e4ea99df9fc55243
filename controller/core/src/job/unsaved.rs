//! The messages a job applied and no checkpoint covers yet, counted for the whole controller.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::item::Source;

/// Deliveries applied in memory and waiting for a checkpoint, counted for the whole controller (also
/// when a job is dropped with them: they come back after their visibility timeout).
pub struct Unsaved<H> {
    list: Vec<(Source, H)>,
    count: Arc<AtomicUsize>,
}

impl<H> Unsaved<H> {
    pub fn new(count: Arc<AtomicUsize>) -> Unsaved<H> {
        Unsaved { list: Vec::new(), count }
    }

    pub(super) fn extend(&mut self, kept: Vec<(Source, H)>) {
        self.count.fetch_add(kept.len(), Ordering::Relaxed);
        self.list.extend(kept);
    }

    /// The messages, for their completion.
    pub(super) fn take(&mut self) -> Vec<H> {
        self.take_all().into_iter().map(|(_, k)| k).collect()
    }

    /// The messages with the queue each came from (to apply them again).
    pub(super) fn take_all(&mut self) -> Vec<(Source, H)> {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
        std::mem::take(&mut self.list)
    }

    pub fn iter(&self) -> impl Iterator<Item = &H> {
        self.list.iter().map(|(_, k)| k)
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

impl<H> Drop for Unsaved<H> {
    fn drop(&mut self) {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
    }
}
