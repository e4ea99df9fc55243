//! The billing fleet's domain: what a transaction is and how it is validated and billed, the chunk codec,
//! the S3 key layout, the documents that travel between the services (work items, results, manifest,
//! checkpoint, report) and the per-job request counts. No network I/O and no async runtime: every
//! service and the fuzzers can use it, and its tests run in microseconds.
//!
//! Module graph (no cycles): `currency` <- `transaction` <- `validate` <- `billing` <- `model` (wire documents) <-
//! `codec`, `report`; `requests` <- `prices` <- `report`; `layout` stands alone.

pub mod billing;
pub mod claim_rows;
pub mod codec;
pub mod currency;
pub mod error;
#[cfg(feature = "fuzz")]
pub mod fuzz;
#[cfg(feature = "generate")]
pub mod generate;
pub mod input;
pub mod layout;
pub mod model;
pub mod prices;
pub mod report;
pub mod requests;
pub mod transaction;
pub mod validate;

pub use error::{Error, Result};
