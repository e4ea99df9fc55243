//! Why one file: the jobs a seed draws, the stand-in initiator and processors that play them, and the
//! oracle computed from the same draw are one story; a chunk's fate is decided, acted out and checked
//! here, and split they would have to agree across files.
//!
//! The fleet around the controllers, drawn from the seed: jobs of several shapes with their input
//! transactions, an initiator that enqueues their work items, writes their manifests and seals them
//! (or never does), and processors that bill the chunks and send results, each chunk with a fate
//! (processed, sent twice, its delete lost, failed, dead-lettered, lost before it was enqueued, a
//! failure report or a hostile result ahead of the real one). The oracle is computed from the input
//! transactions, not from the results the controllers see.
//!
//! On a FIFO work queue (a third of the runs: the whole fleet points at `billing-work.fifo`, as the
//! README's *FIFO work queues* says) every work item carries its message group as the initiator
//! gives it: each chunk its own group, or, with `--group-by account`, one of a few account
//! partitions shared by every job of the run, whose chunks the processors then bill one at a time in
//! send order; a work item sent twice (a batch retried after a lost answer) is dropped by the queue's
//! de-duplication.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::billing::{AccountTotals, Tariff};
use fleet_domain::codec::{accounts_to_zstd_csv, base64_encode, sha256_hex};
use fleet_domain::layout::{chunk_key, manifest_key, partition_of, result_key};
use fleet_domain::model::{AccountsPayload, BlobRef, ChunkOutcome, ChunkRecord, ChunkResult, Manifest, ResultMessage, WorkItem, WIRE_VERSION};
use fleet_domain::requests::RequestCounts;
use fleet_io::blob::BlobStore;
use fleet_io::queue::{Attrs, Outgoing, Queue};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rust_decimal::Decimal;

use crate::{World, MAX_RECEIVES};

/// What becomes of one chunk's work item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Billed, its result sent once, the item deleted.
    Processed,
    /// Its result sent twice (a send retried after a lost answer).
    Duplicated,
    /// Billed, but the first delete was lost: billed again on redelivery, its result sent again.
    DeleteLost,
    /// The processor reports it failed (bad input): truly failed.
    Failed,
    /// Fails on every receive until the work queue dead-letters it: truly failed.
    Poison,
    /// Never enqueued (lost to retention or FIFO de-duplication): the sealed job stalls without it.
    Lost,
    /// A failure report first, then, on the item's redelivery, the real result.
    FailedFirst,
    /// A hostile result (a payload that inflates far past what it declares) first, then the real one.
    HostileFirst,
    /// Its work item sent twice (on a FIFO queue: the second dropped by de-duplication), then billed.
    Resent,
}

impl Fate {
    /// Whether the chunk is truly billed (its real result is sent).
    pub fn billed(self) -> bool {
        !matches!(self, Fate::Failed | Fate::Poison | Fate::Lost)
    }
}

/// How a job's submission ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Sealed,
    /// The initiator died after the manifest, before the seal.
    DiedAfterManifest,
    /// The initiator died before the manifest.
    DiedBeforeManifest,
    /// `initiator abandon` (an `Abandon` message) after the work items.
    Abandoned,
}

/// How a job's work items are grouped on a FIFO work queue (the initiator's `--group-by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Groups {
    /// Without `--group-by`: each chunk is its own group (no order).
    PerChunk,
    /// `--group-by account --groups n`: each chunk holds one partition's accounts, and a partition's
    /// work items are billed one at a time, in send order.
    Accounts(u32),
}

#[derive(Debug)]
pub struct ChunkPlan {
    pub fate: Fate,
    /// Its work item's message group, on a FIFO work queue.
    pub group: Option<String>,
    /// (account, currency, amount, fee)
    pub rows: Vec<(String, &'static str, Decimal, Decimal)>,
}

#[derive(Debug)]
pub struct JobPlan {
    pub id: String,
    pub shape: &'static str,
    pub chunks: Vec<ChunkPlan>,
    pub ending: Ending,
    /// When the initiator starts it (simulated time from the run's start).
    pub submit_at: Duration,
    /// A hostile sender puts results for chunks beyond the job on the queue, before its seal.
    pub forged_beyond: bool,
    /// Its grouping, on a FIFO work queue.
    pub groups: Option<Groups>,
    /// Its results partition (as the initiator picks it: a hash of its id).
    pub partition: u16,
}

pub type Row = (u64, Decimal, Decimal);

impl JobPlan {
    /// The oracle: per (account, currency), count, gross and fees over the given chunks, from the
    /// input transactions.
    pub fn oracle(&self, chunks: impl Iterator<Item = u32>) -> BTreeMap<(String, String), Row> {
        let mut out: BTreeMap<(String, String), Row> = BTreeMap::new();
        for c in chunks {
            for (a, cur, amount, fee) in &self.chunks[c as usize].rows {
                let e = out.entry((a.clone(), cur.to_string())).or_insert((0, Decimal::ZERO, Decimal::ZERO));
                e.0 += 1;
                e.1 += amount;
                e.2 += fee;
            }
        }
        out
    }

