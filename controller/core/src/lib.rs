//! The controller's decisions, without I/O (sans-I/O, as quinn-proto keeps its connection state
//! machine apart from its driver): each takes what happened (a document read, the time, what the
//! controller reads now) and returns what to do; the `controller` crate performs it. This crate
//! cannot reach a store, a queue or an async runtime: it depends on none (the domain's types and
//! codecs, serde, tracing and byte buffers), and `deploy/e2e/tests/it/no_switches.rs` checks that its
//! dependency tree stays so.
//!
//! - `job`: a job as a state machine (what each item does to it, when it asks to be saved or
//!   finished, how it ends), generic over the handle of a message it applied;
//! - `save`: a job's checkpoint planned (the document, the part before it, its write condition);
//! - `claims`: each transaction billed once across jobs (a committed ending's rows claimed in chains
//!   of segments by day and shard; another job's claim makes a row its duplicate);
//! - `decision`: how a job ends and what a checkpoint commits;
//! - `item`: what a message brings to a job, and the queue it came from;
//! - `expiry`: the dormant jobs (known from their open marker only) and which are due, and whether
//!   the fleet's queues have emptied since a job's news (the stall rule's condition), and the rule that
//!   ends a quiet job (abandoned unsealed, stalled sealed);
//! - `finish`: a job's finish, effect by effect (the lease renewed, the marker, the manifest, the
//!   ending committed, its transactions claimed, the report, the rows dropped), until it is finished, handed over or quarantined;
//! - `finished`: the jobs finished lately, remembered to drop late duplicates without a read;
//! - `hold`: the messages held through a store outage, when each is extended and when they are tried
//!   again;
//! - `limits`: the job's own sizes and periods, and the figures a message about a chunk is held to
//!   (`Figures`, the largest result payload, the receives an unrecorded message waits);
//! - `partitions`: the results partitions' ownership table and a balancing round's plan;
//! - `records`: a job's own records judging each message (agrees, refused, unrecorded) and its
//!   payload's cap;
//! - `resident`: the jobs in memory (their slots, leases, failing marks and partitions), generic over
//!   the driver's slot and lease;
//! - `take`: taking a job, effect by effect (its lease, its checkpoint read again until the same
//!   document failed twice), and what becomes of it when it is not taken;
//! - `sighting`: expiry judged on the reader's own clock;
//! - `timings`: the shipped timings and their start check;
//! - `waiting`: the partitions whose quiet jobs wait for results that may come unannounced;
//! - `undo`: the mutation harness's switches (compiled in only under `cfg(fleet_undo)`, which only
//!   `controller-core-undoable`, the harness's build of this crate, sets).

pub mod claims;
pub mod decision;
pub mod expiry;
pub mod finish;
pub mod finished;
pub mod hold;
pub mod item;
pub mod job;
pub mod limits;
pub mod partitions;
pub mod records;
pub mod resident;
pub mod save;
pub mod sighting;
pub mod take;
pub mod timings;
pub mod undo;
pub mod waiting;
