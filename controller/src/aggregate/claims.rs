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
        for group in counted.chunks(CHUNKS_AT_ONCE) {
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
        tracing::info!(job = %job_id, rows = n_rows, chunks = counted.len(), chains, claimed = outcome.claimed, own = outcome.own, duplicates = rejected.len(),
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
