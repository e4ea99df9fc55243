//! Why one file: the jobs a seed draws, the fates of their chunks, how the real initiator and
//! processors meet those fates, and the oracle computed from the same draw are one story; a chunk's
//! fate is decided, acted out and checked here, and split they would have to agree across files.
//!
//! The fleet around the controllers, drawn from the seed: jobs of several shapes with their input
//! transactions, submitted by the real initiator (`initiator::submit::submit_inputs`, from a CSV in
//! memory) and billed by two real processors (`processor::start`). Each chunk has a fate (processed,
//! its result sent twice, its delete lost, failed, dead-lettered, lost before it was enqueued, a
//! failure report or a hostile result ahead of the real one), acted out on the initiator's and
//! processors' ways to the queues and the store ([`Fated`]): a lost answer, a lost delete, a corrupt
//! or refused chunk blob, a work item dropped or sent twice. A submission dies before its manifest
//! or its seal, or is abandoned by `initiator abandon`. A hostile sender puts forged results, seals
//! and bombs on the job's partition; a rogue submitter writes a manifest its chunks disagree with.
//! The oracle is computed from the input transactions and the tariff, not from the results the
//! controllers see.
//!
//! On a FIFO work queue (a third of the runs: the whole fleet points at `billing-work.fifo`, as the
//! README's *FIFO work queues* says) the initiator groups work items as it does for users: each chunk
//! its own group, or, with `--group-by account`, one of a few account partitions shared by every job
//! of the run, whose chunks the processors' engine then bills one at a time in send order; a work
//! item sent twice (a batch retried after a lost answer) is dropped by the queue's de-duplication.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use fleet_domain::billing::AccountTotals;
use fleet_domain::codec::base64_encode;
use fleet_domain::input::InputFile;
use fleet_domain::layout::{chunk_key, manifest_key, partition_of};
use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, Manifest, ResultMessage, WorkItem, WIRE_VERSION};
use fleet_domain::requests::RequestCounts;
use fleet_io::auth::{Key, Keyring, Role as AuthRole};
use fleet_io::blob::BlobStore;
use fleet_io::call::CallCounter;
use fleet_io::error::{Error, Result, Service};
use fleet_io::memory::{Hook, Hooked, Put};
use fleet_io::queue::{Delivery, Outgoing, Queue, QueueDepth, QueueInfo, Receipt, Sharded};
use fleet_io::trigger::memory::MemoryTriggers;
use fleet_io::trigger::TriggerBus;
use initiator::grouping::{GroupBy, Grouping};
use initiator::ops::abandon;
use initiator::submit::{submit_inputs, Clients, SubmitOptions};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rust_decimal::Decimal;

use crate::World;

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
    /// A straggler: the processor that first bills it is stalled this long as it sends the result
    /// (a slow or paused node), so the job has news minutes after its other chunks.
    pub straggle: Option<Duration>,
    /// Its real result's first send lands on its partition's results dead-letter queue (as SQS
    /// moves a result that controllers received too often without deleting it), racing the job's
    /// other results on the results queue.
    pub dead_lettered: bool,
    /// Its delete was lost (`Fate::DeleteLost`), and the processor that bills its work item again
    /// stalls this long as it sends that copy: a duplicate minutes after the job's news, while the
    /// job may still be waiting out its stall or abandon time (a duplicate is never news).
    pub late_copy: Option<Duration>,
    /// That late copy lands on the results dead-letter queue instead (controllers received it too
    /// often without deleting it), mostly after its job has finished: nobody waits for its job, so
    /// nobody looks there for it, and until someone does it holds every sealed job's stall look.
    pub late_copy_dead_lettered: bool,
}

