//! The results partitions' ownership table and one balancing round's plan, pure: what a controller
//! decides from the document it read, its clock and what it reads now (the controller's
//! `partitions` module reads and writes the document and acts on the plan; its module header says
//! the protocol).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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
