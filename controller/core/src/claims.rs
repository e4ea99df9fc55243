//! Each transaction billed once across jobs, sans-I/O: a job that has committed its ending claims the
//! `txn_id`s of the rows it bills, and a row whose id another job claimed first is its duplicate
//! (taken out of its totals, named in its report). The driver reads and writes the claim segments;
//! this decides what each read means and what to write.
//!
//! Where the claims live: in the bucket, by the transaction's own day (UTC, from its timestamp) and
//! one of [`SHARDS`] shards of its id's fingerprint (128 bits of xxh3 of the id), as a chain of
//! segments `claims/{day}/{shard}/{n}` (see `fleet_domain::layout::claims_key`). A segment holds the
//! fingerprints, sorted, each with the job that claimed it. Segments up to [`SEGMENT_ENTRIES`] are
//! open (written again, conditionally on the ETag read); a segment at or past it is sealed (read, never
//! written) and the chain goes on in the next. So a job reads only the shards of the days its rows
//! carry, never the window, and holds one segment at a time (at most `SEGMENT_ENTRIES` plus one job's
//! share of a shard).
//!
//! Why a claim binds at once: a job claims only after its ending is committed (its counted chunks
//! frozen; `crate::finish`), so every claim is one its job bills; a controller that dies while
//! claiming leaves claims that its job's next owner finds as its own and completes. Two jobs claiming
//! the same id race on one segment's conditional write: the first write wins, the second reads again
//! and finds the id claimed. Rows that a job does not bill (its failed chunks, the rows of an abandoned
//! job that never came) are never claimed, so a later job bills them.

use std::collections::BTreeMap;

use bytes::{BufMut, Bytes, BytesMut};

/// Shards per day: a job's rows of one day touch at most this many chains.
pub const SHARDS: u32 = 16;

/// A segment with this many entries is sealed: the next claims go to the next segment (20 bytes an
/// entry: a sealed segment is about 20 MiB).
pub const SEGMENT_ENTRIES: usize = 1 << 20;

const MAGIC: &[u8; 4] = b"FLC1";

/// One row a job bills, as it claims it: its id's fingerprint, its day (yyyymmdd, UTC), and where it
/// is (chunk, row within the chunk) to find it again should it be a duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Row {
    pub day: u32,
    pub fp: u128,
    pub chunk: u32,
    pub row: u32,
}

impl Row {
    /// Its shard within its day: the fingerprint's top bits.
    pub fn shard(&self) -> u32 {
        (self.fp >> 124) as u32 % SHARDS
    }
}

/// A segment's contents: who claimed, and each fingerprint with the index of its claimer in `jobs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Sealed at this many entries (the cap of the release that created it, kept with it: every
    /// release follows one chain alike).
    pub cap: u32,
    pub jobs: Vec<String>,
    /// Sorted by fingerprint, each once.
    pub entries: Vec<(u128, u32)>,
}

/// A segment that cannot be read (not ours, truncated, unsorted).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("claim segment: {0}")]
pub struct Corrupt(pub String);

impl Default for Segment {
    /// A new segment, empty, sealed at [`SEGMENT_ENTRIES`].
    fn default() -> Segment {
        Segment { cap: SEGMENT_ENTRIES as u32, jobs: Vec::new(), entries: Vec::new() }
    }
}

