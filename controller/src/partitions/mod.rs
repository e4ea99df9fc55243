//! Partitioned results (seed 003's partitioned consumers): the results queue is in `--results-partitions`
//! partitions, each job's messages travel on one of them (chosen when it is submitted), and each
//! partition is read by one controller at a time. So a result reaches the controller that owns its job,
//! never one that must hand it back and spend one of its receives: in normal operation nothing goes to a
//! dead-letter queue, however many controllers run.
//!
//! Ownership is one document in the bucket (`partitions/owners.json`), changed only by conditional
//! writes (If-Match its ETag, If-None-Match when absent), so two controllers never both believe they
//! own a partition. It holds the live controllers (each with the time its membership runs out,
//! renewed every third of the lease time) and each partition's owner, epoch (grows with every change
//! of owner) and, when another controller asked for it, who wants it.
//!
//! Balancing follows Event Hubs' `EventProcessorClient`: each controller claims free partitions (never
//! owned, or owned by a controller whose membership ran out) up to its share (the partition count over
//! the live controllers, give or take one), and one below its share asks for a partition of the most
//! loaded controller. Unlike Event Hubs, which steals at once (both read the partition until the old
//! owner notices), the ask is a hand-over: the owner stops reading the partition (the batch in hand
//! applied, its jobs checkpointed and their leases given back) and only then writes the new owner
//! in. A dead controller's partitions are free once its membership runs out: when a peer has seen
//! it unrenewed for one lease time of the peer's own clock (`sighting`; never by comparing the
//! writer's wall clock with the reader's, so any clock skew takes nothing still being read). A
//! controller that cannot renew stops reading its partitions when its last write is two thirds of a
//! lease old, before any peer may take them.
//!
//! [`plan`] decides (pure, in `controller-core`: the document as read, the time, what this controller
//! reads now; returns the document to write and the partitions to start and stop); [`Ownership`]
//! (this file) reads and writes it with conditional writes, and the seeded simulation of rounds in
//! `tests.rs` checks the protocol whole; `readers` acts on a round's plan, starting and stopping the
//! listeners of the partitions gained and given up.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::layout::PARTITIONS_KEY;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::error::Result;
use tokio::time::Instant;

use crate::clock::Clock;
use crate::sighting::Sightings;

pub use controller_core::partitions::{expired_by_wall, expired_members, plan, Owned, Plan, Table, STATE_LAYOUT};

/// Reads and writes the ownership document for one controller.
pub struct Ownership {
    store: Arc<dyn BlobStore>,
    me: String,
    ttl: Duration,
    count: u16,
    clock: Clock,
    /// When this controller's membership was last written.
    written: Option<Instant>,
    /// The last document read or written, for the status page and the balancing tests.
    last: Table,
    /// When the last round began, and whether it failed (see [`Ownership::next_round_at`]).
    attempt: Option<(Instant, bool)>,
    /// The members' stamps as this controller saw them, to judge their expiry on its own clock.
    seen: Sightings<String, u64>,
}

impl Ownership {
    pub fn new(store: Arc<dyn BlobStore>, me: String, ttl: Duration, count: u16, clock: Clock) -> Ownership {
        Ownership { store, me, ttl, count, clock, written: None, last: Table::default(), attempt: None, seen: Sightings::new(ttl * 3) }
    }

    /// The lease time (a membership runs out this long after its last renewal).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How often to balance: a third of the lease time (a membership is renewed well before it runs
    /// out; a dead controller's partitions are free one lease time after a peer first saw its last
    /// renewal).
    pub fn interval(&self) -> Duration {
        self.ttl / 3
    }

