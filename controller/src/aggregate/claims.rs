//! Claiming a finishing job's transactions: the core decides (`controller_core::claims`: which
//! chains, what each segment read means, what to write), this reads and writes. The job's counted
//! chunks are read again from their blobs (still there: a job's blobs are purged after its report),
//! each row's id fingerprinted under its own day; every chain is claimed, a few at once; the rows
//! another job billed first are read once more, billed with the job's tariff as a processor billed
//! them, and taken out of the job's totals (`Job::settle_claims`), each kept for the report with the
//! job that billed it.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use controller_core::claims::{Answer, Claims, Effect, Row, Segment, ShardClaim};
use controller_core::job::Phase;
use fleet_domain::billing::{AccountTotals, FeeCalculator, Tariff};
use fleet_domain::claim_rows::{chunk_claim_rows, chunk_rows_at};
use fleet_domain::layout::{chunk_key, claims_chain_prefix, claims_key, claims_segment_of, report_key, tariff_key};
use fleet_domain::model::{Manifest, Rejected};
use fleet_domain::requests::RequestCounts;
use fleet_io::blob::{BlobStore, Cond};
use fleet_io::error::{Error, Result};

use super::books::Books;
use super::job::Job;

/// Jobs whose claims failed for a reason that does not pass by itself (a segment or chunk that cannot
/// be read, a tariff missing): tried again after a back-off that doubles from [`BACKOFF_FIRST`] to
/// [`BACKOFF_LAST`], not at every flush (each try reads the job's chunks again).
#[derive(Default)]
pub(super) struct ClaimsBackoff(std::sync::Mutex<std::collections::HashMap<String, (tokio::time::Instant, std::time::Duration)>>);

const BACKOFF_FIRST: std::time::Duration = std::time::Duration::from_secs(5);
const BACKOFF_LAST: std::time::Duration = std::time::Duration::from_secs(600);

impl ClaimsBackoff {
    /// Job `job` waits out its back-off now.
    pub(super) fn waiting(&self, job: &str) -> bool {
        fleet_io::lock(&self.0).get(job).is_some_and(|(until, _)| tokio::time::Instant::now() < *until)
    }

    /// Its claims failed again: returns how long it waits.
    pub(super) fn failed(&self, job: &str) -> std::time::Duration {
        let mut m = fleet_io::lock(&self.0);
        let wait = m.get(job).map_or(BACKOFF_FIRST, |(_, last)| (*last * 2).min(BACKOFF_LAST));
        m.insert(job.to_string(), (tokio::time::Instant::now() + wait, wait));
        wait
    }

    /// Its claims were made.
    pub(super) fn cleared(&self, job: &str) {
        fleet_io::lock(&self.0).remove(job);
    }
}

/// Claim rows read ahead: a chunk counted for an open job is read again and fingerprinted at once,
/// in the background, while the job's other chunks are processed (the controller waits for them
/// then), so that its finish claims without reading it. Bounded by [`READ_AHEAD_ROWS`] rows held in
/// all (32 bytes each; a chunk that would pass it is read at the claim, as without this); a job's
/// rows go when it claims, or after [`READ_AHEAD_KEEP`] (a job finished elsewhere). The rows are the
/// blob's, which is written once: whichever result counts the chunk, they are its rows.
#[derive(Default)]
pub(super) struct ReadAhead(std::sync::Mutex<ReadAheadState>);

type ReadAheadOf = (Option<Vec<Row>>, RequestCounts);

#[derive(Default)]
struct ReadAheadState {
    /// Per job: its chunks' reads (`None` while under way): the rows (`None`: the read failed) and
    /// the calls the read made, which are the job's either way.
    jobs: std::collections::HashMap<String, (tokio::time::Instant, std::collections::HashMap<u32, Option<ReadAheadOf>>)>,
    /// Rows held or reserved.
    rows: u64,
}

/// The most claim rows held read ahead (32 MiB).
pub(super) const READ_AHEAD_ROWS: u64 = 1 << 20;
/// How long a job's rows read ahead are kept without its claim.
const READ_AHEAD_KEEP: std::time::Duration = std::time::Duration::from_secs(600);

