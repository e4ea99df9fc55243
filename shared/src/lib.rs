//! Shared core of the billing fleet: the data model, CSV validation, billing, chunk codec, S3 key layout,
//! and one small trait per external service (queue, blob store, trigger bus) with its AWS/RabbitMQ
//! implementation and an in-memory one for deterministic tests.

pub mod billing;
pub mod blob;
pub mod call;
pub mod codec;
pub mod config;
pub mod error;
pub mod fuzz;
pub mod generate;
pub mod input;
pub mod layout;
pub mod listener;
pub mod memory;
pub mod model;
pub mod provision;
pub mod quarantine;
pub mod queue;
pub mod report;
pub mod requests;
pub mod shutdown;
pub mod telemetry;
pub mod trigger;
pub mod validate;

pub use error::{Error, Result};

/// Locks a mutex, also after a panic in another holder (the data stays usable: every holder leaves it
/// consistent between statements).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
