//! The controller's decisions, without I/O (sans-I/O, as quinn-proto keeps its connection state
//! machine apart from its driver): each takes what happened (a document read, the time, what the
//! controller reads now) and returns what to do; the `controller` crate performs it. This crate
//! cannot reach a store, a queue or an async runtime: it depends on none (`serde` alone), and
//! `deploy/e2e/tests/it/no_switches.rs` checks that its dependency tree stays so.
//!
//! - `partitions`: the results partitions' ownership table and a balancing round's plan;
//! - `sighting`: expiry judged on the reader's own clock;
//! - `timings`: the shipped timings and their start check;
//! - `undo`: the mutation harness's switches (compiled in only under `cfg(fleet_undo)`, which only
//!   `controller-core-undoable`, the harness's build of this crate, sets).
//!
//! The aggregation's state machines (the job, its checkpoint plan, the partitions' dormant, waiting
//! and held sets, expiry) are still in `controller::aggregate`, on their way here.

pub mod partitions;
pub mod sighting;
pub mod timings;
pub mod undo;
