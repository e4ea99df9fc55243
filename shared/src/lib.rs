//! Shared core of the billing fleet: the data model, CSV validation, billing, chunk codec, S3 key layout,
//! and one small trait per external service (queue, blob store, trigger bus) with its AWS/RabbitMQ
//! implementation and an in-memory one for deterministic tests.

pub mod billing;
pub mod blob;
pub mod codec;
pub mod config;
pub mod error;
pub mod generate;
pub mod input;
pub mod layout;
pub mod listener;
pub mod memory;
pub mod model;
pub mod provision;
pub mod queue;
pub mod report;
pub mod requests;
pub mod shutdown;
pub mod telemetry;
pub mod trigger;
pub mod validate;

pub use error::{Error, Result};