    /// When to balance next: an interval after the last round; after one that failed, a twelfth of
    /// a lease later, or sooner so that three more rounds fit before the membership goes stale (one
    /// failed S3 call, say a 503, must not make it stale: at an interval of a third of a lease, the
    /// next round would begin just as it goes stale, and a peer take the partitions at its end; a
    /// controller whose calls failed one in twenty lost and asked back a partition every 20-30 s in
    /// the simulation, seed 1852; and a hand-over's stop may take half a lease of the two thirds,
    /// seed 1132).
    pub fn next_round_at(&self) -> Instant {
        match self.attempt {
            None => Instant::now(),
            Some((at, true)) if !crate::undo::is(crate::undo::Fix::RoundRetriedSoon) => {
                let left = self.stale_at().map_or(Duration::MAX, |s| s.saturating_duration_since(at));
                at + (self.ttl / 12).min(left / 3).max(Duration::from_millis(250))
            }
            Some((at, _)) => at + self.interval(),
        }
    }

    /// Whether this controller may read its partitions: its membership was written less than two
    /// thirds of a lease ago (the rest is the margin for clock skew and slow calls).
    pub fn fresh(&self) -> bool {
        self.stale_at().is_some_and(|t| Instant::now() < t)
    }

    /// When the membership stops being fresh (see [`Ownership::fresh`]), if it was ever written.
    pub fn stale_at(&self) -> Option<Instant> {
        self.written.map(|w| w + self.ttl * 2 / 3)
    }

    /// The document as last read or written.
    pub fn table(&self) -> &Table {
        &self.last
    }

    /// One balancing round: reads the document, plans, and writes it (renewing this controller's
    /// membership); when partitions must be stopped first (the plan's `stop`), the caller stops them
    /// and calls again (on the way out nothing is written before). A write that loses a race is
    /// planned again from what the other controller wrote.
    pub async fn round(&mut self, running: &BTreeSet<u16>, leaving: bool) -> Result<Plan> {
        let at = Instant::now();
        let result = self.round_once(running, leaving).await;
        self.attempt = Some((at, result.is_err()));
        result
    }

    /// The members of `table` (other than this controller) it has seen unrenewed for a whole lease.
    fn expired(&mut self, table: &Table) -> BTreeSet<String> {
        expired_members(table, &self.me, &mut self.seen, Instant::now().into_std(), self.ttl, self.clock.now_ms())
    }

    async fn round_once(&mut self, running: &BTreeSet<u16>, leaving: bool) -> Result<Plan> {
        for _ in 0..5 {
            let (table, cond) = match self.store.get_tagged(PARTITIONS_KEY).await? {
                None => (Table::default(), Cond::Absent),
                Some((body, etag)) => match serde_json::from_slice::<Table>(&body) {
                    Ok(t) => (t, Cond::Matches(etag)),
                    Err(e) => {
                        tracing::warn!(error = %e, key = PARTITIONS_KEY, "unreadable partition ownership: written anew");
                        (Table::default(), Cond::Matches(etag))
                    }
                },
            };
            self.last = table.clone();
            let expired = self.expired(&table);
            let plan = plan(&table, &self.me, &expired, self.clock.now_ms(), self.ttl, self.count, running, leaving);
            // Partitions to stop first: the membership is renewed all the same (the stops may take a
            // while, and this controller reads its other partitions meanwhile), except on the way out,
            // where the document is written only once nothing is read any more.
            if !plan.stop.is_empty() && leaving {
                return Ok(plan);
            }
            if plan.table == table {
                self.written = Some(Instant::now());
                return Ok(plan);
            }
            let started = Instant::now();
            let body = Bytes::from(serde_json::to_vec(&plan.table)?);
            if fleet_io::blob::put_if_owned(self.store.as_ref(), PARTITIONS_KEY, body, "application/json", &BTreeMap::new(), &cond).await?.is_some() {
                self.written = Some(started);
                self.last = plan.table.clone();
                return Ok(plan);
            }
        }
        Err(fleet_io::Error::Conflict("partition ownership kept changing under five writes in a row; tried again next round".into()))
    }
}

#[cfg(test)]
mod tests;

mod readers;
pub(crate) use readers::{hand_back_held, rebalance, Readers};