#[derive(Debug)]
pub struct JobPlan {
    pub id: String,
    /// Whose ids its rows carry: its own, or those of the job it submits again (`twin_of`).
    pub ids: String,
    /// The operator submits job `twin_of`'s rows again as this job (the same ids, accounts and
    /// amounts, chunk for chunk; its chunks' fates its own): each id is billed once over the two,
    /// whichever bills it first, and a row neither bills is billed by neither.
    pub twin_of: Option<usize>,
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
    /// A copy of its chunk 0's first result is also sent on another results partition (a stray, as a
    /// misrouting or hostile processor sends it): it may never load or lease the job there.
    pub stray: bool,
    /// A rogue submitter writes its manifest one accepted transaction more than its chunks hold (its
    /// role owns the manifest, so the controller cannot refuse it): the job may never be reported
    /// `complete`, since not every accepted transaction is processed or failed.
    pub lying_manifest: bool,
    /// Submitted by an initiator of the release before records: its chunk blobs carry no record (the
    /// controller holds their results to the manifest, or before it exists to the result's own count).
    /// A rogue processor that holds chunk 0's work item sends, after its real result, a bomb that
    /// declares [`HUGE`] transactions: before the manifest, nothing bounds the count, and its decode
    /// could take more than the whole budget, so it must be refused, never decoded alone.
    pub before_records: bool,
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
pub fn plan(rng: &mut ChaCha8Rng, seed: u64, hostile: bool, poison: bool, setup: &crate::Setup) -> Vec<JobPlan> {
    let (fifo, partitions, buggify, stragglers) = (setup.fifo, setup.partitions, setup.buggify, setup.stragglers());
    let n = rng.random_range(1..=4);
    let n = if buggify { n.max(2) } else { n };
    let jobs = (0..n)
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
                    // On a FIFO queue each chunk is its own group, or holds one account partition's
                    // transactions (as the initiator's grouping assigns them) in that partition's group.
                    let (group, partition) = match groups {
                        None => (None, None),
                        Some(Groups::PerChunk) => (Some(Grouping::None.group_id(&id, c, 0)), None),
                        Some(Groups::Accounts(n)) => {
                            let g = Grouping::new(Some(GroupBy::Account), n);
                            let p = rng.random_range(0..n as usize);
                            (Some(g.group_id(&id, c, p)), Some((g, p)))
                        }
                    };
                    let rows = (0..rows)
                        .map(|_| {
                            let mut a = rng.random_range(0..accounts);
                            // Only the partition's accounts (past the job's range when none in it is).
                            while partition.is_some_and(|(g, p)| g.partition(&format!("acct-{a:05}")) != p) {
                                a += 1;
                            }
                            let a = format!("acct-{a:05}");
                            let euro = rng.random_bool(0.8);
                            // Refunds and charges; never zero (the initiator rejects a zero amount).
                            let units: i64 = match rng.random_range(-5_000..100_000) {
                                0 => 1,
                                c => c,
                            };
                            // The rest in dollars, yen and dinars (0, 2 and 3 places), picked by
                            // the amount drawn, so that no draw is added to the plans.
                            let cur = if euro { "EUR" } else { ["USD", "JPY", "BHD"][units.rem_euclid(3) as usize] };
                            let (amount, fee) = oracle_amount_and_fee(units, cur);
                            (a, cur, amount, fee)
                        })
                        .collect();
                    // One chunk in ten straggles, in runs with faults (drawn apart, so that the rest
                    // of the plan stays as it was).
                    let mut own = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed ^ 0x57a6_0000 ^ ((j as u64) << 32) ^ c as u64);
                    // Only a chunk that is billed: a late failure report past the settle time is
                    // a failure all the same, and the job's end does not wait for it.
                    let straggle = (stragglers > 0.0 && own.random_bool(stragglers)).then(|| Duration::from_secs(own.random_range(60..=420)));
                    // One in ten comes by the dead-letter queue (drawn after, for the same reason).
                    let dead_lettered = stragglers > 0.0 && own.random_bool(0.1);
                    let fate = fate(rng, hostile, poison, fifo);
                    // Buggified, one chunk in eight more has its work item lost, one in eight more its
                    // delete lost (drawn apart).
                    let fate = match buggify
                        .then(|| <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed ^ 0xb066_1f00_0000 ^ ((j as u64) << 32) ^ c as u64).random_range(0..8))
                    {
                        Some(0) => Fate::Lost,
                        Some(1) => Fate::DeleteLost,
                        _ => fate,
                    };
                    // Not one with a failure report (or a hostile result) ahead: its real result, dead-lettered after the
                    // receives of controllers that could not take it, may come after the settle time,
                    // which bounds how long a live or crashed peer holds a result, not that; the job
                    // may then end partial by design, which the oracle cannot tell.
                    // A hostile result ahead fails its chunk just as a failure report does (seed
                    // 9104710: its real result, dead-lettered, came after the settle time).
                    let dead_lettered = dead_lettered && fate.billed() && !matches!(fate, Fate::FailedFirst | Fate::HostileFirst);
                    // Half the chunks whose delete is lost send their copy minutes late (drawn after).
                    let late_copy = (stragglers > 0.0 && fate == Fate::DeleteLost && (own.random_bool(0.5) || buggify))
                        .then(|| Duration::from_secs(own.random_range(240..=600)));
                    // Half of those come by the dead-letter queue (drawn after).
                    let late_copy_dead_lettered = late_copy.is_some() && own.random_bool(0.5);
                    ChunkPlan { fate, group, rows, straggle: straggle.filter(|_| fate.billed()), dead_lettered, late_copy, late_copy_dead_lettered }
                })
                .collect();
            let ending = match rng.random_range(0..20) {
                0 | 3 => Ending::DiedAfterManifest,
                1 => Ending::DiedBeforeManifest,
                2 => Ending::Abandoned,
                _ => Ending::Sealed,
            };
            let forged_beyond = hostile && rng.random_bool(0.15);
            let partition = partition_of(&id, partitions);
            // Drawn apart (the rest of the plan stays as it was for every seed).
            let mut own = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed ^ 0x5742_0000_0000 ^ j as u64);
            let stray = hostile && partitions > 1 && own.random_bool(0.25);
            let lying_manifest = hostile && own.random_bool(0.2);
            // (Never a stray: without chunk records nothing names the job's partition before its
            // manifest, and a job of that release was on one results queue. Never one whose chunk
            // 0 gets a forged larger count either: before its manifest nothing bounds a count but the
            // message's own, the upgrade window's documented limit; seed 283986117 billed one.)
            let before_records = hostile && !stray && !forged_beyond && own.random_bool(0.2);
            let submit_at = Duration::from_millis(rng.random_range(0..60_000));
            JobPlan {
                ids: id.clone(),
                twin_of: None,
                id,
                shape,
                chunks,
                ending,
                submit_at,
                forged_beyond,
                groups,
                partition,
                stray,
                lying_manifest,
                before_records,
            }
        })
        .collect::<Vec<_>>();
    let mut jobs = jobs;
    // One run in four submits its first job's rows again as a job of its own (drawn apart, so that
    // the rest of the plan stays as it was): a rerun of the same file, at any moment.
    let mut own = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed ^ 0x7317_0000_0000);
    let first = &jobs[0];
    if own.random_bool(0.25) && !fifo && !first.chunks.is_empty() && !first.before_records && !first.lying_manifest {
        let id = format!("{}-again", first.id);
        let chunks = first
            .chunks
            .iter()
            .map(|c| {
                let fate = fate(&mut own, false, poison, false);
                ChunkPlan { fate, group: None, rows: c.rows.clone(), straggle: None, dead_lettered: false, late_copy: None, late_copy_dead_lettered: false }
            })
            .collect();
        let ending = if own.random_bool(0.2) { Ending::Abandoned } else { Ending::Sealed };
        let partition = partition_of(&id, partitions);
        let submit_at = Duration::from_millis(own.random_range(0..120_000));
        let ids = first.id.clone();
        let shape = first.shape;
        jobs.push(JobPlan {
            id,
            ids,
            twin_of: Some(0),
            shape,
            chunks,
            ending,
            submit_at,
            forged_beyond: false,
            groups: None,
            partition,
            stray: false,
            lying_manifest: false,
            before_records: false,
        });
    }
    jobs
}

