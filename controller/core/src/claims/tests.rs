//! The claims' chains driven by hand against a map of segments: fresh claims, another job's
//! duplicates, a claim tried again, a lost race, and a sealed segment.

use std::collections::BTreeMap;

use super::*;

/// Segments by (day, shard, seg), each with its ETag (a write counter).
#[derive(Default)]
struct Store {
    segs: BTreeMap<(u32, u32, u32), (Bytes, u64)>,
    writes: u64,
    /// Before the next read's answer is used, another claimer writes this segment.
    race: Option<Segment>,
}

impl Store {
    fn run(&mut self, claims: &mut Claims) {
        for chain in &mut claims.chains {
            let mut answer = Answer::Start;
            loop {
                answer = match chain.next(answer) {
                    Effect::Done => break,
                    Effect::Read { seg } => {
                        let key = (chain.day, chain.shard, seg);
                        let found = self.segs.get(&key).map(|(b, e)| (Segment::decode(b).unwrap(), e.to_string()));
                        if let Some(other) = self.race.take() {
                            self.writes += 1;
                            self.segs.insert(key, (other.encode(), self.writes));
                        }
                        Answer::Read(found)
                    }
                    Effect::Later { seg } => {
                        Answer::Later(self.segs.range((chain.day, chain.shard, seg + 1)..(chain.day, chain.shard, u32::MAX)).next().map(|((_, _, n), _)| *n))
                    }
                    Effect::Write { seg, body, etag } => {
                        let key = (chain.day, chain.shard, seg);
                        let now = self.segs.get(&key).map(|(_, e)| e.to_string());
                        if now != etag {
                            Answer::Conflict
                        } else {
                            self.writes += 1;
                            self.segs.insert(key, (body, self.writes));
                            Answer::Written
                        }
                    }
                }
            }
        }
    }
}

fn row(id: u128, chunk: u32) -> Row {
    Row { day: 20261201, fp: id.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835), chunk, row: id as u32 }
}

fn claim(store: &mut Store, job: &str, ids: impl IntoIterator<Item = u128>) -> Outcome {
    let mut c = Claims::of(job, ids.into_iter().map(|i| row(i, 0)).collect());
    store.run(&mut c);
    c.outcome()
}

#[test]
fn a_second_job_finds_the_first_ones_ids_and_only_those() {
    let mut store = Store::default();
    let first = claim(&mut store, "j1", 0..100);
    assert_eq!((first.claimed, first.own, first.duplicates.len()), (100, 0, 0));
    let second = claim(&mut store, "j2", 50..150);
    assert_eq!((second.claimed, second.own), (50, 0));
    let mut dup: Vec<u32> = second
        .duplicates
        .iter()
        .map(|(r, by)| {
            assert_eq!(by, "j1");
            r.row
        })
        .collect();
    dup.sort();
    assert_eq!(dup, (50..100).collect::<Vec<u32>>());
    // Every segment decodes, sorted, each id once.
    let total: usize = store.segs.values().map(|(b, _)| Segment::decode(b).unwrap().entries.len()).sum();
    assert_eq!(total, 150);
}

#[test]
fn a_claim_tried_again_finds_its_own_ids_as_its_own() {
    let mut store = Store::default();
    claim(&mut store, "j1", 0..40);
    let writes = store.writes;
    let again = claim(&mut store, "j1", 0..40);
    assert_eq!((again.claimed, again.own, again.duplicates.len()), (0, 40, 0));
    assert_eq!(store.writes, writes, "nothing new to write");
}

#[test]
fn a_lost_race_reads_again_and_finds_the_winners_ids() {
    let mut store = Store::default();
    // Another job writes the (absent) segment between our read and our write.
    let r = row(7, 0);
    let mut c = Claims::of("j2", vec![r, row(8, 0)]);
    // Only one chain can carry the race; find the one holding id 7.
    let winner = Segment { cap: SEGMENT_ENTRIES as u32, jobs: vec!["j1".into()], entries: vec![(r.fp, 0)] };
    store.race = Some(winner);
    let chain = c.chains.iter().position(|ch| ch.day == r.day && ch.shard == r.shard()).unwrap();
    c.chains.swap(0, chain);
    store.run(&mut c);
    let o = c.outcome();
    assert_eq!(o.duplicates.iter().map(|(r, by)| (r.row, by.as_str())).collect::<Vec<_>>(), [(7, "j1")]);
    assert_eq!(o.claimed, 1);
}

