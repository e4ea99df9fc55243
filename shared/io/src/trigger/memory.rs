//! The in-memory [`TriggerBus`] for tests: broadcast channels, and a liveness switch to play a broker
//! outage.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{broadcast, watch};

use super::{InstanceReport, Subscription, TriggerBus, WorkDetected};
use crate::error::Result;

/// In-memory bus for tests: broadcast channels, and a liveness switch to play a broker outage.
pub struct MemoryTriggers {
    pub tx: broadcast::Sender<WorkDetected>,
    pub reports: broadcast::Sender<InstanceReport>,
    pub live: watch::Sender<bool>,
}

impl MemoryTriggers {
    pub fn new() -> Arc<MemoryTriggers> {
        Arc::new(MemoryTriggers { tx: broadcast::channel(256).0, reports: broadcast::channel(1024).0, live: watch::channel(true).0 })
    }

    /// A subscription to this bus (every queue).
    pub fn subscription(&self) -> Subscription {
        Subscription { events: self.tx.clone(), reports: self.reports.clone(), live: self.live.subscribe() }
    }
}

#[async_trait]
impl TriggerBus for MemoryTriggers {
    async fn publish(&self, event: &WorkDetected) -> Result<()> {
        let _ = self.tx.send(event.clone());
        Ok(())
    }

    async fn report(&self, report: &InstanceReport) -> Result<()> {
        let _ = self.reports.send(report.clone());
        Ok(())
    }
}