    /// The chunks that truly failed (no real result is ever sent for them).
    pub fn truly_failed(&self) -> BTreeSet<u32> {
        (0..self.chunks.len() as u32).filter(|&c| !self.chunks[c as usize].fate.billed()).collect()
    }

    /// The chunk's totals as a processor computes them.
    pub fn totals(&self, chunk: u32) -> Vec<AccountTotals> {
        self.oracle(std::iter::once(chunk))
            .into_iter()
            .map(|((account_id, currency), (count, gross, fees))| AccountTotals { account_id, currency, count, gross, fees })
            .collect()
    }
}

fn fate(rng: &mut ChaCha8Rng, hostile: bool, poison: bool, fifo: bool) -> Fate {
    match rng.random_range(0..100) {
        80..84 if !poison => Fate::Processed,
        0..6 if fifo => Fate::Resent,
        0..60 => Fate::Processed,
        60..68 => Fate::Duplicated,
        68..76 => Fate::DeleteLost,
        76..80 => Fate::Failed,
        80..84 => Fate::Poison,
        84..87 => Fate::Lost,
        87..94 => Fate::FailedFirst,
        _ if hostile => Fate::HostileFirst,
        _ => Fate::Processed,
    }
}

/// The jobs of a run (grouped when the work queue is FIFO; without chunks that truly dead-letter
/// unless `poison`).
pub fn plan(rng: &mut ChaCha8Rng, seed: u64, hostile: bool, poison: bool, fifo: bool, partitions: u16) -> Vec<JobPlan> {
    let n = rng.random_range(1..=4);
    (0..n)
        .map(|j| {
            let (shape, chunks, rows, accounts) = match rng.random_range(0..10) {
                // More (account, currency) rows than one checkpoint document holds inline.
                0 | 1 => ("large", rng.random_range(2..=3), 2200, 5000),
                2 => ("empty", 0, 0, 1),
                _ => ("small", rng.random_range(1..=6), rng.random_range(1..=20), rng.random_range(1..=12)),
            };
            let id = format!("sim{seed:x}-{j}");
            let groups = fifo.then(|| if rng.random_bool(0.5) { Groups::PerChunk } else { Groups::Accounts(rng.random_range(1..=3)) });
            let chunks = (0..chunks)
                .map(|c| {
                    let (group, partition) = match groups {
                        None => (None, None),
                        Some(Groups::PerChunk) => (Some(format!("{id}-{c}")), None),
                        Some(Groups::Accounts(n)) => {
                            let p = rng.random_range(0..n);
                            (Some(format!("accounts-{p}-of-{n}")), Some((p, n)))
                        }
                    };
                    let rows = (0..rows)
                        .map(|_| {
                            let mut a = rng.random_range(0..accounts);
                            if let Some((p, n)) = partition {
                                // Only the partition's accounts.
                                a = a / n * n + p;
                            }
                            let a = format!("acct-{a:05}");
                            let cur = if rng.random_bool(0.8) { "EUR" } else { "USD" };
                            let amount = Decimal::new(rng.random_range(-5_000..100_000), 2);
                            let fee = (amount.abs() * Decimal::new(1, 2)).round_dp(2);
                            (a, cur, amount, fee)
                        })
                        .collect();
                    ChunkPlan { fate: fate(rng, hostile, poison, fifo), group, rows }
                })
                .collect();
            let ending = match rng.random_range(0..20) {
                0 => Ending::DiedAfterManifest,
                1 => Ending::DiedBeforeManifest,
                2 => Ending::Abandoned,
                _ => Ending::Sealed,
            };
            let forged_beyond = hostile && rng.random_bool(0.15);
            let partition = partition_of(&id, partitions);
            JobPlan { id, shape, chunks, ending, submit_at: Duration::from_millis(rng.random_range(0..60_000)), forged_beyond, groups, partition }
        })
        .collect()
}

/// The suffix of job ids the hostile sender makes up (nobody submitted them).
pub const FORGED: &str = "-forged";

/// The initiator of one job: its work items (in chunk order, ten a batch), then its manifest and seal.
pub async fn initiate(job: Arc<JobPlan>, world: Arc<World>, work: Arc<dyn Queue>, results: Vec<Arc<dyn Queue>>, store: Arc<dyn BlobStore>) {
    tokio::time::sleep(job.submit_at).await;
    // The chunk blobs first (every chunk's, also those whose work item is lost later), then the items.
    for c in 0..job.chunks.len() as u32 {
        // With its record, as the initiator writes it (the controller holds results to it).
        let record = ChunkRecord { transactions: job.chunks[c as usize].rows.len() as u64, raw_bytes: 64 * job.chunks[c as usize].rows.len() as u64 };
        store
            .put_if(&chunk_key(&job.id, c), Bytes::from_static(b"chunk"), "application/zstd", &record.to_meta(), &fleet_io::blob::Cond::Any)
            .await
            .expect("the initiator's store does not fail");
    }
    let items: Vec<Outgoing> = (0..job.chunks.len() as u32)
        .filter(|&c| job.chunks[c as usize].fate != Fate::Lost)
        .flat_map(|c| {
            let item = WorkItem {
                partition: job.partition,
                v: WIRE_VERSION,
                job_id: job.id.clone(),
                chunk: c,
                transactions: job.chunks[c as usize].rows.len() as u64,
                blob: BlobRef { key: chunk_key(&job.id, c), sha256: "0".repeat(64), compressed_bytes: 1, raw_bytes: 1 },
                tariff: Tariff::default(),
            };
            let chunk = &job.chunks[c as usize];
            let out = Outgoing {
                body: serde_json::to_string(&item).expect("serializable"),
                attrs: Attrs { group: chunk.group.clone(), ..Attrs::default() },
                dedup: None,
            };
            let copies = if chunk.fate == Fate::Resent { 2 } else { 1 };
            std::iter::repeat_n(out, copies)
        })
        .collect();
    // One batch at a time, in chunk order (as the initiator sends on a FIFO queue).
    for batch in items.chunks(10) {
        work.send_messages(batch).await.expect("the in-memory queue takes every message");
    }
    world.trace(format!("initiator: job {} ({}, {} chunks) enqueued", job.id, job.shape, job.chunks.len()));
    if job.ending == Ending::DiedBeforeManifest {
        return;
    }
    let counts: Vec<u64> = job.chunks.iter().map(|c| c.rows.len() as u64).collect();
    let total: u64 = counts.iter().sum();
    let manifest = Manifest {
        partition: job.partition,
        v: WIRE_VERSION,
        job_id: job.id.clone(),
        created_at: "2026-11-26T00:00:00Z".into(),
        files: vec!["sim.csv".into()],
        submitted: total,
        accepted: total,
        rejected: Vec::new(),
        total_chunks: job.chunks.len() as u32,
        chunk_transactions: counts,
        tariff: Tariff::default(),
        requests: RequestCounts::default(),
    };
    store
        .put(&manifest_key(&job.id), Bytes::from(serde_json::to_vec(&manifest).expect("serializable")), "application/json")
        .await
        .expect("the initiator's store does not fail");
    let last = match job.ending {
        Ending::Sealed => ResultMessage::Sealed { v: WIRE_VERSION, job_id: job.id.clone(), total_chunks: job.chunks.len() as u32 },
        Ending::Abandoned => {
            tokio::time::sleep(Duration::from_secs(5)).await;
            ResultMessage::Abandon { v: WIRE_VERSION, job_id: job.id.clone(), reason: "simulated operator".into() }
        }
        Ending::DiedAfterManifest | Ending::DiedBeforeManifest => return,
    };
    send(&world, &job, &results, vec![serde_json::to_string(&last).expect("serializable")]).await;
}

/// Sends messages of `job` to its partition's results queue, noting when.
async fn send(world: &World, job: &JobPlan, results: &[Arc<dyn Queue>], bodies: Vec<String>) {
    world.sent(&job.id);
    results[usize::from(job.partition)].send(bodies).await.expect("the in-memory queue takes every message");
}

/// One processor: receives work items, bills them as their fate says, sends results, deletes. On a
/// FIFO queue it keeps a group's order as the listener engine does: a failing item is retried in
/// place with back-off (a failure report or hostile result first, then the real one after the
/// retry) and, on its last attempt, dead-lettered by the processor itself; the group's later items
/// never go back with it.
pub async fn process(
    jobs: Arc<BTreeMap<String, Arc<JobPlan>>>,
    world: Arc<World>,
    mut rng: ChaCha8Rng,
    work: Arc<dyn Queue>,
    work_dlq: Arc<dyn Queue>,
    results: Vec<Arc<dyn Queue>>,
    store: Arc<dyn BlobStore>,
) {
    loop {
        let got = work.receive(10, Duration::from_secs(5)).await.expect("in-memory receive");
        for d in got {
            let item: WorkItem = serde_json::from_str(&d.body).expect("the initiator's work item");
            let job = &jobs[&item.job_id];
            let fate = job.chunks[item.chunk as usize].fate;
            let first = world.handling(&job.id, item.chunk);
            tokio::time::sleep(Duration::from_millis(rng.random_range(10..3_000))).await;
            let (bodies, delete): (Vec<String>, bool) = match fate {
                Fate::Processed | Fate::Resent => (vec![chunk_result(job, item.chunk, &mut rng, &*store).await], true),
                Fate::Duplicated => {
                    let r = chunk_result(job, item.chunk, &mut rng, &*store).await;
                    (vec![r.clone(), r], true)
                }
                Fate::DeleteLost => (vec![chunk_result(job, item.chunk, &mut rng, &*store).await], !first),
                Fate::Failed => (vec![failed(job, item.chunk)], true),
                Fate::Poison if d.attrs.group.is_some() => {
                    for attempt in d.receive_count..MAX_RECEIVES {
                        world.trace(format!("processor: {} chunk {} failed (attempt {attempt}), retried in place", job.id, item.chunk));
                        tokio::time::sleep(Duration::from_secs(2 << attempt.min(6))).await;
                    }
                    world.trace(format!("processor: {} chunk {} dead-lettered", job.id, item.chunk));
                    d.dead_letter(&*work, &*work_dlq, "failed").await.map_err(|(e, _)| e).expect("in-memory dead letter");
                    continue;
                }
                Fate::Poison => (Vec::new(), false),
                Fate::Lost => unreachable!("never enqueued"),
                Fate::FailedFirst | Fate::HostileFirst if first && d.attrs.group.is_some() => {
                    let wrong = if fate == Fate::FailedFirst { failed(job, item.chunk) } else { hostile(job, item.chunk) };
                    send(&world, job, &results, vec![wrong]).await;
                    world.trace(format!("processor: {} chunk {} failed (attempt {}), retried in place", job.id, item.chunk, d.receive_count));
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    (vec![chunk_result(job, item.chunk, &mut rng, &*store).await], true)
                }
                Fate::FailedFirst if first => (vec![failed(job, item.chunk)], false),
                Fate::HostileFirst if first => (vec![hostile(job, item.chunk)], false),
                Fate::FailedFirst | Fate::HostileFirst => (vec![chunk_result(job, item.chunk, &mut rng, &*store).await], true),
            };
            for b in bodies {
                send(&world, job, &results, vec![b]).await;
            }
            if job.forged_beyond && item.chunk == 0 && first {
                // Chunks the job does not have, with rows that look real, ahead of the seal.
                let n = job.chunks.len() as u32;
                for c in [n, n + 2, n + 40] {
                    let mut forged: ChunkResult = match serde_json::from_str(&chunk_result(job, 0, &mut rng, &*store).await) {
                        Ok(ResultMessage::Chunk(r)) => r,
                        _ => unreachable!("a chunk result"),
                    };
                    forged.chunk = c;
                    if let ChunkOutcome::Processed { payload: AccountsPayload::Blob { .. } } = forged.outcome {
                        forged.outcome = ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: job.totals(0) } };
                    }
                    send(&world, job, &results, vec![serde_json::to_string(&ResultMessage::Chunk(forged)).expect("serializable")]).await;
                }
                // A seal smaller than the job, a count larger than its chunk's with an account of its
                // own, and a result and a seal for a job nobody submitted: none of it may count, and
                // the forged job may leave nothing behind but its quarantined messages.
                let mut bodies = Vec::new();
                if n > 1 {
                    bodies.push(
                        serde_json::to_string(&ResultMessage::Sealed { v: WIRE_VERSION, job_id: job.id.clone(), total_chunks: 1 }).expect("serializable"),
                    );
                }
                let mut more: ChunkResult = match serde_json::from_str(&chunk_result(job, 0, &mut rng, &*store).await) {
                    Ok(ResultMessage::Chunk(r)) => r,
                    _ => unreachable!("a chunk result"),
                };
                let mut accounts = job.totals(0);
                accounts.push(AccountTotals {
                    account_id: "forged".into(),
                    currency: "EUR".into(),
                    count: 7,
                    gross: Decimal::new(700, 2),
                    fees: Decimal::ZERO,
                });
                more.transactions += 7;
                more.outcome = ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: accounts.clone() } };
                bodies.push(serde_json::to_string(&ResultMessage::Chunk(more.clone())).expect("serializable"));
                more.job_id = format!("{}{FORGED}", job.id);
                bodies.push(serde_json::to_string(&ResultMessage::Chunk(more)).expect("serializable"));
                bodies.push(
                    serde_json::to_string(&ResultMessage::Sealed { v: WIRE_VERSION, job_id: format!("{}{FORGED}", job.id), total_chunks: 1 })
                        .expect("serializable"),
                );
                send(&world, job, &results, bodies).await;
            }
            if delete {
                work.delete(vec![d]).await.expect("in-memory delete");
            }
        }
    }
}