/// The suffix of job ids the hostile sender makes up (nobody submitted them).
pub const FORGED: &str = "-forged";

/// The reason of the abandons a rogue processor forges (signed with its own, a processor's, key).
pub const ROGUE_ABANDON: &str = "forged by a rogue processor";

/// The transactions a rogue processor's bomb declares for a chunk without a record (see
/// [`JobPlan::before_records`]): a decode held to that many could take more than the decode budget.
pub const HUGE: u64 = 1_000_000;

/// The account a rogue submitter's forged results bill (signed with its own, a submitter's, key).
pub const MALLORY: &str = "mallory";

/// The run's role keys (`fleet_io::auth`), drawn from the seed: every participant signs with its
/// role's, the controllers check them all; the hostile participants sign with their own roles' keys.
#[derive(Debug, Clone)]
pub struct Keys {
    pub submitter: Key,
    pub operator: Key,
    pub processor: Key,
    pub controller: Key,
}

impl Keys {
    pub fn of(seed: u64) -> Keys {
        let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed ^ 0x6e75_0000_0000);
        let mut key = |role| Key::new(role, (0..32).map(|_| rng.random::<u8>()).collect()).expect("32 bytes");
        Keys {
            submitter: key(AuthRole::Submitter),
            operator: key(AuthRole::Operator),
            processor: key(AuthRole::Processor),
            controller: key(AuthRole::Controller),
        }
    }

    /// The controllers' keyring: every role's key.
    pub fn ring(&self) -> Keyring {
        Keyring::new([self.submitter.clone(), self.operator.clone(), self.processor.clone(), self.controller.clone()])
    }
}

/// `body` signed with `key`, ready to send.
fn signed(body: String, key: &Key) -> Outgoing {
    let auth = Some(key.sign(&body));
    Outgoing { body, attrs: fleet_io::queue::Attrs { auth, ..Default::default() }, dedup: None }
}

impl JobPlan {
    /// Transactions per chunk (every chunk of a job has as many): the initiator's `--chunk-size`.
    fn chunk_rows(&self) -> u64 {
        self.chunks.first().map_or(1, |c| c.rows.len() as u64)
    }

    /// The job's input file: each chunk's rows in chunk order, so that the initiator, cutting a chunk
    /// every [`JobPlan::chunk_rows`] rows (per account partition with `--group-by account`), makes
    /// exactly the planned chunks.
    fn csv(&self) -> String {
        let mut out = String::from("txn_id,account_id,amount,currency,timestamp\n");
        for (c, chunk) in self.chunks.iter().enumerate() {
            for (i, (a, cur, amount, _)) in chunk.rows.iter().enumerate() {
                // Ids of its own: a transaction billed by one job is another's duplicate.
                out.push_str(&format!("{}-t{c}-{i},{a},{amount},{cur},2026-11-26T10:00:00Z\n", self.ids));
            }
        }
        out
    }

    /// The initiator's grouping of the job (`--group-by account --groups n`, or none).
    fn grouping(&self) -> Grouping {
        match self.groups {
            Some(Groups::Accounts(n)) => Grouping::new(Some(GroupBy::Account), n),
            _ => Grouping::None,
        }
    }
}

/// One job's submission by the real initiator (`initiator::submit::submit_inputs`, its input file
/// read from memory): the chunk blobs with their records, the work items, the manifest and the seal.
/// Its ending is acted out on its ways to the store and the queues ([`Fated`]): a submission that
/// dies before its manifest or its seal hangs there for ever (the process is gone); an abandoned one
/// dies before its seal and the operator runs `initiator abandon` (`initiator::ops::abandon`).
pub async fn initiate(
    job: Arc<JobPlan>,
    world: Arc<World>,
    fated: Arc<Fated>,
    work: Arc<dyn Queue>,
    results: Vec<Arc<dyn Queue>>,
    store: Arc<dyn BlobStore>,
    bus: Option<Arc<MemoryTriggers>>,
) {
    tokio::time::sleep(job.submit_at).await;
    let csv = job.csv().into_bytes();
    let size = csv.len() as u64;
    let file = InputFile::from_stream(format!("{}.csv", job.id), Box::new(std::io::Cursor::new(csv)), Some(size)).expect("the header is the validator's");
    let mut opts = SubmitOptions::new(vec![PathBuf::from("-")]);
    opts.job_id = Some(job.id.clone());
    opts.chunk_size = job.chunk_rows().max(1);
    opts.grouping = job.grouping();
    let way = |q: Arc<dyn Queue>| -> Arc<dyn Queue> {
        Arc::new(FatedQueue { inner: q, fated: fated.clone(), role: Role::Initiator, dlq: None, partitions: Vec::new() })
    };
    let results = Sharded::of(results.into_iter().map(way).collect()).expect("at least one partition");
    let clients = Clients {
        work: way(work),
        results: results.clone(),
        store: Hooked::new(store, FatedStore { fated: fated.clone(), role: Role::Initiator }),
        triggers: bus.map(|b| b as Arc<dyn TriggerBus>),
        signing_key: Some(fated.keys.submitter.clone()),
    };
    let submitted = async {
        let s = submit_inputs(opts, vec![file], &clients).await.map_err(|e| e.to_string())?;
        if s.total_chunks as usize != job.chunks.len() || !s.rejected.is_empty() {
            return Err(format!("made {} chunks of the planned {} and rejected {:?}", s.total_chunks, job.chunks.len(), s.rejected));
        }
        Ok(())
    };
    let operator = fated.keys.operator.clone();
    let abandon = async {
        // The operator gives up on a submission that died before its seal.
        while !matches!(clients.store.head(&manifest_key(&job.id)).await, Ok(Some(_))) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        world.trace(format!("operator: initiator abandon {}", job.id));
        abandon(&results, None, &job.id, "simulated operator", None, Some(&operator)).await.map_err(|e| e.to_string())
    };
    let outcome = if job.ending == Ending::Abandoned {
        tokio::select! {
            biased;
            r = submitted => r,
            r = abandon => r,
        }
    } else {
        submitted.await
    };
    match outcome {
        Ok(()) => world.trace(format!("initiator: job {} ({}, {} chunks) submitted", job.id, job.shape, job.chunks.len())),
        // Its store and queues do not fail: a failed submission is the initiator's bug (or the plan's).
        Err(e) => world.trace(format!("PANIC initiator: job {}: {e}", job.id)),
    }
}

