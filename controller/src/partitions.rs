//! Why one file: the table, the pure `plan` and the conditional writes that apply it are one protocol,
//! and its seeded simulation (the tests at the end) checks that protocol whole.
//!
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
//! [`plan`] decides (pure: the document as read, the time, what this controller reads now; returns the
//! document to write and the partitions to start and stop); [`Ownership`] reads and writes it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::layout::PARTITIONS_KEY;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::error::Result;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::clock::Clock;
use crate::sighting::Sightings;

/// The ownership document.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Table {
    /// Live controllers, each with the stamp of its last renewal: when its membership runs out by
    /// its own wall clock (Unix ms). Peers judge it by whether the stamp changes, never by its value.
    pub members: BTreeMap<String, u64>,
    /// Each member's lease (ms) as it declares it: a peer judges the member by it when it is longer
    /// than its own (`sighting::lease_to_judge`). Absent in what older releases wrote.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub leases: BTreeMap<String, u64>,
    /// Each member's checkpoint layout ([`STATE_LAYOUT`]); absent for members of releases before
    /// `checkpoints/`, which also drop it when they write the document.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub layouts: BTreeMap<String, u32>,
    /// Each partition's ownership, by partition number.
    pub owners: BTreeMap<u16, Owned>,
}

/// The checkpoint layout this release reads and writes: 2, each job's state under `checkpoints/`
/// (releases before it kept it beside the job's blobs, and read nothing else). A controller of this
/// release claims and asks for no partition while a member of an earlier layout is live (the
/// upgrade gate): an earlier release would resume a job from the checkpoint left where it used to be, a
/// save or more behind, so the two never read the fleet's jobs at the same time.
pub const STATE_LAYOUT: u32 = 2;

/// One partition's ownership.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owned {
    /// Its owner (`None`: free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Grows with every change of owner.
    pub epoch: u64,
    /// A controller below its share asked for it: the owner hands it over once it stopped reading it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wanted_by: Option<String>,
}

impl Table {
    /// The partitions `who` owns.
    pub fn owned_by(&self, who: &str) -> BTreeSet<u16> {
        self.owners.iter().filter(|(_, o)| o.owner.as_deref() == Some(who)).map(|(p, _)| *p).collect()
    }

    /// How many partitions each live controller owns (none for a member that owns none).
    pub fn load(&self) -> BTreeMap<&str, usize> {
        let mut load: BTreeMap<&str, usize> = self.members.keys().map(|m| (m.as_str(), 0)).collect();
        for o in self.owners.values() {
            if let Some(n) = o.owner.as_deref().and_then(|w| load.get_mut(w)) {
                *n += 1;
            }
        }
        load
    }
}

/// What a balancing round decided: the document to write, and what to start and stop reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub table: Table,
    /// Partitions this controller owns (once `table` is written) and does not read yet.
    pub start: BTreeSet<u16>,
    /// Partitions to stop reading before anything is written (asked for by another controller, lost,
    /// or given back on the way out); plan again once they are stopped.
    pub stop: BTreeSet<u16>,
}

/// The members of `table` whose stamp ran out by the wall clock `now_ms` (how expiry was judged
/// before it was judged on one clock; kept for the `one-clock` switch and the plan's tests).
pub fn expired_by_wall(table: &Table, now_ms: u64) -> BTreeSet<String> {
    table.members.iter().filter(|(_, until)| **until <= now_ms).map(|(m, _)| m.clone()).collect()
}

/// The members of `table` other than `me` that a reader has seen unrenewed for a whole lease `ttl`,
/// judged at `at` on its own clock by what it saw before (`seen`, kept to the table's members);
/// with the `one-clock` fix undone, by the wall clock `wall_ms` instead. Pure.
pub fn expired_members(table: &Table, me: &str, seen: &mut Sightings<String, u64>, at: Instant, ttl: Duration, wall_ms: u64) -> BTreeSet<String> {
    if crate::undo::is(crate::undo::Fix::OneClock) {
        return expired_by_wall(table, wall_ms);
    }
    seen.retain(|m| table.members.contains_key(m));
    table
        .members
        .iter()
        .filter(|(m, _)| *m != me)
        .filter(|(m, stamp)| seen.age(*m, **stamp, at) >= crate::sighting::lease_to_judge(ttl, table.leases.get(*m).copied()))
        .map(|(m, _)| m.clone())
        .collect()
}