impl Segment {
    pub fn sealed(&self) -> bool {
        self.entries.len() >= self.cap as usize
    }

    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(16 + self.jobs.iter().map(|j| j.len() + 2).sum::<usize>() + self.entries.len() * 20);
        b.put_slice(MAGIC);
        b.put_u32_le(self.cap);
        b.put_u32_le(self.jobs.len() as u32);
        for j in &self.jobs {
            b.put_u16_le(j.len() as u16);
            b.put_slice(j.as_bytes());
        }
        b.put_u32_le(self.entries.len() as u32);
        for (fp, job) in &self.entries {
            b.put_u128_le(*fp);
            b.put_u32_le(*job);
        }
        b.freeze()
    }

    pub fn decode(mut b: &[u8]) -> Result<Segment, Corrupt> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], Corrupt> {
            if b.len() < n {
                return Err(Corrupt("truncated".into()));
            }
            let (head, rest) = b.split_at(n);
            *b = rest;
            Ok(head)
        }
        let u32_of = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("four bytes"));
        if take(&mut b, 4)? != MAGIC {
            return Err(Corrupt("not a claim segment".into()));
        }
        let cap = u32_of(take(&mut b, 4)?);
        if cap == 0 {
            return Err(Corrupt("a cap of zero entries".into()));
        }
        let n_jobs = u32_of(take(&mut b, 4)?) as usize;
        let mut jobs = Vec::with_capacity(n_jobs.min(4096));
        for _ in 0..n_jobs {
            let len = u16::from_le_bytes(take(&mut b, 2)?.try_into().expect("two bytes")) as usize;
            let id = std::str::from_utf8(take(&mut b, len)?).map_err(|_| Corrupt("a job id is not UTF-8".into()))?;
            jobs.push(id.to_string());
        }
        let n = u32_of(take(&mut b, 4)?) as usize;
        if b.len() != n * 20 {
            return Err(Corrupt(format!("{n} entries announced, {} bytes follow", b.len())));
        }
        let mut entries = Vec::with_capacity(n);
        for e in b.chunks_exact(20) {
            let fp = u128::from_le_bytes(e[..16].try_into().expect("sixteen bytes"));
            let job = u32_of(&e[16..]);
            if job as usize >= jobs.len() {
                return Err(Corrupt(format!("an entry names job {job} of {}", jobs.len())));
            }
            if entries.last().is_some_and(|&(last, _)| last >= fp) {
                return Err(Corrupt("entries out of order".into()));
            }
            entries.push((fp, job));
        }
        Ok(Segment { cap, jobs, entries })
    }
}

/// The claims of one job on one (day, shard) chain, segment by segment.
#[derive(Debug)]
pub struct ShardClaim {
    pub day: u32,
    pub shard: u32,
    job: String,
    /// The segment it reads or writes now.
    seg: u32,
    /// Its rows not yet found or claimed, sorted by fingerprint.
    pending: Vec<Row>,
    /// Its rows another job claimed first, with that job.
    duplicates: Vec<(Row, String)>,
    /// Rows found claimed by this job already (a claim tried again).
    own: u64,
    /// Rows it claimed now.
    claimed: u64,
    /// It has asked which segments follow the absent one it reads now.
    looked_later: bool,
}

/// What the driver does next on one chain.
#[derive(Debug, PartialEq, Eq)]
pub enum Effect {
    /// Read segment `seg` of the chain; answer [`Answer::Read`].
    Read { seg: u32 },
    /// Segment `seg` is absent: which of the chain's segments after it exist? Answer
    /// [`Answer::Later`]. (A sealed segment is never written again, so it may expire before the
    /// later ones of its chain; those still hold claims, and the chain goes on there.)
    Later { seg: u32 },
    /// Write `body` as segment `seg`, only if it is still `etag` (none: only if absent); answer
    /// [`Answer::Written`] or [`Answer::Conflict`].
    Write { seg: u32, body: Bytes, etag: Option<String> },
    /// Every row of the chain is claimed or found a duplicate.
    Done,
}

/// What the driver found.
#[derive(Debug)]
pub enum Answer {
    Start,
    /// The segment and its ETag, or none (absent).
    Read(Option<(Segment, String)>),
    Written,
    /// The conditional write lost: another claimer wrote first.
    Conflict,
    /// The first segment after the absent one that exists, if any.
    Later(Option<u32>),
}

