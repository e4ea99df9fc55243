//! The operations the fleet calls on SQS, S3 and RabbitMQ, typed: every bounded call names one
//! ([`crate::call::CallPolicy::run`]), and what the call layer records of it (the process's metrics, the
//! calls file the IAM policies are checked against, the billed-request counter) is keyed by it, not by a
//! string someone spells at the call site.
//!
//! The types are the domain's (`fleet_domain::requests`): [`Op`], and [`Billed`], what the services
//! bill (an attempt of an operation on a standard or a FIFO queue, the further 64 KiB chunks of an SQS
//! payload), which is also what a job's request counts are keyed by up to its report and the price
//! table reads. One type from the client's counter to the report.

pub use fleet_domain::requests::{sqs_extra_chunks, Billed, Op, SQS_BILLING_CHUNK};