impl ReadAhead {
    /// Reserves room for chunk `chunk` of `job` (`rows` rows) unless it is read or being read, or
    /// there is no room: whether to read it now.
    fn reserve(&self, job: &str, chunk: u32, rows: u64) -> bool {
        let mut s = fleet_io::lock(&self.0);
        let now = tokio::time::Instant::now();
        // Jobs whose claim never came for them here (finished by another controller).
        let stale: Vec<String> = s.jobs.iter().filter(|(_, (at, _))| now.duration_since(*at) > READ_AHEAD_KEEP).map(|(j, _)| j.clone()).collect();
        for j in stale {
            if let Some((_, chunks)) = s.jobs.remove(&j) {
                s.rows -= chunks.values().flatten().filter_map(|(r, _)| r.as_ref()).map(|r| r.len() as u64).sum::<u64>();
            }
        }
        if s.rows + rows > READ_AHEAD_ROWS || s.jobs.get(job).is_some_and(|(_, c)| c.contains_key(&chunk)) {
            return false;
        }
        s.rows += rows;
        let entry = s.jobs.entry(job.to_string()).or_insert_with(|| (now, Default::default()));
        entry.0 = now;
        entry.1.insert(chunk, None);
        true
    }

    /// The read's outcome: its rows kept (the reservation made exact), or the room given back.
    fn done(&self, job: &str, chunk: u32, reserved: u64, read: ReadAheadOf) {
        let mut s = fleet_io::lock(&self.0);
        s.rows -= reserved;
        let held = read.0.as_ref().map_or(0, |r| r.len() as u64);
        // Gone when its job's rows went stale meanwhile: dropped.
        if let Some(slot) = s.jobs.get_mut(job).and_then(|(_, c)| c.get_mut(&chunk)) {
            *slot = Some(read);
            s.rows += held;
        }
    }

    /// Reads of `job`'s chunks under way.
    fn pending(&self, job: &str) -> usize {
        fleet_io::lock(&self.0).jobs.get(job).map_or(0, |(_, c)| c.values().filter(|r| r.is_none()).count())
    }

    /// The rows read ahead for `job`'s chunks, by chunk, taken (their room freed).
    fn take(&self, job: &str) -> std::collections::HashMap<u32, ReadAheadOf> {
        let mut s = fleet_io::lock(&self.0);
        let Some((_, chunks)) = s.jobs.remove(job) else { return Default::default() };
        let done: std::collections::HashMap<u32, ReadAheadOf> = chunks.into_iter().filter_map(|(c, r)| r.map(|r| (c, r))).collect();
        s.rows -= done.values().filter_map(|(r, _)| r.as_ref()).map(|r| r.len() as u64).sum::<u64>();
        done
    }

    /// Rows held now (for tests and the state endpoint).
    #[cfg(test)]
    pub(super) fn held(&self) -> u64 {
        fleet_io::lock(&self.0).rows
    }
}

impl Books {
    /// Reads chunk `chunk` of `job` ahead of its claim, in the background, when there is room.
    pub(super) fn read_ahead(&self, job: &str, chunk: u32, rows: u64) {
        if !self.read_ahead.reserve(job, chunk, rows) {
            return;
        }
        let (store, ahead, job) = (self.store.clone(), self.read_ahead.clone(), job.to_string());
        tokio::spawn(async move {
            let (read, calls) = fleet_io::call::counted(chunk_rows(store.as_ref(), &job, chunk)).await;
            if let Err(e) = &read {
                tracing::debug!(job = %job, chunk, error = %e, "a chunk read ahead of its claim failed; its claim reads it");
            }
            ahead.done(
                &job,
                chunk,
                rows,
                (
                    read.ok().map(|mut r| {
                        r.shrink_to_fit();
                        r
                    }),
                    calls,
                ),
            );
        });
    }
}

/// The largest chunk blob read back (compressed), and the most it may expand to: the processors'
/// default cap, which every chunk a processor billed fit.
const MAX_CHUNK_BYTES: u64 = 64 << 20;

/// A chain's segments listed at most when one is found absent (a day of a billion claims in one
/// shard has a thousand).
const LATER_SEGMENTS: usize = 10_000;

/// Chunks read at once, and chains claimed at once.
const CHUNKS_AT_ONCE: usize = 4;
const CHAINS_AT_ONCE: usize = 16;