/// One balancing round of controller `me` (see the module header): `table` as read, `expired` its
/// members this controller judged dead, `now_ms` the stamp it renews its own membership with,
/// `running` the partitions it reads now, `leaving` on a graceful stop (it gives every partition
/// back and leaves the members). Pure.
#[allow(clippy::too_many_arguments)]
pub fn plan(table: &Table, me: &str, expired: &BTreeSet<String>, now_ms: u64, ttl: Duration, count: u16, running: &BTreeSet<u16>, leaving: bool) -> Plan {
    let mut t = table.clone();
    t.members.retain(|m, _| (!expired.contains(m) || crate::undo::is(crate::undo::Fix::DropExpiredMembers)) && m != me);
    // Judged on the live members as read (the expired left out), before this round's entries.
    // A live member without an entry, or this controller listed without one (a member of an earlier
    // release rewrote the document since this one wrote it, and dropped the entries).
    let earlier =
        (table.members.contains_key(me) && !table.layouts.contains_key(me)) || t.members.keys().any(|m| table.layouts.get(m).is_none_or(|l| *l < STATE_LAYOUT));
    if !leaving {
        t.members.insert(me.to_string(), now_ms + ttl.as_millis() as u64);
        t.leases.insert(me.to_string(), ttl.as_millis() as u64);
        t.layouts.insert(me.to_string(), STATE_LAYOUT);
    }
    let Table { members, leases, layouts, .. } = &mut t;
    leases.retain(|m, _| members.contains_key(m));
    layouts.retain(|m, _| members.contains_key(m));
    // Partitions beyond this controller's count are left as they are (a controller with a higher
    // count, during a rolling raise, reads them): never claimed or read here.
    let mut stop: BTreeSet<u16> = running.iter().copied().filter(|p| *p >= count).collect();
    for p in 0..count {
        let o = t.owners.entry(p).or_default();
        // A dead owner's partition is free; a dead asker's ask is void.
        if o.owner.as_deref().is_some_and(|w| w != me && (!t.members.contains_key(w) || crate::undo::is(crate::undo::Fix::LiveOwnerNotFree))) {
            o.owner = None;
        }
        if o.wanted_by.as_deref().is_some_and(|w| !t.members.contains_key(w) || o.owner.as_deref() == Some(w)) {
            o.wanted_by = None;
        }
    }
    for (p, o) in t.owners.iter_mut().filter(|(p, _)| **p < count) {
        // The upgrade gate: nothing is handed to a member of an earlier layout.
        if o.wanted_by.as_deref().is_some_and(|w| table.layouts.get(w).is_none_or(|l| *l < STATE_LAYOUT)) {
            o.wanted_by = None;
        }
        let mine = o.owner.as_deref() == Some(me);
        if !mine {
            // Read here but not ours (taken while this controller could not renew): stop at once.
            if running.contains(p) {
                stop.insert(*p);
            }
            continue;
        }
        if leaving || o.wanted_by.is_some() {
            if running.contains(p) && !crate::undo::is(crate::undo::Fix::HandOverWhenStopped) {
                stop.insert(*p);
            } else {
                // To the controller that asked for it, else free.
                o.owner = o.wanted_by.take();
                o.epoch += u64::from(o.owner.is_some());
            }
        }
    }
    // The upgrade gate (see [`STATE_LAYOUT`]): nothing claimed or asked for while a member of an
    // earlier layout lives; what this controller owns it keeps (no such member takes it) and reads
    // on if it read it already.
    if !leaving && !t.members.is_empty() && !earlier {
        balance(&mut t, me, count);
    }
    // Nor is anything started while such a member lives (a partition this controller's id owned
    // before a restart included).
    let start =
        if earlier { BTreeSet::new() } else { t.owned_by(me).into_iter().filter(|p| *p < count && !running.contains(p) && !stop.contains(p)).collect() };
    Plan { table: t, start, stop }
}

