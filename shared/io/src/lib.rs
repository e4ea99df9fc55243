//! The billing fleet's I/O layer: one small trait per external service with its AWS/RabbitMQ
//! implementation and, behind the `test-util` feature, an in-memory twin with the same semantics
//! (`queue::{sqs,memory}`, `blob::{s3,memory}`, `trigger::{rabbitmq,memory}`); the call policy that
//! bounds every call, provisioning, the quarantine, configuration, shutdown and telemetry.

pub mod auth;
pub mod blob;
pub mod breaker;
pub mod call;
pub mod config;
pub mod error;
pub mod jitter;
pub mod metrics;
pub mod op;
pub mod pem;
pub mod provision;
pub mod quarantine;
pub mod queue;
pub mod shutdown;
pub mod telemetry;
pub mod trigger;

pub use error::{Error, Result};

/// Locks a mutex, also after a panic in another holder (the data stays usable: every holder leaves it
/// consistent between statements).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The queue and blob store conformance suites (run against the twins and LocalStack).
#[cfg(feature = "test-util")]
pub mod conformance;

/// The in-memory twins in one place, for tests, and the pass-through store tests hook.
#[cfg(feature = "test-util")]
pub mod memory {
    pub use crate::blob::hooked::{Hook, Hooked, Put};
    pub use crate::blob::memory::MemoryStore;
    pub use crate::queue::memory::MemoryQueue;
    pub use crate::trigger::memory::MemoryTriggers;
}

/// Runs CPU-bound `f` off the runtime's threads (the blocking pool) on a multi-thread runtime; in
/// place on a current-thread one, which has no other thread to keep free and whose tasks then run in
/// the same order every time (the fleet simulation's seeds replay so).
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> std::result::Result<T, tokio::task::JoinError> {
    if multi_thread() {
        tokio::task::spawn_blocking(f).await
    } else {
        Ok(f())
    }
}

/// Whether this runs on a multi-thread runtime (a service's), not a current-thread one (the
/// simulation's, most tests').
pub fn multi_thread() -> bool {
    tokio::runtime::Handle::try_current().is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}