impl Books {
    /// Claims the transactions of the job's committed ending and settles what the claims found on it.
    pub(super) async fn claim(&self, job: &mut Job, manifest: &Manifest) -> Result<()> {
        let Phase::Ending(decision) = job.phase() else { unreachable!("only a committed ending claims") };
        let failed: BTreeSet<u32> = decision.failed.iter().map(|f| f.chunk).collect();
        let counted: Vec<u32> = job.tally().accounted_chunks().iter().copied().filter(|c| !failed.contains(c)).collect();
        let job_id = job.id().to_string();
        let store = self.store.as_ref();
        // Its report written already (a finish cut short after it, before the rows were dropped):
        // what it billed is final; nothing to claim or take out.
        if store.head(&report_key(&job_id)).await?.is_some() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let mut rows: Vec<Row> = Vec::new();
        // What was read ahead (its reads' calls are the job's), then the rest. The last chunk's read
        // began with its result, just now: waited for (a few seconds at most), not read twice.
        let waiting = tokio::time::Instant::now();
        while self.read_ahead.pending(&job_id) > 0 && waiting.elapsed() < std::time::Duration::from_secs(5) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let mut ahead = std::collections::HashMap::new();
        for (chunk, (read, calls)) in self.read_ahead.take(&job_id) {
            // Every read's calls are the job's, its rows used or not.
            job.count(&calls);
            if let Some(read) = read {
                ahead.insert(chunk, read);
            }
        }
        let mut unread = Vec::new();
        for &chunk in &counted {
            match ahead.remove(&chunk) {
                Some(read) => rows.extend(read),
                None => unread.push(chunk),
            }
        }
        let read_ahead = counted.len() - unread.len();
        for group in unread.chunks(CHUNKS_AT_ONCE) {
            for read in futures::future::try_join_all(group.iter().map(|&chunk| chunk_rows(store, &job_id, chunk))).await? {
                rows.extend(read);
            }
        }
        let n_rows = rows.len();
        let read_ms = started.elapsed().as_millis() as u64;
        let mut claims = Claims::of(&job_id, rows);
        let chains = claims.chains.len();
        for group in claims.chains.chunks_mut(CHAINS_AT_ONCE) {
            futures::future::try_join_all(group.iter_mut().map(|chain| run_chain(store, chain))).await?;
        }
        let outcome = claims.outcome();
        // The tariff is looked for only when there is something to take out.
        let (subtract, rejected) = if outcome.duplicates.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let fees = tariff_of(store, &job_id, manifest).await?.calculator();
            duplicates(store, &job_id, manifest, &fees, &outcome.duplicates).await?
        };
        tracing::info!(job = %job_id, rows = n_rows, chunks = counted.len(), read_ahead, chains, claimed = outcome.claimed, own = outcome.own, duplicates = rejected.len(),
            read_ms, elapsed_ms = started.elapsed().as_millis() as u64, "transactions claimed");
        job.settle_claims(&subtract, rejected).map_err(|e| Error::Corrupt(format!("job {job_id}: its duplicates read again do not fit its totals: {e}")))
    }
}

/// The tariff the job's rows were billed with: its manifest's, or, for a job whose submission never
/// wrote one (its manifest a stand-in), the one its initiator stored before its first work item.
async fn tariff_of(store: &dyn BlobStore, job_id: &str, manifest: &Manifest) -> Result<Tariff> {
    if !manifest.created_at.is_empty() {
        return Ok(manifest.tariff.clone());
    }
    match store.get_capped(&tariff_key(job_id), 1 << 20).await? {
        Some(b) => serde_json::from_slice(&b).map_err(|e| Error::Corrupt(format!("{}: {e}", tariff_key(job_id)))),
        None => Err(Error::Corrupt(format!("job {job_id} has neither a manifest nor {}: its duplicates' fees are not known", tariff_key(job_id)))),
    }
}

/// Chunk `chunk`'s rows as claimed: each row's day and fingerprint.
async fn chunk_rows(store: &dyn BlobStore, job_id: &str, chunk: u32) -> Result<Vec<Row>> {
    let data = read_chunk(store, job_id, chunk).await?;
    fleet_io::blocking(move || {
        let mut rows = Vec::new();
        chunk_claim_rows(&data, MAX_CHUNK_BYTES, |row, day, fp| rows.push(Row { day, fp, chunk, row })).map(|()| rows)
    })
    .await
    .map_err(|e| Error::Corrupt(format!("reading chunk {chunk} of job {job_id} again: {e}")))?
    .map_err(|e| Error::Corrupt(format!("chunk {chunk} of job {job_id} read again: {e}")))
}

async fn read_chunk(store: &dyn BlobStore, job_id: &str, chunk: u32) -> Result<Bytes> {
    store
        .get_capped(&chunk_key(job_id, chunk), MAX_CHUNK_BYTES)
        .await?
        .ok_or_else(|| Error::Corrupt(format!("chunk {chunk} of job {job_id} is gone: its rows cannot be claimed")))
}