fn failed(job: &JobPlan, chunk: u32) -> String {
    let r = ChunkResult {
        v: WIRE_VERSION,
        job_id: job.id.clone(),
        chunk,
        transactions: job.chunks[chunk as usize].rows.len() as u64,
        outcome: ChunkOutcome::Failed { reason: "simulated: invalid rows".into() },
        requests: RequestCounts::default(),
    };
    serde_json::to_string(&ResultMessage::Chunk(r)).expect("serializable")
}

/// A well-formed bomb: a result that declares its chunk's true count (so its job's records let it
/// through) with a payload that inflates to 60 MiB of nothing billable. Only the decode cap taken from
/// the chunk's record keeps it from being held whole.
fn hostile(job: &JobPlan, chunk: u32) -> String {
    static BOMB: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let bomb = BOMB.get_or_init(|| base64_encode(&zstd::bulk::compress(&vec![b'a'; 60 << 20], 3).expect("compressible")));
    let r = ChunkResult {
        v: WIRE_VERSION,
        job_id: job.id.clone(),
        chunk,
        transactions: job.chunks[chunk as usize].rows.len() as u64,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::ZstdCsv { data: bomb.clone() } },
        requests: RequestCounts::default(),
    };
    serde_json::to_string(&ResultMessage::Chunk(r)).expect("serializable")
}

