//! The processor service: consumer tasks that receive work items from the work queue in batches of
//! ten, bill the chunks they reference, send the chunk results to the results queue and only then
//! delete the work items. A failing work item is left for redelivery and reaches the dead-letter
//! queue after maxReceiveCount.

pub mod handle;
pub mod listener;

use std::sync::Arc;
use std::time::Duration;

use shared::blob::BlobStore;
use shared::queue::Queue;
use shared::trigger::WorkDetected;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// Processor settings (the binary fills them from flags and env).
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Concurrent consumer tasks, each receiving batches of 10 work items.
    #[arg(long, env = "PROCESSOR_CONSUMERS", default_value_t = 4)]
    pub consumers: usize,
    /// Long-poll wait of a receive, seconds (0-20).
    #[arg(long, env = "PROCESSOR_RECEIVE_WAIT_SECS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=20))]
    pub receive_wait_secs: u64,
    /// Hard cap on a chunk's decompressed size, bytes (larger chunks are refused as corrupt).
    #[arg(long, env = "PROCESSOR_MAX_CHUNK_BYTES", default_value_t = 64 << 20)]
    pub max_chunk_bytes: u64,
    /// How long a failed work item stays invisible before it is retried, seconds.
    #[arg(long, env = "PROCESSOR_RETRY_DELAY_SECS", default_value_t = 2)]
    pub retry_delay_secs: u64,
    /// Grace period for in-flight work on shutdown, seconds.
    #[arg(long, env = "PROCESSOR_DRAIN_SECS", default_value_t = 30)]
    pub drain_secs: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { consumers: 4, receive_wait_secs: 20, max_chunk_bytes: 64 << 20, retry_delay_secs: 2, drain_secs: 30 }
    }
}

impl Settings {
    pub fn receive_wait(&self) -> Duration {
        Duration::from_secs(self.receive_wait_secs.min(20))
    }
}

/// The services a processor talks to.
#[derive(Clone)]
pub struct Deps {
    pub work: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
    pub store: Arc<dyn BlobStore>,
    /// Work-detected triggers (RabbitMQ subscription), when enabled.
    pub triggers: Option<broadcast::Sender<WorkDetected>>,
}

/// Runs the processor until `shutdown`, then drains in-flight work within the grace period.
pub async fn run(settings: Settings, deps: Deps, shutdown: CancellationToken) -> shared::Result<()> {
    listener::run(settings, deps, shutdown).await
}