impl ShardClaim {
    /// The next effect, given the answer to the last.
    pub fn next(&mut self, answer: Answer) -> Effect {
        match answer {
            Answer::Start | Answer::Conflict => Effect::Read { seg: self.seg },
            Answer::Written => {
                self.claimed += self.pending.len() as u64;
                self.pending.clear();
                Effect::Done
            }
            Answer::Read(None) if !self.looked_later => {
                self.looked_later = true;
                Effect::Later { seg: self.seg }
            }
            Answer::Later(Some(next)) if next > self.seg => {
                self.seg = next;
                // Looked past again should that one be gone too by the time it is read (segments
                // expire in no order): the chain's open end is never written short of it.
                self.looked_later = false;
                Effect::Read { seg: next }
            }
            Answer::Later(_) => self.next(Answer::Read(None)),
            Answer::Read(found) => {
                let (segment, etag) = match found {
                    Some((s, e)) => (s, Some(e)),
                    None => (Segment::default(), None),
                };
                self.sift(&segment);
                if self.pending.is_empty() {
                    return Effect::Done;
                }
                if segment.sealed() {
                    self.seg += 1;
                    self.looked_later = false;
                    return Effect::Read { seg: self.seg };
                }
                let body = self.merged(segment).encode();
                Effect::Write { seg: self.seg, body, etag }
            }
        }
    }

    /// Takes out of `pending` every row the segment holds: ours (a claim tried again) or another's.
    fn sift(&mut self, segment: &Segment) {
        let entries = &segment.entries;
        let mut keep = Vec::with_capacity(self.pending.len());
        for row in self.pending.drain(..) {
            match entries.binary_search_by(|(fp, _)| fp.cmp(&row.fp)) {
                Ok(i) => {
                    let by = &segment.jobs[entries[i].1 as usize];
                    if *by == self.job && !crate::undo::is(crate::undo::Fix::OwnClaims) {
                        self.own += 1;
                    } else {
                        self.duplicates.push((row, by.clone()));
                    }
                }
                Err(_) => keep.push(row),
            }
        }
        self.pending = keep;
    }

    /// The open segment with this job's pending rows added.
    fn merged(&self, mut segment: Segment) -> Segment {
        let me = match segment.jobs.iter().position(|j| *j == self.job) {
            Some(i) => i as u32,
            None => {
                segment.jobs.push(self.job.clone());
                (segment.jobs.len() - 1) as u32
            }
        };
        let mut out = Vec::with_capacity(segment.entries.len() + self.pending.len());
        let mut theirs = segment.entries.into_iter().peekable();
        let mut ours = self.pending.iter().map(|r| (r.fp, me)).peekable();
        loop {
            let take_ours = match (theirs.peek(), ours.peek()) {
                (Some(t), Some(o)) => o.0 < t.0,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (None, None) => break,
            };
            let next = if take_ours { ours.next() } else { theirs.next() };
            // Two rows of one job with one fingerprint (an accidental collision) claim it once.
            if out.last().map(|l: &(u128, u32)| l.0) != next.map(|n| n.0) {
                out.extend(next);
            }
        }
        Segment { cap: segment.cap, jobs: segment.jobs, entries: out }
    }
}

/// A job's claims, every chain it touches, and what they found.
#[derive(Debug)]
pub struct Claims {
    pub chains: Vec<ShardClaim>,
}

/// What a job's claims found: the rows another job billed first (with that job), and how many rows
/// it claimed now or had claimed before (a claim tried again).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub duplicates: Vec<(Row, String)>,
    pub claimed: u64,
    pub own: u64,
}

impl Claims {
    /// The chains of `job`'s rows, in (day, shard) order.
    pub fn of(job: &str, rows: Vec<Row>) -> Claims {
        let mut by: BTreeMap<(u32, u32), Vec<Row>> = BTreeMap::new();
        for r in rows {
            by.entry((r.day, r.shard())).or_default().push(r);
        }
        let chains = by
            .into_iter()
            .map(|((day, shard), mut pending)| {
                pending.sort_unstable_by_key(|r| r.fp);
                ShardClaim { day, shard, job: job.to_string(), seg: 0, pending, duplicates: Vec::new(), own: 0, claimed: 0, looked_later: false }
            })
            .collect();
        Claims { chains }
    }

    /// What they found, once every chain is done.
    pub fn outcome(self) -> Outcome {
        let mut o = Outcome::default();
        for c in self.chains {
            debug_assert!(c.pending.is_empty(), "a chain's outcome is read once it is done");
            o.duplicates.extend(c.duplicates);
            o.claimed += c.claimed;
            o.own += c.own;
        }
        o.duplicates.sort_unstable_by_key(|(r, _)| (r.chunk, r.row));
        o
    }
}

#[cfg(test)]
mod tests;