/// Starts processor `n` as the service does (`processor::start`: the listener engine and the real
/// work handler), through ways to the queues and the store that act out each chunk's fate.
pub async fn start_processor(n: u64, fated: Arc<Fated>, queues: &crate::Queues, store: Arc<dyn BlobStore>, park_poll_secs: Option<u64>) {
    let (work, work_dlq, bus) = (queues.work.clone() as Arc<dyn Queue>, queues.work_dlq.clone() as Arc<dyn Queue>, queues.bus.clone());
    let results: Vec<(Arc<dyn Queue>, Arc<dyn Queue>)> =
        queues.results.iter().map(|(q, d)| (q.clone() as Arc<dyn Queue>, d.clone() as Arc<dyn Queue>)).collect();
    let partitions: Vec<Arc<dyn Queue>> = results.iter().map(|(q, _)| q.clone()).collect();
    let way = |q: Arc<dyn Queue>, dlq: Option<Arc<dyn Queue>>| -> Arc<dyn Queue> {
        Arc::new(FatedQueue { inner: q, fated: fated.clone(), role: Role::Processor, dlq, partitions: partitions.clone() })
    };
    let mut deps = processor::Deps::new(
        way(work, None),
        Sharded::of(results.into_iter().map(|(q, dlq)| way(q, Some(dlq))).collect()).expect("at least one partition"),
        Hooked::new(store, FatedStore { fated: fated.clone(), role: Role::Processor }),
    );
    deps.work_dlq = Some(work_dlq);
    deps.signing_key = Some(fated.keys.processor.clone());
    deps.triggers = bus.as_ref().map(|b| b.subscription());
    deps.publish = bus.map(|b| b as Arc<dyn TriggerBus>);
    let mut settings = processor::Settings::default();
    settings.listener.http_addr = None;
    if let Some(secs) = park_poll_secs {
        settings.listener.park_poll_secs = secs;
    }
    // Never stopped: the run's end drops the runtime with it.
    let stop = tokio_util::sync::CancellationToken::new();
    if let Err(e) = processor::start(&settings, deps, &stop).await {
        fated.world.trace(format!("PANIC processor {n} did not start: {e}"));
    }
}

/// Who a [`FatedQueue`] or [`FatedStore`] serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Initiator,
    Processor,
}

/// What the fleet's real initiator and processors meet on their ways to the queues and the store:
/// each chunk's fate, drawn from the seed, acted out once (a lost answer, a lost delete, a corrupt or
/// unreadable blob, a work item dropped or sent twice, a message sent ahead of a result).
pub struct Fated {
    jobs: Arc<BTreeMap<String, Arc<JobPlan>>>,
    world: Arc<World>,
    rng: std::sync::Mutex<ChaCha8Rng>,
    /// Fates already acted out, by (job, chunk).
    done: std::sync::Mutex<BTreeSet<(String, u32)>>,
    /// The chunk each processor's receipt is for.
    receipts: std::sync::Mutex<BTreeMap<String, (String, u32)>>,
    /// The run's role keys.
    pub keys: Keys,
}

impl Fated {
    pub fn new(jobs: Arc<BTreeMap<String, Arc<JobPlan>>>, world: Arc<World>, rng: ChaCha8Rng, keys: Keys) -> Arc<Fated> {
        Arc::new(Fated { jobs, world, rng: std::sync::Mutex::new(rng), done: Default::default(), receipts: Default::default(), keys })
    }

    fn fate(&self, job: &str, chunk: u32) -> Option<(&Arc<JobPlan>, Fate)> {
        let plan = self.jobs.get(job)?;
        Some((plan, plan.chunks.get(chunk as usize)?.fate))
    }

    /// Whether the chunk's fate is still to be acted out (true once).
    fn first(&self, job: &str, chunk: u32) -> bool {
        fleet_io::lock(&self.done).insert((job.to_string(), chunk))
    }

    /// Whether [`first`](Self::first) was asked of the chunk's key already.
    fn seen(&self, job: &str, chunk: u32) -> bool {
        fleet_io::lock(&self.done).contains(&(job.to_string(), chunk))
    }

    /// The planned job and chunk whose blob `key` is (`jobs/{job}/chunks/{chunk}.csv.zst`).
    fn chunk_of_key(&self, key: &str) -> Option<(&Arc<JobPlan>, u32)> {
        let (job, rest) = key.strip_prefix("jobs/")?.split_once("/chunks/")?;
        let (job, c) = (self.jobs.get(job)?, rest.strip_suffix(".csv.zst")?.parse::<u32>().ok()?);
        ((c as usize) < job.chunks.len() && chunk_key(&job.id, c) == key).then_some((job, c))
    }
}

fn work_item(body: &str) -> Option<WorkItem> {
    serde_json::from_str(body).ok()
}

fn chunk_of(body: &str) -> Option<(String, u32)> {
    match serde_json::from_str::<ResultMessage>(body) {
        Ok(ResultMessage::Chunk(c)) => Some((c.job_id, c.chunk)),
        _ => None,
    }
}

fn lost(op: &'static str) -> Error {
    Error::Service { service: Service::Sqs, operation: op, detail: "simulated: the answer was lost".into(), retryable: true, source: None }
}

/// A queue as the initiator or a processor reaches it (see [`Fated`]).
struct FatedQueue {
    inner: Arc<dyn Queue>,
    fated: Arc<Fated>,
    role: Role,
    /// A results partition's dead-letter queue (see [`ChunkPlan::dead_lettered`]).
    dlq: Option<Arc<dyn Queue>>,
    /// Every results partition's queue, by number (a processor's: where its strays go).
    partitions: Vec<Arc<dyn Queue>>,
}

