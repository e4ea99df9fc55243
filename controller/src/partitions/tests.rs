//! The ownership table's plans and rounds, on the in-memory store.
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
                let expired = expired_members(&table, &c.id, &mut c.seen, at.into_std(), own, wall);
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