/// Performs one chain's effects until it is done.
async fn run_chain(store: &dyn BlobStore, chain: &mut ShardClaim) -> Result<()> {
    let mut answer = Answer::Start;
    loop {
        answer = match chain.next(answer) {
            Effect::Done => return Ok(()),
            Effect::Read { seg } => {
                let key = claims_key(chain.day, chain.shard, seg);
                match store.get_tagged(&key).await? {
                    None => Answer::Read(None),
                    Some((body, etag)) => Answer::Read(Some((Segment::decode(&body).map_err(|e| Error::Corrupt(format!("{key}: {e}")))?, etag))),
                }
            }
            Effect::Later { seg } => {
                let prefix = claims_chain_prefix(chain.day, chain.shard);
                let keys = store.list(&prefix, LATER_SEGMENTS).await?;
                Answer::Later(keys.iter().filter_map(|k| claims_segment_of(k)).filter(|&n| n > seg).min())
            }
            Effect::Write { seg, body, etag } => {
                let key = claims_key(chain.day, chain.shard, seg);
                let cond = etag.map_or(Cond::Absent, Cond::Matches);
                match store.put_if(&key, body, "application/octet-stream", &Default::default(), &cond).await? {
                    Some(_) => Answer::Written,
                    None => Answer::Conflict,
                }
            }
        };
    }
}

/// The duplicates' bills (one row per duplicate, to take out) and their rejections, read again from
/// their chunks.
async fn duplicates(
    store: &dyn BlobStore,
    job_id: &str,
    manifest: &Manifest,
    fees: &FeeCalculator,
    found: &[(Row, String)],
) -> Result<(Vec<AccountTotals>, Vec<Rejected>)> {
    let mut by_chunk: BTreeMap<u32, Vec<(u32, &str)>> = BTreeMap::new();
    for (row, by) in found {
        by_chunk.entry(row.chunk).or_default().push((row.row, by));
    }
    let (mut subtract, mut rejected) = (Vec::new(), Vec::new());
    for (chunk, mut rows) in by_chunk {
        rows.sort_unstable();
        let data = read_chunk(store, job_id, chunk).await?;
        let wanted: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let by: BTreeMap<u32, &str> = rows.iter().copied().collect();
        let source = manifest.chunk_source(chunk);
        chunk_rows_at(&data, MAX_CHUNK_BYTES, &wanted, |n, t| {
            let fee = fees.fee(t.amount, t.currency_str());
            subtract.push(AccountTotals { account_id: t.account_id.to_string(), currency: t.currency_str().to_string(), count: 1, gross: t.amount, fees: fee });
            let other = by.get(&n).copied().unwrap_or_default();
            let (file, line, lines) = match source.first() {
                Some(l) => (l.file.clone(), l.first, source.iter().map(|l| format!("{} lines {}-{}", l.file, l.first, l.last)).collect::<Vec<_>>().join(", ")),
                None => (String::new(), 0, "lines not recorded".to_string()),
            };
            rejected.push(Rejected {
                file,
                line,
                txn_id: Some(t.txn_id.to_string()),
                reason: format!("txn_id: already billed by job {other} (this row is in chunk {chunk}: {lines})"),
            });
        })
        .map_err(|e| Error::Corrupt(format!("chunk {chunk} of job {job_id} read again: {e}")))?;
    }
    Ok((subtract, rejected))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: u32) -> Vec<Row> {
        (0..n).map(|i| Row { day: 1, fp: u128::from(i), chunk: 0, row: i }).collect()
    }

    /// Room is reserved before a read and made exact after it; a chunk is read once; what its
    /// claim takes frees its room, and a failed read's calls are still the job's.
    #[test]
    fn read_ahead_holds_at_most_its_room_and_gives_every_reads_calls_to_the_claim() {
        let a = ReadAhead::default();
        assert!(a.reserve("j", 0, 1_000));
        assert!(!a.reserve("j", 0, 1_000), "a chunk read once");
        assert!(!a.reserve("k", 0, READ_AHEAD_ROWS), "no room past the bound");
        assert_eq!(a.pending("j"), 1);
        let mut calls = RequestCounts::default();
        calls.add(fleet_domain::requests::Billed::call(fleet_domain::requests::Op::S3GetObject), 1);
        a.done("j", 0, 1_000, (Some(rows(900)), calls.clone()));
        assert_eq!((a.pending("j"), a.held()), (0, 900), "the reservation made exact");
        assert!(a.reserve("j", 1, 10));
        a.done("j", 1, 10, (None, calls.clone()));
        let taken = a.take("j");
        assert_eq!(taken.len(), 2);
        assert_eq!(taken[&0].0.as_ref().map(Vec::len), Some(900));
        assert!(taken[&1].0.is_none() && taken[&1].1 == calls, "a failed read: no rows, its calls kept");
        assert_eq!(a.held(), 0, "taken: room freed");
        assert!(a.take("j").is_empty());
    }
}