async fn chunk_result(job: &JobPlan, chunk: u32, rng: &mut ChaCha8Rng, store: &dyn BlobStore) -> String {
    let accounts = job.totals(chunk);
    let payload = match rng.random_range(0..3) {
        0 if accounts.len() <= 50 => AccountsPayload::Inline { accounts },
        1 => AccountsPayload::ZstdCsv { data: base64_encode(&accounts_to_zstd_csv(accounts.iter().map(AccountTotals::borrowed))) },
        _ => {
            let data = accounts_to_zstd_csv(accounts.iter().map(AccountTotals::borrowed));
            let raw = accounts.iter().map(|a| a.account_id.len() as u64 + 64).sum::<u64>() + 64;
            let blob = BlobRef { key: result_key(&job.id, chunk), sha256: sha256_hex(&data), compressed_bytes: data.len() as u64, raw_bytes: raw };
            store.put(&blob.key, Bytes::from(data), "application/zstd").await.expect("the processors' store does not fail");
            AccountsPayload::Blob { blob }
        }
    };
    let r = ChunkResult {
        v: WIRE_VERSION,
        job_id: job.id.clone(),
        chunk,
        transactions: job.chunks[chunk as usize].rows.len() as u64,
        outcome: ChunkOutcome::Processed { payload },
        requests: RequestCounts::default(),
    };
    serde_json::to_string(&ResultMessage::Chunk(r)).expect("serializable")
}