impl FatedQueue {
    /// The initiator's work items: a lost one never goes out; a resent one goes out twice (a batch
    /// retried after its answer was lost; on a FIFO queue de-duplication drops the second).
    fn work_items(&self, msgs: &[Outgoing]) -> Vec<Outgoing> {
        let mut out = Vec::new();
        for m in msgs {
            let fate = work_item(&m.body).and_then(|w| self.fated.fate(&w.job_id, w.chunk).map(|(_, f)| f));
            match fate {
                Some(Fate::Lost) => {}
                Some(Fate::Resent) => out.extend([m.clone(), m.clone()]),
                _ => out.push(m.clone()),
            }
        }
        out
    }

    /// A processor's results: a failure report or a hostile result goes ahead of a chunk's first
    /// result, whose send then fails (its work item comes back and is billed again); a duplicated
    /// chunk's first send goes out with its answer lost (sent again on the retry); the hostile
    /// sender's forgeries follow a forging job's first result of chunk 0.
    async fn results(&self, msgs: &[Outgoing]) -> Result<u64> {
        let chunks: Vec<(String, u32)> = msgs.iter().filter_map(|m| chunk_of(&m.body)).collect();
        let mut ahead = Vec::new();
        let (mut answer_lost, mut forge) = (false, None);
        // A straggler's first send waits (its batch with it).
        let straggle = chunks
            .iter()
            .filter_map(|(job, chunk)| Some((job, chunk, self.fated.jobs.get(job)?.chunks.get(*chunk as usize)?.straggle?)))
            .filter(|(job, chunk, _)| self.fated.first(job, *chunk | 0x8000_0000))
            .map(|(job, chunk, d)| {
                self.fated.world.trace(format!("CHAOS processor stalled {:.0} s as it sends {job} chunk {chunk}'s result", d.as_secs_f64()));
                d
            })
            .max();
        // So does the late copy of a chunk whose delete was lost: a result sent after that delete
        // (the work item billed again), not a retry of the first send (seed 516: a batch sent again
        // after a failure report ahead of it).
        let late_copies: Vec<(&String, &u32, Duration)> = chunks
            .iter()
            .filter_map(|(job, chunk)| Some((job, chunk, self.fated.jobs.get(job)?.chunks.get(*chunk as usize)?.late_copy?)))
            .filter(|(job, chunk, _)| self.fated.seen(job, **chunk) && self.fated.first(job, *chunk | 0x0040_0000))
            .collect();
        let late = late_copies
            .iter()
            .map(|(job, chunk, d)| {
                self.fated.world.trace(format!(
                    "CHAOS processor stalled {:.0} s as it sends a copy of {job} chunk {chunk}'s result (its delete was lost)",
                    d.as_secs_f64()
                ));
                *d
            })
            .max();
        // The late copies that land on the dead-letter queue instead.
        let late_dead: BTreeSet<(String, u32)> = late_copies
            .iter()
            .filter(|(job, chunk, _)| self.fated.jobs.get(*job).and_then(|p| p.chunks.get(**chunk as usize)).is_some_and(|c| c.late_copy_dead_lettered))
            .map(|(job, chunk, _)| ((*job).clone(), **chunk))
            .collect();
        let straggle = straggle.max(late);
        if let Some(d) = straggle {
            tokio::time::sleep(d).await;
            // Its work item was in flight on the work queue all along (see `check::lateness`).
            self.fated.world.work_held();
        }
        for (job, chunk) in &chunks {
            let Some((plan, fate)) = self.fated.fate(job, *chunk) else { continue };
            match fate {
                Fate::FailedFirst | Fate::HostileFirst if self.fated.first(job, *chunk) => {
                    ahead.push(if fate == Fate::FailedFirst { failed(plan, *chunk) } else { hostile(plan, *chunk) });
                }
                Fate::Duplicated if self.fated.first(job, *chunk) => answer_lost = true,
                _ => {}
            }
            if plan.forged_beyond && *chunk == 0 && self.fated.first(job, u32::MAX) {
                forge = Some(plan.clone());
            }
        }
        // News of a job: a chunk's first result sent, not a copy of one already sent (a work item
        // handled again after its delete was lost sends a duplicate, perhaps after the job ended: the
        // job never waits for it; seed 18812859, whose duplicate came 85 s after the report).
        for job in chunks.iter().filter(|(j, c)| self.fated.first(j, *c | 0x2000_0000)).map(|(j, _)| j).collect::<BTreeSet<_>>() {
            self.fated.world.sent(job);
        }
        if !ahead.is_empty() {
            // A processor's (a rogue one's, for the bomb): signed with the processor's key.
            // It holds the chunk's work item: its token goes with it.
            let ahead: Vec<Outgoing> = ahead
                .into_iter()
                .map(|b| {
                    let token = chunk_of(&b).map(|(j, c)| self.fated.keys.submitter.chunk_token(&j, c));
                    let mut o = signed(b, &self.fated.keys.processor);
                    o.attrs.chunk_token = token;
                    o
                })
                .collect();
            self.inner.send_messages(&ahead).await?;
            return Err(lost("SendMessageBatch"));
        }
        // A dead-lettered chunk's first result goes to the dead-letter queue instead, and so does a
        // late copy drawn to (a duplicate: never news, never the chunk's dead letter).
        let (to_dlq, msgs): (Vec<Outgoing>, Vec<Outgoing>) = msgs.iter().cloned().partition(|m| {
            self.dlq.is_some()
                && chunk_of(&m.body).is_some_and(|(job, chunk)| {
                    late_dead.contains(&(job.clone(), chunk))
                        || (self.fated.jobs.get(&job).and_then(|p| p.chunks.get(chunk as usize)).is_some_and(|c| c.dead_lettered)
                            && self.fated.first(&job, chunk | 0x4000_0000))
                })
        });
        // A copy of the chunk's result reached the results queue: one dead-lettered later is a
        // duplicate, no news of the job (the controller's rule, `duplicates-not-news`).
        // And the first such copy of a chunk whose first result was dead-lettered is the job's news
        // if the dead letter has not landed yet (then it is a duplicate; seed 160658493: a copy
        // sent again 180 s after the dead letter landed dated the job's quiet from itself).
        for (job, chunk) in msgs.iter().filter_map(|m| chunk_of(&m.body)) {
            let landed = self.fated.seen(&job, chunk | 0x0200_0000);
            if self.fated.first(&job, chunk | 0x1000_0000) && self.fated.seen(&job, chunk | 0x4000_0000) && !landed {
                self.fated.world.sent(&job);
            }
        }
        let mut calls = 0;
        if let (Some(dlq), false) = (&self.dlq, to_dlq.is_empty()) {
            // Sent to the results queue with the rest; SQS moves it after its last receive, some
            // visibility timeouts later (the receives of controllers that could not delete it, not
            // simulated): nobody announces it there.
            let after = crate::VISIBILITY * crate::MAX_RECEIVES;
            for (job, chunk) in to_dlq.iter().filter_map(|m| chunk_of(&m.body)) {
                let what = if late_dead.contains(&(job.clone(), chunk)) { "late copy" } else { "result" };
                self.fated.world.trace(format!("FATE {job} chunk {chunk}'s {what} is dead-lettered ({}) in {} s", dlq.name(), after.as_secs()));
            }
            calls += (to_dlq.len() as u64).div_ceil(10);
            let (dlq, fated) = (dlq.clone(), self.fated.clone());
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                let world = &fated.world;
                for (job, chunk) in to_dlq.iter().filter_map(|m| chunk_of(&m.body)).filter(|k| !late_dead.contains(k)) {
                    // News only when no copy reached the results queue first; landed, a copy that
                    // reaches it later is a duplicate.
                    fated.first(&job, chunk | 0x0200_0000);
                    if !fated.seen(&job, chunk | 0x1000_0000) {
                        world.sent(&job);
                    }
                    world.dead_lettered(&job);
                }
                // A send that fails (never here: the twin's calls fail only as a fate says) would lose it.
                let _ = dlq.send_messages(&to_dlq).await;
            });
        }
        if !msgs.is_empty() {
            calls += self.inner.send_messages(&msgs).await?;
        }
        if let Some(plan) = forge {
            self.inner.send_messages(&forgeries(&plan, &self.fated.keys)).await?;
        }
        // A stray: a copy of a stray job's chunk 0 result on the next partition, where the job is in
        // no reader's memory. Its reader must forward it, never take the job's lease.
        for m in &msgs {
            let Some((job, 0)) = chunk_of(&m.body) else { continue };
            let Some(plan) = self.fated.jobs.get(&job).filter(|p| p.stray && self.partitions.len() > 1) else { continue };
            // A once-key of its own (it had chunk 0's first-result key, always taken above, so no
            // stray was sent from commit 30f2acf until the fifteenth stop).
            if self.fated.first(&job, 0x0100_0000) {
                let to = &self.partitions[(usize::from(plan.partition) + 1) % self.partitions.len()];
                self.fated.world.trace(format!("HOSTILE a copy of {job} chunk 0's result sent on {} (a stray)", to.name()));
                let _ = to.send_messages(std::slice::from_ref(m)).await;
            }
        }
        // A rogue processor's bomb for a chunk without a record, declaring [`HUGE`] transactions.
        for m in &msgs {
            let Some((job, 0)) = chunk_of(&m.body) else { continue };
            let Some(plan) = self.fated.jobs.get(&job).filter(|p| p.before_records) else { continue };
            if self.fated.first(&job, 0x0080_0000) {
                self.fated.world.trace(format!("HOSTILE a bomb declaring {HUGE} transactions for {job} chunk 0 (no record)"));
                let mut o = signed(bomb(plan, 0, HUGE), &self.fated.keys.processor);
                o.attrs.chunk_token = Some(self.fated.keys.submitter.chunk_token(&job, 0));
                let _ = self.inner.send_messages(std::slice::from_ref(&o)).await;
            }
        }
        if answer_lost {
            return Err(lost("SendMessageBatch"));
        }
        Ok(calls)
    }
}