/// Claims free partitions up to this controller's share, then asks the most loaded for the rest of
/// its minimum share.
fn balance(t: &mut Table, me: &str, count: u16) {
    let live = t.members.len();
    let min = usize::from(count) / live;
    let max = min + usize::from(usize::from(count) % live != 0);
    let asked_of = |t: &Table| t.owners.values().filter(|o| o.wanted_by.as_deref() == Some(me)).count();
    let held = |t: &Table| t.owned_by(me).iter().filter(|p| **p < count).count();
    let free: Vec<u16> = t.owners.iter().filter(|(p, o)| **p < count && o.owner.is_none()).map(|(p, _)| *p).collect();
    for p in free {
        if held(t) >= max {
            break;
        }
        let o = t.owners.get_mut(&p).expect("listed");
        o.owner = Some(me.to_string());
        o.epoch += 1;
        o.wanted_by = None;
    }
    // What each other controller holds, not counting what was asked of it.
    let load = |t: &Table| {
        let mut load: BTreeMap<String, Vec<u16>> = BTreeMap::new();
        for (p, o) in t.owners.iter().filter(|(p, _)| **p < count) {
            if let (Some(w), None) = (&o.owner, &o.wanted_by) {
                if w != me {
                    load.entry(w.clone()).or_default().push(*p);
                }
            }
        }
        load
    };
    // Below the minimum share, ask the most loaded controller above it; at the minimum, ask one above
    // the maximum (nobody else would, and shares must end within one of each other).
    let floor = |t: &Table| {
        let mine = held(t) + asked_of(t);
        if mine < min {
            Some(min)
        } else if mine < max && load(t).values().any(|ps| ps.len() > max) {
            Some(max)
        } else {
            None
        }
    };
    if floor(t).is_none() && held(t) >= min {
        // Nothing more needed: asks made before are withdrawn.
        for o in t.owners.values_mut() {
            if o.wanted_by.as_deref() == Some(me) {
                o.wanted_by = None;
            }
        }
    }
    while let Some(floor) = floor(t) {
        let Some((_, parts)) = load(t).into_iter().filter(|(_, ps)| ps.len() > floor).max_by_key(|(w, ps)| (ps.len(), std::cmp::Reverse(w.clone()))) else {
            break;
        };
        t.owners.get_mut(&parts[0]).expect("listed").wanted_by = Some(me.to_string());
    }
}

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
        expired_members(table, &self.me, &mut self.seen, Instant::now(), self.ttl, self.clock.now_ms())
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
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(30);

    /// A round judging expiry by the wall clock `now` (the tests of the plan's logic move one clock).
    fn plan_at(t: &Table, me: &str, now: u64, ttl: Duration, count: u16, running: &BTreeSet<u16>, leaving: bool) -> Plan {
        plan(t, me, &expired_by_wall(t, now), now, ttl, count, running, leaving)
    }

    fn none() -> BTreeSet<u16> {
        BTreeSet::new()
    }

    /// Runs rounds of the given controllers (each reading what it owns) until nothing changes; returns
    /// the table and how many rounds it took.
    fn settle(mut t: Table, who: &[&str], count: u16, now: u64) -> (Table, usize) {
        let mut running: BTreeMap<String, BTreeSet<u16>> = who.iter().map(|w| (w.to_string(), t.owned_by(w))).collect();
        for round in 1..50 {
            let before = t.clone();
            for w in who {
                let r = running.get_mut(*w).unwrap();
                let mut p = plan_at(&t, w, now + round as u64, TTL, count, r, false);
                if !p.stop.is_empty() {
                    r.retain(|x| !p.stop.contains(x));
                    p = plan_at(&t, w, now + round as u64, TTL, count, r, false);
                }
                assert!(p.stop.is_empty());
                r.extend(p.start.iter().copied());
                t = p.table;
            }
            // Nobody reads a partition it does not own, and no two read one.
            let mut seen = BTreeSet::new();
            for (w, r) in &running {
                assert!(r.is_subset(&t.owned_by(w)), "{w} reads {r:?} but owns {:?}", t.owned_by(w));
                for p in r {
                    assert!(seen.insert(*p), "partition {p} read twice");
                }
            }
            let strip = |t: &Table| Table { members: BTreeMap::new(), ..t.clone() };
            if strip(&before) == strip(&t) {
                return (t, round);
            }
        }
        panic!("no balance after 50 rounds: {t:?}");
    }

    fn shares(t: &Table) -> Vec<usize> {
        let mut v: Vec<usize> = t.load().values().copied().collect();
        v.sort();
        v
    }

    #[test]
    fn the_first_controller_takes_every_partition() {
        let p = plan_at(&Table::default(), "a", 1000, TTL, 4, &none(), false);
        assert_eq!(p.start, (0..4).collect());
        assert!(p.table.owners.values().all(|o| o.owner.as_deref() == Some("a") && o.epoch == 1));
        assert_eq!(p.table.members["a"], 1000 + 30_000);
    }

    #[test]
    fn controllers_that_join_get_their_share_by_hand_over() {
        let (t, _) = settle(Table::default(), &["a"], 6, 0);
        assert_eq!(shares(&t), [6]);
        let (t, rounds) = settle(t, &["a", "b", "c"], 6, 10);
        assert_eq!(shares(&t), [2, 2, 2]);
        assert!(rounds <= 4, "{rounds} rounds");
        // Uneven: give or take one.
        let (t, _) = settle(Table::default(), &["a", "b", "c"], 7, 0);
        assert_eq!(shares(&t), [2, 2, 3]);
        let (t, _) = settle(t, &["a", "b", "c", "d"], 7, 100);
        assert_eq!(shares(&t), [1, 2, 2, 2]);
        // More controllers than partitions: the rest stand by.
        let (t, _) = settle(Table::default(), &["a", "b", "c"], 2, 0);
        assert_eq!(shares(&t), [0, 1, 1]);
    }

    /// An earlier release's write of `t`: it keeps the fields it knows and drops the layouts.
    fn written_by_earlier(t: &Table) -> Table {
        Table { layouts: BTreeMap::new(), ..t.clone() }
    }

    #[test]
    fn no_partition_is_claimed_while_a_member_of_an_earlier_layout_lives() {
        // `old` (an earlier release) reads two of four partitions; two are free.
        let mut t = Table::default();
        t.members.insert("old".into(), 30_000);
        for p in 0..4 {
            t.owners.insert(p, Owned { owner: (p < 2).then(|| "old".to_string()), epoch: 1, wanted_by: None });
        }
        let p = plan_at(&t, "new", 1_000, TTL, 4, &none(), false);
        assert!(p.start.is_empty() && p.table.owned_by("new").is_empty(), "{p:?}");
        assert!(p.table.owners.values().all(|o| o.wanted_by.is_none()), "nor asked for");
        assert_eq!(p.table.layouts.get("new"), Some(&STATE_LAYOUT), "it says its own layout");
        // The earlier release rewrites the document (renewing), dropping every layout: `new` still
        // waits, though no other member lacks an entry now.
        let mut t = written_by_earlier(&p.table);
        t.members.insert("old".into(), 40_000);
        let p = plan_at(&t, "new", 2_000, TTL, 4, &none(), false);
        assert!(p.start.is_empty(), "{p:?}");
        // Gone (its membership ran out): every partition is claimed.
        let p = plan_at(&p.table, "new", 41_000, TTL, 4, &none(), false);
        assert_eq!(p.start, (0..4).collect());
        let running: BTreeSet<u16> = (0..4).collect();
        // An earlier controller comes back (cut off for longer than its lease) and asks for a
        // partition: nothing is handed to it, and what `new` reads it reads on.
        let mut t = written_by_earlier(&p.table);
        t.members.insert("old".into(), 80_000);
        t.owners.get_mut(&0).unwrap().wanted_by = Some("old".into());
        let q = plan_at(&t, "new", 42_000, TTL, 4, &running, false);
        assert!(q.stop.is_empty() && q.start.is_empty(), "{q:?}");
        assert_eq!((q.table.owned_by("new").len(), q.table.owners[&0].wanted_by.as_deref()), (4, None));
        // A controller restarted under an id an earlier release used starts nothing it owns until
        // its own entry is in (the next round).
        let q = plan_at(&written_by_earlier(&p.table), "new", 42_000, TTL, 4, &none(), false);
        assert!(q.start.is_empty(), "{q:?}");
        assert_eq!(plan_at(&q.table, "new", 43_000, TTL, 4, &none(), false).start, running);
        // Two members of this layout balance as before.
        let (t, _) = settle(p.table, &["new", "new2"], 4, 50_000);
        assert_eq!(shares(&t), [2, 2]);
    }

    #[test]
    fn a_dead_controllers_partitions_are_taken_once_its_membership_runs_out() {
        let (t, _) = settle(Table::default(), &["a", "b", "c"], 6, 0);
        let of_c = t.owned_by("c");
        let epochs: BTreeMap<u16, u64> = of_c.iter().map(|p| (*p, t.owners[p].epoch)).collect();
        // Before c's membership runs out, nothing moves.
        let (t, _) = settle(t, &["a", "b"], 6, 20_000);
        assert_eq!(t.owned_by("c"), of_c);
        let (t, _) = settle(t, &["a", "b"], 6, 31_000);
        assert_eq!(shares(&t), [3, 3]);
        assert!(!t.members.contains_key("c"));
        for p in of_c {
            assert_eq!(t.owners[&p].epoch, epochs[&p] + 1, "a change of owner grows the epoch");
        }
    }

    #[test]
    fn a_partition_asked_for_is_handed_over_only_once_its_owner_stopped_reading_it() {
        let (t, _) = settle(Table::default(), &["a"], 2, 0);
        let p = plan_at(&t, "b", 1, TTL, 2, &none(), false);
        let asked: Vec<u16> = p.table.owners.iter().filter(|(_, o)| o.wanted_by.as_deref() == Some("b")).map(|(p, _)| *p).collect();
        assert_eq!(asked.len(), 1);
        assert!(p.start.is_empty(), "b starts nothing before it is handed over");
        let running: BTreeSet<u16> = [0, 1].into();
        let a = plan_at(&p.table, "a", 2, TTL, 2, &running, false);
        assert_eq!(a.stop, [asked[0]].into(), "a stops reading it first");
        let after: BTreeSet<u16> = running.difference(&a.stop).copied().collect();
        let a = plan_at(&p.table, "a", 2, TTL, 2, &after, false);
        assert!(a.stop.is_empty());
        assert_eq!(a.table.owners[&asked[0]].owner.as_deref(), Some("b"));
        let b = plan_at(&a.table, "b", 3, TTL, 2, &none(), false);
        assert_eq!(b.start, [asked[0]].into());
    }

    #[test]
    fn leaving_gives_every_partition_back_after_stopping_it() {
        let (t, _) = settle(Table::default(), &["a", "b"], 4, 0);
        let mine = t.owned_by("a");
        let p = plan_at(&t, "a", 5, TTL, 4, &mine, true);
        assert_eq!(p.stop, mine);
        let p = plan_at(&t, "a", 5, TTL, 4, &none(), true);
        assert!(p.table.owned_by("a").is_empty() && !p.table.members.contains_key("a"));
        let (t, _) = settle(p.table, &["b"], 4, 6);
        assert_eq!(shares(&t), [4]);
    }

    #[test]
    fn a_partition_read_but_no_longer_owned_is_stopped() {
        let (t, _) = settle(Table::default(), &["a"], 2, 0);
        // a could not renew; b took both after a's membership ran out.
        let (t, _) = settle(t, &["b"], 2, 40_000);
        let p = plan_at(&t, "a", 40_001, TTL, 2, &[0, 1].into(), false);
        assert_eq!(p.stop, [0, 1].into());
    }

    /// One controller of the simulation below.
    struct Sim {
        id: String,
        alive: bool,
        /// Its S3 calls fail (its rounds fail; it keeps reading until it is stale).
        cut_off: bool,
        running: BTreeSet<u16>,
        /// When its last round wrote (or found) its membership, on the simulation's clock.
        written: Option<u64>,
        next_round: u64,
        /// Its wall clock's offset (clock skew between controllers, up to five leases either way).
        skew: i64,
        /// The members' stamps as it saw them (lost when it is killed).
        seen: Sightings<String, u64>,
        /// Its own `--lease-secs`, ms: a misconfigured controller's is a third or three times the others'.
        ttl_ms: u64,
    }

    /// A seeded simulation of the ownership protocol: 2-5 controllers and 1-8 partitions, each
    /// controller running a round every third of its lease (with jitter) on a skewed clock (in a third
    /// of the seeds one controller is misconfigured with a lease a third or three times the
    /// others'), the store
    /// the shared document (each round's read-plan-write is atomic, as the conditional write makes
    /// it); faults: controllers killed, restarted under their name, cut off from the store, joined
    /// late. Invariants at every step: no partition is read by two controllers that may act (fresh:
    /// membership written less than two thirds of a lease ago), and a fresh controller reads only
    /// partitions the document says it owns. At the end, after a calm stretch: every partition
    /// owned by a live controller that reads it, shares within one of each other.
    fn simulate(seed: u64) -> std::result::Result<(), String> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let ttl_ms: u64 = 3_000;
        let ttl = Duration::from_millis(ttl_ms);
        let count: u16 = rng.random_range(1..=8);
        let n = rng.random_range(2..=5);
        let misconfigured = rng.random_bool(1.0 / 3.0).then(|| (rng.random_range(0..n), if rng.random_bool(0.5) { ttl_ms / 3 } else { ttl_ms * 3 }));
        let mut cs: Vec<Sim> = (0..n)
            .map(|i| Sim {
                ttl_ms: misconfigured.filter(|(m, _)| *m == i).map_or(ttl_ms, |(_, t)| t),
                id: format!("c{i}"),
                alive: i == 0 || rng.random_bool(0.6),
                cut_off: false,
                running: BTreeSet::new(),
                written: None,
                next_round: rng.random_range(0..ttl_ms / 3),
                skew: rng.random_range(-(ttl_ms as i64) * 5..=(ttl_ms as i64) * 5),
                seen: Sightings::new(ttl * 3),
            })
            .collect();
        let mut table = Table::default();
        let base = Instant::now();
        let mut now: u64 = 1_000_000;
        let calm_from = now + 40 * ttl_ms;
        let end = calm_from + 20 * ttl_ms;
        while now < end {
            let faults = now < calm_from;
            // The next controller due for a round.
            let i = (0..cs.len()).filter(|i| cs[*i].alive).min_by_key(|i| cs[*i].next_round);
            let Some(i) = i else {
                cs[0].alive = true;
                continue;
            };
            now = now.max(cs[i].next_round);
            if faults && rng.random_bool(0.03) {
                // Killed: it reads nothing any more; restarted later under its name.
                let c = &mut cs[rng.random_range(0..n)];
                c.alive = false;
                c.running.clear();
                c.written = None;
                c.seen = Sightings::new(ttl * 3);
            }
            if faults && rng.random_bool(0.03) {
                let c = &mut cs[rng.random_range(0..n)];
                if !c.alive {
                    c.alive = true;
                    c.next_round = now;
                }
            }
            if rng.random_bool(0.02) || !faults {
                for c in cs.iter_mut() {
                    c.cut_off = faults && rng.random_bool(0.1);
                }
            }
            let c = &mut cs[i];
            if !c.alive {
                continue;
            }
            let fresh = |c: &Sim, now: u64| c.written.is_some_and(|w| now < w + c.ttl_ms * 2 / 3);
            if !fresh(c, now) {
                c.running.clear();
            }
            if !c.cut_off {
                let wall = now.saturating_add_signed(c.skew);
                loop {
                    // Expiry judged on the controller's own (monotonic) clock: the simulation's.
                    let at = base + Duration::from_millis(now);
                    let own = Duration::from_millis(c.ttl_ms);
                    let expired = expired_members(&table, &c.id, &mut c.seen, at, own, wall);
                    let p = plan(&table, &c.id, &expired, wall, own, count, &c.running, false);
                    if !p.stop.is_empty() {
                        c.running.retain(|x| !p.stop.contains(x));
                        continue;
                    }
                    table = p.table;
                    c.written = Some(now);
                    c.running.extend(p.start);
                    break;
                }
            }
            c.next_round = now + c.ttl_ms / 3 - rng.random_range(0..c.ttl_ms / 10);
            // Invariants.
            let mut reader: BTreeMap<u16, &str> = BTreeMap::new();
            for c in cs.iter().filter(|c| c.alive && fresh(c, now)) {
                for p in &c.running {
                    if let Some(other) = reader.insert(*p, &c.id) {
                        return Err(format!("seed {seed}: partition {p} read by {other} and {} at {now}", c.id));
                    }
                    if table.owners.get(p).and_then(|o| o.owner.as_deref()) != Some(c.id.as_str()) {
                        return Err(format!("seed {seed}: {} reads {p}, owned by {:?}", c.id, table.owners.get(p)));
                    }
                }
            }
        }
        let live: Vec<&Sim> = cs.iter().filter(|c| c.alive).collect();
        let mut shares: Vec<usize> = live.iter().map(|c| c.running.len()).collect();
        shares.sort();
        let read: usize = shares.iter().sum();
        if read != usize::from(count) || shares.last().unwrap() - shares.first().unwrap() > 1 {
            return Err(format!("seed {seed}: after a calm stretch, {count} partitions read as {shares:?} by {} live controllers: {table:?}", live.len()));
        }
        Ok(())
    }

    /// `FLEET_PARTITION_SEEDS` (default 2,000) seeds of [`simulate`].
    #[test]
    fn seeded_simulation_of_ownership_keeps_readers_exclusive_and_balances() {
        let seeds: u64 = std::env::var("FLEET_PARTITION_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000);
        let failed: Vec<String> = (0..seeds).filter_map(|s| simulate(s).err()).collect();
        assert!(failed.is_empty(), "{} of {seeds} seeds failed; first: {}", failed.len(), failed[0]);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_rounds_are_tried_again_before_the_membership_goes_stale() {
        let store = fleet_io::memory::MemoryStore::new();
        let mut a = Ownership::new(store.clone(), "a".into(), TTL, 2, Clock::System);
        assert!(a.next_round_at() <= Instant::now(), "the first round at once");
        a.round(&none(), false).await.unwrap();
        assert_eq!(a.next_round_at(), Instant::now() + a.interval());
        // Three rounds in a row fail; the fourth renews the membership before it goes stale.
        store.fail_reads(3);
        for round in 1..=4 {
            tokio::time::sleep_until(a.next_round_at()).await;
            assert!(a.fresh(), "stale before round {round}");
            assert_eq!(a.round(&none(), false).await.is_ok(), round == 4);
        }
        assert!(a.fresh());
        assert_eq!(a.table().owned_by("a").len(), 2);
    }

    #[tokio::test]
    async fn two_controllers_on_one_store_never_own_a_partition_both() {
        let store = fleet_io::memory::MemoryStore::new();
        let mut a = Ownership::new(store.clone(), "a".into(), TTL, 4, Clock::System);
        let mut b = Ownership::new(store.clone(), "b".into(), TTL, 4, Clock::System);
        let (mut ra, mut rb) = (none(), none());
        for _ in 0..6 {
            for (own, r) in [(&mut a, &mut ra), (&mut b, &mut rb)] {
                let mut p = own.round(r, false).await.unwrap();
                if !p.stop.is_empty() {
                    r.retain(|x| !p.stop.contains(x));
                    p = own.round(r, false).await.unwrap();
                }
                r.extend(p.start);
            }
            assert!(ra.is_disjoint(&rb), "{ra:?} {rb:?}");
        }
        assert_eq!((ra.len(), rb.len()), (2, 2));
        assert!(a.fresh() && b.fresh());
    }
}