#[test]
fn a_sealed_segment_is_read_and_the_chain_goes_on() {
    let mut store = Store::default();
    let r = row(3, 0);
    // A sealed segment 0 (as many entries as the cap), holding id 3 by j1.
    let mut entries: Vec<(u128, u32)> = (0..SEGMENT_ENTRIES as u128).map(|i| ((i << 4) | 1, 0)).collect();
    entries.push((r.fp, 0));
    entries.sort();
    entries.dedup_by_key(|e| e.0);
    let sealed = Segment { cap: SEGMENT_ENTRIES as u32, jobs: vec!["j1".into()], entries };
    assert!(sealed.sealed());
    store.segs.insert((r.day, r.shard(), 0), (sealed.encode(), 1));
    let mut c = Claims::of("j2", vec![r, row(4, 0)].into_iter().filter(|x| x.shard() == r.shard()).collect());
    store.run(&mut c);
    let o = c.outcome();
    assert_eq!(o.duplicates.len(), 1);
    assert_eq!(o.claimed as usize, c_len(&store, r));
    fn c_len(store: &Store, r: Row) -> usize {
        store.segs.get(&(r.day, r.shard(), 1)).map_or(0, |(b, _)| Segment::decode(b).unwrap().entries.len())
    }
}

#[test]
fn a_corrupt_segment_is_refused() {
    let good = Segment { cap: SEGMENT_ENTRIES as u32, jobs: vec!["j1".into()], entries: vec![(1, 0), (2, 0)] }.encode();
    assert!(Segment::decode(&good).is_ok());
    assert!(Segment::decode(&good[..good.len() - 1]).is_err());
    assert!(Segment::decode(b"nope").is_err());
    let unsorted = Segment { cap: SEGMENT_ENTRIES as u32, jobs: vec!["j1".into()], entries: vec![(2, 0), (1, 0)] }.encode();
    assert!(Segment::decode(&unsorted).is_err());
    let bad_job = Segment { cap: SEGMENT_ENTRIES as u32, jobs: vec!["j1".into()], entries: vec![(1, 5)] }.encode();
    assert!(Segment::decode(&bad_job).is_err());
}

#[test]
fn a_chain_whose_sealed_segment_expired_goes_on_where_its_claims_are() {
    let mut store = Store::default();
    let r = row(11, 0);
    // Segment 0 expired (absent); segment 1, open, holds id 11 by j1 (a small cap: sealed at 2).
    let one = Segment { cap: 2, jobs: vec!["j1".into()], entries: vec![(r.fp, 0)] };
    store.segs.insert((r.day, r.shard(), 1), (one.encode(), 1));
    let mut c = Claims::of("j2", vec![r]);
    store.run(&mut c);
    let o = c.outcome();
    assert_eq!(o.duplicates.iter().map(|(r, by)| (r.row, by.as_str())).collect::<Vec<_>>(), [(11, "j1")]);
    assert!(!store.segs.contains_key(&(r.day, r.shard(), 0)), "nothing written where the expired segment was");
}

#[test]
fn a_segment_is_sealed_at_the_cap_it_was_created_with() {
    let mut store = Store::default();
    let (a, b) = (row(21, 0), row(22, 0));
    let b = Row { fp: (a.fp & !0xFFFF) | 0x1, ..b };
    assert_eq!(a.shard(), b.shard());
    let small = Segment { cap: 1, jobs: vec!["j1".into()], entries: vec![(a.fp, 0)] };
    store.segs.insert((a.day, a.shard(), 0), (small.encode(), 1));
    let mut c = Claims::of("j2", vec![b]);
    store.run(&mut c);
    assert_eq!(c.outcome().claimed, 1);
    let next = Segment::decode(&store.segs[&(a.day, a.shard(), 1)].0).unwrap();
    assert_eq!(next.entries.len(), 1, "segment 0 was full at its own cap of 1: the claim went to segment 1");
}