#[async_trait]
impl Queue for FatedQueue {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn send_messages(&self, msgs: &[Outgoing]) -> Result<u64> {
        match self.role {
            Role::Initiator if msgs.iter().any(|m| work_item(&m.body).is_some()) => self.inner.send_messages(&self.work_items(msgs)).await,
            Role::Initiator => {
                for m in msgs {
                    if let Ok(last @ (ResultMessage::Sealed { .. } | ResultMessage::Abandon { .. })) = serde_json::from_str::<ResultMessage>(&m.body) {
                        let ending = self.fated.jobs.get(last.job_id()).map(|j| j.ending);
                        if matches!(last, ResultMessage::Sealed { .. }) && ending != Some(Ending::Sealed) {
                            // The initiator dies before its seal goes out.
                            std::future::pending::<()>().await;
                        }
                        // News once: a seal or abandon sent again (its answer lost) is a duplicate.
                        let once = if matches!(last, ResultMessage::Sealed { .. }) { 0x0800_0000 } else { 0x0400_0000 };
                        if self.fated.first(last.job_id(), once) {
                            self.fated.world.sent(last.job_id());
                        }
                    }
                }
                self.inner.send_messages(msgs).await
            }
            Role::Processor => self.results(msgs).await,
        }
    }

    async fn receive(&self, max: u32, wait: Duration) -> Result<Vec<Delivery>> {
        let got = self.inner.receive(max, wait).await?;
        let mut receipts = fleet_io::lock(&self.fated.receipts);
        for d in &got {
            if let Some(w) = work_item(&d.body) {
                receipts.insert(d.receipt().to_string(), (w.job_id, w.chunk));
            }
        }
        Ok(got)
    }

    /// A processor's delete of a chunk whose fate is a lost delete: the first one is answered as done
    /// and never happens (the work item comes back after its visibility timeout and is billed again).
    async fn delete_receipts(&self, receipts: &[&Receipt]) -> Result<Vec<usize>> {
        let keep: Vec<usize> = (0..receipts.len())
            .filter(|&i| {
                let chunk = fleet_io::lock(&self.fated.receipts).get(receipts[i].as_str()).cloned();
                !chunk.is_some_and(|(job, c)| self.fated.fate(&job, c).is_some_and(|(_, f)| f == Fate::DeleteLost) && self.fated.first(&job, c))
            })
            .collect();
        let kept: Vec<&Receipt> = keep.iter().map(|&i| receipts[i]).collect();
        let failed = self.inner.delete_receipts(&kept).await?;
        Ok(failed.into_iter().map(|i| keep[i]).collect())
    }

    async fn change_visibility(&self, entries: &[(&str, Duration)]) -> Result<Vec<usize>> {
        self.inner.change_visibility(entries).await
    }

    async fn depth(&self) -> Result<QueueDepth> {
        self.inner.depth().await
    }

    async fn info(&self) -> Result<QueueInfo> {
        self.inner.info().await
    }

    fn calls(&self) -> &CallCounter {
        self.inner.calls()
    }
}

/// The store as the initiator or a processor reaches it (see [`Fated`]).
struct FatedStore {
    fated: Arc<Fated>,
    role: Role,
}

#[async_trait]
impl Hook for FatedStore {
    async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
        let Put { key, body, content_type, meta, cond } = put;
        if self.role == Role::Initiator {
            let died = self.fated.jobs.values().any(|j| j.ending == Ending::DiedBeforeManifest && key == manifest_key(&j.id));
            if died {
                // The initiator dies before its manifest is written.
                std::future::pending::<()>().await;
            }
            if let Some(job) = self.fated.jobs.values().find(|j| j.lying_manifest && key == manifest_key(&j.id)) {
                // A rogue submitter's manifest: one accepted transaction more than its chunks hold.
                let mut m: Manifest = serde_json::from_slice(&body).expect("the initiator's manifest");
                m.accepted += 1;
                self.fated.world.trace(format!("HOSTILE {}'s manifest says {} accepted, one more than its chunks hold", job.id, m.accepted));
                let body = Bytes::from(serde_json::to_vec(&m).expect("serializable"));
                return inner.put_if(key, body, content_type, meta, cond).await;
            }
            let unrecorded = self.fated.chunk_of_key(key).is_some_and(|(j, _)| j.before_records);
            if unrecorded {
                // An initiator of the release before records: the blob alone.
                return inner.put_if(key, body, content_type, &BTreeMap::new(), cond).await;
            }
        }
        inner.put_if(key, body, content_type, meta, cond).await
    }

    /// A processor's read of a chunk blob, a round trip of up to 3 s: first reads in the order
    /// processors handle work items; a failed chunk's blob is corrupt (failed for good at once); a
    /// poison chunk's read is refused every time (its work item is retried to the dead-letter queue).
    async fn get_tagged(&self, inner: &dyn BlobStore, key: &str) -> Result<Option<(Bytes, String)>> {
        // `jobs/{job}/chunks/{chunk}.csv.zst`, read by a processor.
        let chunk = self.fated.chunk_of_key(key).filter(|_| self.role == Role::Processor).map(|(job, c)| (job.clone(), c));
        let Some((job, c)) = chunk else { return inner.get_tagged(key).await };
        let delay = fleet_io::lock(&self.fated.rng).random_range(10..3_000);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        self.fated.world.handling(&job.id, c);
        match job.chunks[c as usize].fate {
            Fate::Failed => Ok(Some((Bytes::from_static(b"not the chunk that was stored"), "corrupt".into()))),
            Fate::Poison => {
                Err(Error::Service { service: Service::S3, operation: "GetObject", detail: "simulated: AccessDenied".into(), retryable: false, source: None })
            }
            _ => inner.get_tagged(key).await,
        }
    }
}

/// What the hostile sender puts on a forging job's partition after its chunk 0's first result:
/// results for chunks the job does not have (with rows that look real), a seal smaller than the job,
/// a count larger than its chunk's with an account of its own, and a result and a seal for a job
/// nobody submitted. None of it may count, and the forged job may leave nothing behind but its
/// quarantined messages.
fn forgeries(job: &JobPlan, keys: &Keys) -> Vec<Outgoing> {
    let real = |chunk: u32, accounts: Vec<AccountTotals>, transactions: u64| ChunkResult {
        v: WIRE_VERSION,
        job_id: job.id.clone(),
        chunk,
        transactions,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts } },
        requests: RequestCounts::default(),
    };
    let body = |m: ResultMessage| serde_json::to_string(&m).expect("serializable");
    let n = job.chunks.len() as u32;
    let rows = job.chunks[0].rows.len() as u64;
    let mut bodies: Vec<String> = [n, n + 2, n + 40].into_iter().map(|c| body(ResultMessage::Chunk(real(c, job.totals(0), rows)))).collect();
    if n > 1 {
        bodies.push(body(ResultMessage::Sealed { v: WIRE_VERSION, job_id: job.id.clone(), total_chunks: 1 }));
    }
    let mut accounts = job.totals(0);
    accounts.push(AccountTotals { account_id: "forged".into(), currency: "EUR".into(), count: 7, gross: Decimal::new(700, 2), fees: Decimal::ZERO });
    let mut more = real(0, accounts, rows + 7);
    bodies.push(body(ResultMessage::Chunk(more.clone())));
    more.job_id = format!("{}{FORGED}", job.id);
    bodies.push(body(ResultMessage::Chunk(more)));
    bodies.push(body(ResultMessage::Sealed { v: WIRE_VERSION, job_id: format!("{}{FORGED}", job.id), total_chunks: 1 }));
    // What a rogue processor signs with its own key passes the role check where a processor may send
    // it (results: the records refute the ones above), and nowhere else: a seal of the right size and
    // an abandon of the job (any results-queue sender knew the job's id).
    let mut out: Vec<Outgoing> = bodies.into_iter().map(|b| signed(b, &keys.processor)).collect();
    // The undersized seal is a rogue submitter's (its own key): only the manifest refutes it.
    for o in &mut out {
        if let Ok(ResultMessage::Sealed { job_id, total_chunks, .. }) = serde_json::from_str::<ResultMessage>(&o.body) {
            if job_id == job.id && total_chunks != n {
                o.attrs.auth = Some(keys.submitter.sign(&o.body));
            }
        }
    }
    // It was handed chunk 0's work item (its forgeries follow that chunk's first result): its
    // forgeries of chunk 0 carry the chunk's token, and the job's records must refute them.
    for o in &mut out {
        if chunk_of(&o.body).is_some_and(|(j, c)| j == job.id && c == 0) {
            o.attrs.chunk_token = Some(keys.submitter.chunk_token(&job.id, 0));
        }
    }
    out.push(signed(body(ResultMessage::Sealed { v: WIRE_VERSION, job_id: job.id.clone(), total_chunks: n }), &keys.processor));
    out.push(signed(body(ResultMessage::Abandon { v: WIRE_VERSION, job_id: job.id.clone(), reason: ROGUE_ABANDON.into() }), &keys.processor));
    // A rogue submitter's result for the job's last chunk, with the chunk's recorded count and an
    // account of its own, ahead of the real one (the records bound its count, never its money), and
    // an unsigned one.
    let last = n - 1;
    let rows = job.chunks[last as usize].rows.len() as u64;
    let mallory =
        vec![AccountTotals { account_id: MALLORY.into(), currency: "EUR".into(), count: rows, gross: Decimal::new(99_999_999_999, 2), fees: Decimal::ZERO }];
    out.push(signed(body(ResultMessage::Chunk(real(last, mallory.clone(), rows))), &keys.submitter));
    out.push(Outgoing::plain(body(ResultMessage::Chunk(real(last, mallory.clone(), rows)))));
    // And the rogue processor's own, signed with its key but without the chunk's token (it was not
    // handed that work item).
    out.push(signed(body(ResultMessage::Chunk(real(last, mallory, rows))), &keys.processor));
    out
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
    bomb(job, chunk, job.chunks[chunk as usize].rows.len() as u64)
}

/// The bomb, declaring `transactions`.
fn bomb(job: &JobPlan, chunk: u32, transactions: u64) -> String {
    static BOMB: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let bomb = BOMB.get_or_init(|| base64_encode(&zstd::bulk::compress(&vec![b'a'; 60 << 20], 3).expect("compressible")));
    let r = ChunkResult {
        v: WIRE_VERSION,
        job_id: job.id.clone(),
        chunk,
        transactions,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::ZstdCsv { data: bomb.clone() } },
        requests: RequestCounts::default(),
    };
    serde_json::to_string(&ResultMessage::Chunk(r)).expect("serializable")
}

/// The oracle's amount and fee for `units` of the currency's smallest unit (cents, yen, fils), in
/// integers and independent of the processor's fee code (`fleet_domain::billing`, ISO 4217 from a
/// crate): the shipped tariff is 0.30 + 2.9% per charge, rounded half away from zero to the
/// currency's unit, and nothing for a refund. Places by hand: yen none, dinars three, the rest two.
fn oracle_amount_and_fee(units: i64, currency: &str) -> (Decimal, Decimal) {
    let places: u32 = match currency {
        "JPY" => 0,
        "BHD" => 3,
        _ => 2,
    };
    let amount = Decimal::new(units, places);
    if units <= 0 {
        return (amount, Decimal::new(0, places));
    }
    // In thousandths of the unit: 0.30 is 300 * 10^places, 2.9% of `units` is 29 * units; then
    // rounded half up (it is positive) to the unit.
    let milli = 300 * 10i64.pow(places) + 29 * units;
    (amount, Decimal::new((milli + 500) / 1000, places))
}

#[cfg(test)]
mod oracle_tests {
    use super::*;

    /// The oracle's fee agrees with the processor's on the shipped tariff, computed apart.
    #[test]
    fn the_oracles_fee_agrees_with_the_tariff_on_every_amount_the_simulation_draws() {
        let calc = fleet_domain::billing::Tariff::default().calculator();
        for cur in ["EUR", "USD", "JPY", "BHD"] {
            for units in -5_000..100_000i64 {
                let units = if units == 0 { 1 } else { units };
                let (amount, fee) = oracle_amount_and_fee(units, cur);
                assert_eq!(fee, calc.fee(amount, cur), "{units} units of {cur}");
                // The amount as a chunk carries it reads back as the same amount.
                let (_, places) = fleet_domain::validate::parse_currency(cur).unwrap();
                assert_eq!(fleet_domain::validate::parse_amount(&amount.to_string(), places, cur).unwrap(), amount, "{amount} {cur}");
            }
        }
        let fee = |u, c| oracle_amount_and_fee(u, c).1.to_string();
        assert_eq!(fee(1_000, "EUR"), "0.59", "10.00: 0.30 + 0.29");
        assert_eq!(fee(50, "EUR"), "0.31", "0.50: 0.30 + 0.0145, rounded to 0.01");
        assert_eq!(fee(-100, "EUR"), "0.00", "a refund is free");
        assert_eq!(fee(1_000, "JPY"), "29", "1000 yen: 0.30 + 29 = 29.30, rounded to whole yen");
        assert_eq!(fee(50, "JPY"), "2", "50 yen: 0.30 + 1.45 = 1.75");
        assert_eq!(fee(12_345, "BHD"), "0.658", "12.345 dinars: 0.30 + 0.358005");
        assert_eq!(fee(-1, "BHD"), "0.000", "a refund is free");
    }
}
