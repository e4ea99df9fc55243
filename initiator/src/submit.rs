//! Why: reading, validating, chunking, storing and enqueuing overlap (a chunk is on SQS before the file
//! is read to the end), so they live in one pipeline here with the chunk size they share; the commands
//! around it (`commands.rs`) only parse flags and print.
//!
//! `initiator submit`: reads and validates the files, de-duplicates `txn_id`s, splits accepted rows into
//! chunks (by count and by bytes) and, while reading goes on, compresses and stores each chunk on S3 and
//! sends its work item (SendMessageBatch, up to ten at a time; a work-detected trigger after the first).
//! At the end it writes the job manifest and sends the job's `Sealed` message to the results queue.
//! With `--strict`, any rejected row refuses the whole submission and nothing is stored or enqueued.
//! On a FIFO work queue every work item carries a message group (see [`crate::grouping`]) and work
//! items are sent in chunk order, one batch at a time, so that each group's order is the file order.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use fleet_domain::billing::Tariff;
use fleet_domain::codec::{encode_chunk, ChunkWriter, EncodedChunk};
use fleet_domain::input::{Counts, InputFile, Validator};
use fleet_domain::layout::{chunk_key, manifest_key, new_job_id};
use fleet_domain::model::{now_rfc3339, BlobRef, ChunkRecord, Manifest, Rejected, ResultMessage, WorkItem, WIRE_VERSION};
use fleet_domain::requests::{Billed, Op, RequestCounts};
use fleet_io::auth::Key;
use fleet_io::blob::BlobStore;
use fleet_io::queue::{Attrs, Outgoing, Queue};
use fleet_io::trigger::{announce_on, TriggerBus};
use futures::stream::BoxStream;
use futures::{Future, Stream, StreamExt, TryStreamExt};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::grouping::Grouping;
use crate::interrupt::{Phase, Submission};
use crate::CliError;

/// Submission options.
#[derive(Debug, Clone)]
pub struct SubmitOptions {
    pub files: Vec<PathBuf>,
    /// Most transactions in one chunk.
    pub chunk_size: u64,
    /// Most raw (uncompressed) bytes in one chunk.
    pub chunk_bytes: usize,
    pub strict: bool,
    pub tariff: Tariff,
    /// Concurrent chunk uploads.
    pub upload_concurrency: usize,
    /// Draw progress bars on stderr.
    pub progress: bool,
    /// Processing priority of the job's work items (higher first where listeners are throttled).
    pub priority: i32,
    /// The job's deadline: work items still waiting in a listener's buffer after it (and past the
    /// buffer TTL) go to the dead-letter queue with reason `expired` instead of back to the queue.
    pub deadline: Option<std::time::SystemTime>,
    /// Partitions and message groups (`--group-by account` needs a FIFO work queue).
    pub grouping: Grouping,
    /// What `-` among the files (standard input) is called, and its size if known.
    pub stdin: Stdin,
    /// The job's id, when the caller chose it (the fleet simulation, whose seed fixes every id);
    /// otherwise a new UUIDv7, as the CLI always takes.
    pub job_id: Option<String>,
    /// How far the submission has gone, shared with the caller (a clone): the CLI reads it when a
    /// Ctrl-C drops the submission, to abandon a job whose seal's send had not begun and to leave one
    /// whose seal's send had begun to finish on its own (see [`crate::interrupt`]).
    pub submission: Submission,
    /// The finished job whose failed chunks this one bills again (`initiator retry`), named in the
    /// manifest and so in the report.
    pub completes: Option<String>,
}

/// Standard input as an input file (`-`): the name its rows are reported under, and its size when
/// known (the progress bar's total and the job's chunk size are taken from it).
#[derive(Debug, Clone)]
pub struct Stdin {
    pub name: String,
    pub size: Option<u64>,
}

impl Default for Stdin {
    fn default() -> Self {
        Stdin { name: "stdin".into(), size: None }
    }
}

impl SubmitOptions {
    pub fn new(files: Vec<PathBuf>) -> SubmitOptions {
        SubmitOptions {
            files,
            chunk_size: 5000,
            chunk_bytes: 4 << 20,
            strict: false,
            tariff: Tariff::default(),
            upload_concurrency: 16,
            progress: false,
            priority: 0,
            deadline: None,
            grouping: Grouping::None,
            stdin: Stdin::default(),
            job_id: None,
            submission: Submission::default(),
            completes: None,
        }
    }
}

/// The services a submission uses.
#[derive(Clone)]
pub struct Clients {
    pub work: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
    pub store: Arc<dyn BlobStore>,
    pub triggers: Option<Arc<dyn TriggerBus>>,
    /// The submitter's role key (`--signing-key`): its work items, its seal and an abandon of its own
    /// submission are signed with it, so that a controller with a keyring counts them (a work item
    /// keeps its signature to the dead-letter queue, where the controller reads it); `None`: unsigned.
    pub signing_key: Option<Key>,
}

impl Clients {
    /// The signature of a message body it sends ([`fleet_io::auth::ATTRIBUTE`]), when it has a key.
    pub fn sign(&self, body: &str) -> Option<String> {
        self.signing_key.as_ref().map(|k| k.sign(body))
    }
}

/// What a submission did.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub job_id: String,
    pub total_chunks: u32,
    pub counts: Counts,
    pub rejected: Vec<Rejected>,
    /// SQS and S3 calls made for the job by the initiator.
    pub requests: RequestCounts,
}

/// A compressed chunk, before and after it is stored.
struct Chunk {
    number: u32,
    /// The grouping partition its transactions belong to.
    partition: usize,
    rows: u64,
    blob: BlobRef,
    /// The input lines its rows lie within (for its job's manifest).
    lines: Vec<fleet_domain::model::Lines>,
    /// The bytes, until stored.
    bytes: Option<Bytes>,
}

async fn encode(number: u32, partition: usize, w: ChunkWriter, job_id: &str, bar: &ProgressBar) -> Result<Chunk, CliError> {
    let lines = w.lines().to_vec();
    let enc: EncodedChunk = fleet_io::blocking(move || encode_chunk(w)).await.map_err(|e| CliError::Input(format!("compression task failed: {e}")))?;
    bar.inc(1);
    let blob = BlobRef { key: chunk_key(job_id, number), sha256: enc.sha256, compressed_bytes: enc.bytes.len() as u64, raw_bytes: enc.raw_bytes };
    Ok(Chunk { number, partition, rows: enc.rows, blob, lines, bytes: Some(Bytes::from(enc.bytes)) })
}

/// Stores a chunk's blob with its record (its transactions and size, in the blob's metadata): the
/// job's own word on the chunk, which the controller checks every result for it against, and the
/// results partition its messages travel on (a copy read from another partition is a stray).
/// Created only if absent, as the manifest is (the submitter's policy allows no other write of a
/// chunk): the rows a processor bills are never replaced once written. A write that finds the blob
/// is ours when it holds these very bytes (an earlier attempt whose answer was lost, or a rerun of
/// the same input under the same `--job-id`).
async fn put(mut c: Chunk, store: &Arc<dyn BlobStore>, results_partition: u16, job_id: &str) -> Result<Chunk, CliError> {
    if let Some(b) = c.bytes.take() {
        let record = ChunkRecord { transactions: c.rows, raw_bytes: c.blob.raw_bytes, partition: Some(results_partition) };
        let written =
            fleet_io::blob::put_if_owned(store.as_ref(), &c.blob.key, b, "application/zstd", &record.to_meta(), &fleet_io::blob::Cond::Absent).await?;
        if written.is_none() {
            return Err(CliError::Input(format!("chunk {} of job {job_id} already exists with other rows: a chunk is written once", c.number)));
        }
    }
    Ok(c)
}

/// Stores the job's tariff before its first work item (`jobs/{job}/tariff.json`, created only if
/// absent): should the submission never write its manifest (Ctrl-C, a crash), what its rows were
/// billed with is still known to the controller that takes out its rows another job billed first.
/// Its metadata says what was submitted and when ([`fleet_domain::model::Submission`], for
/// `initiator jobs`).
async fn put_tariff(store: &Arc<dyn BlobStore>, job_id: &str, tariff: &fleet_domain::billing::Tariff, names: &[String]) -> Result<(), CliError> {
    let body = Bytes::from(serde_json::to_vec(tariff).map_err(|e| CliError::Input(e.to_string()))?);
    let key = fleet_domain::layout::tariff_key(job_id);
    let meta = fleet_domain::model::Submission::new(names, now_rfc3339()).to_meta();
    if fleet_io::blob::put_if_owned(store.as_ref(), &key, body, "application/json", &meta, &fleet_io::blob::Cond::Absent).await?.is_none() {
        return Err(CliError::Input(format!("job {job_id} already has a tariff that is not this submission's: a job is submitted once")));
    }
    Ok(())
}

type ReadOutcome = (Counts, Vec<Rejected>);

fn read_result(r: Result<Result<ReadOutcome, fleet_domain::input::InputError>, tokio::task::JoinError>) -> Result<ReadOutcome, CliError> {
    r.map_err(|e| CliError::Input(format!("reading task failed: {e}")))?.map_err(|e| CliError::Input(e.to_string()))
}

/// Runs a stream of futures `n` at a time; in input order when `ordered`.
fn run_all<'a, F>(s: impl Stream<Item = F> + Send + 'a, n: usize, ordered: bool) -> BoxStream<'a, F::Output>
where
    F: Future + Send + 'a,
    F::Output: Send + 'a,
{
    if ordered {
        s.buffered(n).boxed()
    } else {
        s.buffer_unordered(n).boxed()
    }
}

/// Sends work items for stored chunks in SendMessageBatch calls of up to ten, and publishes one
/// work-detected trigger after the first call so that parked listeners wake at once. On a FIFO queue
/// the batches go one at a time, in chunk order (each group's order on the queue is the send order).
struct Enqueue<'a> {
    clients: &'a Clients,
    job_id: &'a str,
    tariff: &'a Tariff,
    attrs: Attrs,
    /// Message groups, on a FIFO queue.
    groups: Option<Grouping>,
    bar: ProgressBar,
    trigger: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Work items whose send was attempted, and those acknowledged.
    attempted: AtomicU64,
    sent: AtomicU64,
    /// The results partition the job's messages travel on (carried by its work items, recorded in its
    /// manifest, its seal sent there).
    partition: u16,
}

impl<'a> Enqueue<'a> {
    fn new(clients: &'a Clients, job_id: &'a str, tariff: &'a Tariff, attrs: Attrs, groups: Option<Grouping>, bar: ProgressBar) -> Self {
        let partition = fleet_domain::layout::partition_of(job_id, fleet_io::queue::partitions(&clients.results).len() as u16);
        Enqueue {
            clients,
            job_id,
            tariff,
            attrs,
            groups,
            bar,
            trigger: std::sync::Mutex::new(None),
            attempted: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            partition,
        }
    }

    async fn run(&self, stored: impl Stream<Item = Result<Chunk, CliError>> + Send) -> Result<Vec<Chunk>, CliError> {
        let ordered = self.groups.is_some();
        let batches = stored.chunks(10).map(|batch| self.send(batch));
        let sent: Vec<Vec<Chunk>> = run_all(batches, if ordered { 1 } else { 4 }, ordered).try_collect().await?;
        done(&self.bar);
        Ok(sent.into_iter().flatten().collect())
    }

    async fn send(&self, batch: Vec<Result<Chunk, CliError>>) -> Result<Vec<Chunk>, CliError> {
        let batch = batch.into_iter().collect::<Result<Vec<_>, _>>()?;
        // A PRODUCER span per SendMessageBatch call, a child of the submission's: its context goes with
        // each of its work items (their processors' spans are its children).
        let span = tracing::info_span!("send_work", otel.kind = "producer", job_id = %self.job_id, messages = batch.len());
        let queue = self.clients.work.name();
        fleet_io::telemetry::Messaging { operation: fleet_io::telemetry::Operation::Send, destination: queue, message_id: None, batch: Some(batch.len()) }
            .set(&span);
        let trace = fleet_io::telemetry::traceparent(&span).or_else(|| self.attrs.trace.clone());
        let bodies = batch
            .iter()
            .map(|c| {
                serde_json::to_string(&WorkItem {
                    v: WIRE_VERSION,
                    job_id: self.job_id.to_string(),
                    chunk: c.number,
                    transactions: c.rows,
                    blob: c.blob.clone(),
                    tariff: self.tariff.clone(),
                    partition: self.partition,
                })
                .map(|body| {
                    let group = self.groups.map(|g| g.group_id(self.job_id, c.number, c.partition));
                    // Signed as the submitter's: a work item the controller finds dead-lettered counts
                    // only with its submitter's signature (kept by every re-send and redrive).
                    let auth = self.clients.sign(&body);
                    // The chunk's token: only the processor handed this work item can report the chunk.
                    let chunk_token = self.clients.signing_key.as_ref().map(|k| k.chunk_token(self.job_id, c.number));
                    Outgoing { body, attrs: Attrs { group, trace: trace.clone(), auth, chunk_token, ..self.attrs.clone() }, dedup: None }
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| CliError::Input(e.to_string()))?;
        self.attempted.fetch_add(bodies.len() as u64, Ordering::SeqCst);
        if let Err(e) = tracing::Instrument::instrument(self.clients.work.send_messages(&bodies), span.clone()).await {
            fleet_io::telemetry::fail(&span, &e);
            return Err(e.into());
        }
        self.sent.fetch_add(bodies.len() as u64, Ordering::SeqCst);
        self.bar.inc(bodies.len() as u64);
        let mut trigger = self.trigger.lock().unwrap_or_else(|e| e.into_inner());
        if trigger.is_none() {
            if let Some(t) = self.clients.triggers.clone() {
                // One per shard of the work queue (items spread over all of them).
                let (work, n) = (self.clients.work.clone(), bodies.len() as u64);
                *trigger = Some(tokio::spawn(async move { announce_on(t.as_ref(), work.as_ref(), n, "initiator").await }));
            }
        }
        Ok(batch)
    }

    /// Waits for the trigger publication (bounded by [`announce`]).
    async fn finish(&self) {
        let handle = self.trigger.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.await;
        }
    }
}

/// Finishes an open-ended counter where it stands (`finish` would jump to its length, 0).
fn done(b: &ProgressBar) {
    b.set_length(b.position());
    b.finish();
}

fn bar(mp: &MultiProgress, len: u64, template: &str) -> ProgressBar {
    let b = mp.add(ProgressBar::new(len));
    b.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    b
}

/// What a submission can check without the stack, before it contacts anything: the files (each
/// opened, its header checked), an explicit chunk size, and `--group-by` against the work queue's kind
/// (known from its name).
pub fn preflight(files: &[PathBuf], stdin: &Stdin, chunk_size: Option<u64>, grouping: Grouping, work_queue: &str) -> Result<Vec<InputFile>, CliError> {
    if files.is_empty() {
        return Err(CliError::Input("no input files".into()));
    }
    if chunk_size == Some(0) {
        return Err(CliError::Input("--chunk-size must be at least 1".into()));
    }
    if matches!(grouping, Grouping::Account { .. }) && !fleet_io::config::is_fifo(work_queue) {
        return Err(CliError::Input(format!(
            "--group-by account needs a FIFO work queue (a name ending in .fifo, e.g. --work-queue billing-work.fifo); {work_queue} is a standard queue, which keeps no order"
        )));
    }
    open_inputs(files, stdin)
}

/// Opens every input, `-` as standard input (given once at most), and checks each header.
pub fn open_inputs(files: &[PathBuf], stdin: &Stdin) -> Result<Vec<InputFile>, CliError> {
    if files.iter().filter(|p| p.as_os_str() == "-").count() > 1 {
        return Err(CliError::Input("- (standard input) can be given once".into()));
    }
    let input = |e: fleet_domain::input::InputError| CliError::Input(e.to_string());
    files
        .iter()
        .map(|p| match p.as_os_str() == "-" {
            true => InputFile::from_stream(stdin.name.clone(), Box::new(std::io::stdin()), stdin.size.or_else(stdin_file_size)).map_err(input),
            false => InputFile::open(p).map_err(input),
        })
        .collect()
}

/// The size of standard input when it is a regular file (`initiator submit - < day.csv`).
fn stdin_file_size() -> Option<u64> {
    use std::os::fd::AsFd as _;
    let fd = std::io::stdin().as_fd().try_clone_to_owned().ok()?;
    let meta = std::fs::File::from(fd).metadata().ok()?;
    meta.is_file().then_some(meta.len())
}

/// Chunks a job is cut into when `--chunk-size` is not given: enough for several processor
/// instances to share a job, few enough that each request carries thousands of transactions.
pub const AUTO_CHUNKS: u64 = 16;
/// Bounds of the chunk size chosen for a job (transactions).
pub const AUTO_CHUNK_MIN: u64 = 5_000;
pub const AUTO_CHUNK_MAX: u64 = 50_000;

/// The chunk size for a job of these files when none is given: about [`AUTO_CHUNKS`] chunks, within
/// [`AUTO_CHUNK_MIN`]..=[`AUTO_CHUNK_MAX`] transactions. The row count is estimated from the files'
/// sizes and the length of their first rows (their first 64 KiB), so nothing is read twice; a stream
/// of unknown size counts as large (the largest chunks).
/// Measured on a 1M job (docs/performance.md, "Where the time goes"): chunks of 5,000 took 3.5x the
/// one-process time and 0.9 requests per 1,000 transactions; chunks of 50,000, 1.7x and 0.13.
pub fn auto_chunk_size(files: &[InputFile]) -> u64 {
    let rows = files.iter().try_fold(0u64, |sum, f| f.estimated_rows().map(|r| sum.saturating_add(r)));
    rows.map_or(AUTO_CHUNK_MAX, |rows| rows.div_ceil(AUTO_CHUNKS).clamp(AUTO_CHUNK_MIN, AUTO_CHUNK_MAX))
}

/// Submits `opts.files` as one job: [`preflight`], then [`submit_inputs`].
pub async fn submit(opts: SubmitOptions, clients: &Clients) -> Result<Submitted, CliError> {
    let files = preflight(&opts.files, &opts.stdin, Some(opts.chunk_size), opts.grouping, clients.work.name())?;
    submit_inputs(opts, files, clients).await
}

/// Submits inputs [`preflight`] opened (every header checked before any row is read or anything is
/// stored) as one job.
pub async fn submit_inputs(opts: SubmitOptions, files: Vec<InputFile>, clients: &Clients) -> Result<Submitted, CliError> {
    let fifo = fleet_io::config::is_fifo(clients.work.name());
    let grouping = opts.grouping;
    let names: Vec<String> = files.iter().map(|f| f.name.clone()).collect();
    let job_id = match &opts.job_id {
        Some(id) => {
            fleet_domain::layout::check_job_id(id).map_err(|e| CliError::Input(e.to_string()))?;
            id.clone()
        }
        None => new_job_id(),
    };
    let started = std::time::Instant::now();
    let mp = MultiProgress::with_draw_target(if opts.progress { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    let read_bar = bar(&mp, files.iter().map(|f| f.bytes).sum(), "reading   [{bar:30}] {bytes}/{total_bytes} {msg}");
    let store_bar = bar(&mp, 0, "chunks    {pos} compressed");

    // Reading and validation run on a blocking thread and hand finished chunks over a small channel;
    // compression and uploads overlap with reading. On a current-thread runtime (the fleet
    // simulation's, a test's) there is no thread to spare: the files are read first, in place, and
    // their chunks handed over in order, so that such a run does the same things every time.
    let (chunk_size, chunk_bytes) = (opts.chunk_size, opts.chunk_bytes);
    let rb = read_bar.clone();
    let read = move |ship: &mut dyn FnMut(u32, usize, ChunkWriter) -> bool| read_chunks(&files, grouping, chunk_size, chunk_bytes, &rb, ship);
    let (rx, reader) = if fleet_io::multi_thread() {
        let (tx, rx) = tokio::sync::mpsc::channel::<(u32, usize, ChunkWriter)>(8);
        (rx, tokio::task::spawn_blocking(move || read(&mut |n, p, w| tx.blocking_send((n, p, w)).is_ok())))
    } else {
        let mut shipped = Vec::new();
        let r = read(&mut |n, p, w| {
            shipped.push((n, p, w));
            true
        });
        let (tx, rx) = tokio::sync::mpsc::channel::<(u32, usize, ChunkWriter)>(shipped.len().max(1));
        for c in shipped {
            let _ = tx.try_send(c);
        }
        (rx, tokio::spawn(async move { r }))
    };

    // The job's trace starts here (exported when OTEL_EXPORTER_OTLP_ENDPOINT is set): every work item
    // carries its context, so the processors' and the controller's spans join it.
    let span = tracing::info_span!("submit", job_id = %job_id, files = opts.files.len());
    let attrs = Attrs {
        priority: opts.priority,
        deadline_ms: opts.deadline.and_then(|d| d.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_millis() as u64),
        trace: fleet_io::telemetry::traceparent(&span),
        ..Default::default()
    };
    let enqueue = Enqueue::new(clients, &job_id, &opts.tariff, attrs, fifo.then_some(grouping), bar(&mp, 0, "enqueued  {pos} work items"));
    let outcome =
        tracing::Instrument::instrument(submit_enqueued(&opts, names, clients, &job_id, &enqueue, reader, rx, store_bar, read_bar, started, fifo), span).await;
    match outcome {
        Ok(s) => Ok(s),
        Err(cause) if enqueue.attempted.load(Ordering::SeqCst) == 0 => Err(cause),
        // The seal's send began: it may have reached the queue (an answer lost, a timeout after SQS
        // took it), and an abandon would end a whole job. Left to finish, or to the controller's
        // abandon time if the seal never arrived.
        Err(cause) if opts.submission.phase() != crate::interrupt::Phase::Submitting => {
            let fate = format!(
                "its seal was being sent, so it was not abandoned: follow it with `initiator wait {job_id}`; if the seal never arrived, the controller abandons it after --abandon-after"
            );
            Err(CliError::Enqueued { job_id: job_id.clone(), enqueued: enqueue.sent.load(Ordering::SeqCst), fate, cause: Box::new(cause) })
        }
        Err(cause) => {
            // Work items are out: the job must not wait an abandon time for a seal that never comes.
            let reason = format!("the submission failed: {cause}");
            let fate = match crate::ops::abandon(&clients.results, clients.triggers.as_deref(), &job_id, &reason, None, clients.signing_key.as_ref()).await {
                Ok(()) => format!("so it was abandoned: the controller finishes it as `abandoned` with what was billed (`initiator report {job_id}`)"),
                Err(e) => format!("and abandoning it failed too ({e}): run `initiator abandon {job_id}`, or the controller abandons it after --abandon-after"),
            };
            Err(CliError::Enqueued { job_id: job_id.clone(), enqueued: enqueue.sent.load(Ordering::SeqCst), fate, cause: Box::new(cause) })
        }
    }
}

/// Reads and validates `files`, handing each chunk over as it fills up (`ship`; numbered in the order
/// they fill up, one writer per grouping partition), and the rest at the end. Once `ship` refuses one
/// (the submission ended early), the rest are only read.
fn read_chunks(
    files: &[InputFile],
    grouping: Grouping,
    chunk_size: u64,
    chunk_bytes: usize,
    bar: &ProgressBar,
    ship: &mut dyn FnMut(u32, usize, ChunkWriter) -> bool,
) -> Result<(Counts, Vec<Rejected>), fleet_domain::input::InputError> {
    let mut v = Validator::new();
    let mut rejected = Vec::new();
    let mut cur: Vec<ChunkWriter> = (0..grouping.partitions()).map(|_| ChunkWriter::new()).collect();
    let mut next = 0u32;
    let closed = Cell::new(false);
    let mut done_bytes = 0;
    let mut ship = |w: ChunkWriter, partition: usize, next: &mut u32| {
        if !closed.get() && !ship(*next, partition, w) {
            closed.set(true);
        }
        *next += 1;
    };
    for (file, f) in files.iter().enumerate() {
        v.read_lines(
            f,
            |t, line| {
                let p = grouping.partition(t.account_id);
                let w = &mut cur[p];
                w.push_from(t, file as u32, line);
                if w.rows() >= chunk_size || w.approx_bytes() >= chunk_bytes {
                    ship(std::mem::take(w), p, &mut next);
                }
            },
            |r| rejected.push(r),
            |b| bar.set_position(done_bytes + b),
        )?;
        done_bytes += f.bytes;
    }
    for (p, w) in cur.into_iter().enumerate() {
        if w.rows() > 0 {
            ship(w, p, &mut next);
        }
    }
    Ok((v.counts, rejected))
}

/// The rest of a submission once work items may go out: store and enqueue the chunks while reading,
/// then the manifest and the seal.
#[allow(clippy::too_many_arguments)]
async fn submit_enqueued(
    opts: &SubmitOptions,
    names: Vec<String>,
    clients: &Clients,
    job_id: &str,
    enqueue: &Enqueue<'_>,
    reader: tokio::task::JoinHandle<Result<(Counts, Vec<Rejected>), fleet_domain::input::InputError>>,
    mut rx: tokio::sync::mpsc::Receiver<(u32, usize, ChunkWriter)>,
    store_bar: ProgressBar,
    read_bar: ProgressBar,
    started: std::time::Instant,
    fifo: bool,
) -> Result<Submitted, CliError> {
    let store = clients.store.clone();
    let n = opts.upload_concurrency.max(1);
    let job_id = job_id.to_string();
    // The stream owns the receiver: when a failure ends the stream early, the channel closes and the
    // reader stops handing over chunks instead of blocking on a full channel.
    let chunks = futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(|(number, p, w)| encode(number, p, w, &job_id, &store_bar));
    let encoded = run_all(chunks, n, fifo);
    let (read, sent) = if opts.strict {
        // Nothing may be stored or enqueued before every row has been validated.
        let (read, held) = tokio::join!(reader, encoded.try_collect::<Vec<_>>());
        let read = read_result(read)?;
        if !read.1.is_empty() {
            let mut msg = format!("--strict: {} of {} rows rejected; nothing was enqueued. First ones:", read.1.len(), read.0.submitted);
            for r in read.1.iter().take(10) {
                msg.push_str(&format!("\n  {}:{}: {}", r.file, r.line, r.reason));
            }
            return Err(CliError::Input(msg));
        }
        let held = held?;
        put_tariff(&store, &job_id, &opts.tariff, &names).await?;
        let stored = run_all(futures::stream::iter(held).map(|c| put(c, &store, enqueue.partition, &job_id)), n, fifo);
        (Ok(read), enqueue.run(stored).await)
    } else {
        // Chunks are stored and their work items sent while reading goes on, so processing starts at once.
        put_tariff(&store, &job_id, &opts.tariff, &names).await?;
        let stored = run_all(encoded.map(|r| async { put(r?, &store, enqueue.partition, &job_id).await }), n, fifo);
        let (read, sent) = tokio::join!(reader, enqueue.run(stored));
        (read_result(read), sent)
    };
    let (counts, rejected) = read?;
    let mut chunks = sent?;
    chunks.sort_by_key(|c| c.number);
    read_bar.finish_with_message(format!("{} rows: {} accepted, {} rejected", counts.submitted, counts.accepted, counts.rejected));
    done(&store_bar);
    tracing::info!(job = %job_id, rows = counts.submitted, chunks = chunks.len(), elapsed_ms = started.elapsed().as_millis() as u64, "read, stored and enqueued");

    // The manifest, then the seal: the controller finishes a job only once it is sealed, and reads the
    // manifest then. The manifest carries this process's calls: all made so far, plus these two.
    let total_chunks = chunks.len() as u32;
    let mut requests = clients.store.calls().snapshot();
    requests.merge(&clients.work.calls().snapshot());
    requests.merge(&clients.results.calls().snapshot());
    requests.add(Billed::call(Op::S3PutObject), 1);
    requests.add(Billed::call(Op::SqsSendMessageBatch), 1);
    let manifest = Manifest {
        chunk_lines: chunks.iter().map(|c| c.lines.clone()).collect(),
        completes: opts.completes.clone(),
        v: WIRE_VERSION,
        job_id: job_id.clone(),
        created_at: now_rfc3339(),
        files: names,
        submitted: counts.submitted,
        accepted: counts.accepted,
        rejected: rejected.clone(),
        total_chunks,
        chunk_transactions: chunks.iter().map(|c| c.rows).collect(),
        tariff: opts.tariff.clone(),
        requests: requests.clone(),
        partition: enqueue.partition,
    };
    let manifest_bytes = serde_json::to_vec(&manifest).map_err(|e| CliError::Input(e.to_string()))?;
    // Created only if absent (the submitter's policy allows no other write of a manifest): a job's
    // manifest, the authority its results are judged by, is never replaced. A write that finds one
    // is ours when it holds these very bytes (an earlier attempt whose answer was lost).
    let manifest_bytes = Bytes::from(manifest_bytes);
    let key = manifest_key(&job_id);
    if clients.store.put_if(&key, manifest_bytes.clone(), "application/json", &Default::default(), &fleet_io::blob::Cond::Absent).await?.is_none()
        && clients.store.get(&key).await?.as_ref() != Some(&manifest_bytes)
    {
        return Err(CliError::Input(format!("job {job_id} already has a manifest that is not this submission's: a job's manifest is written once")));
    }
    let seal =
        serde_json::to_string(&ResultMessage::Sealed { v: WIRE_VERSION, job_id: job_id.clone(), total_chunks }).map_err(|e| CliError::Input(e.to_string()))?;
    let results = fleet_io::queue::partition(&clients.results, enqueue.partition)?;
    // The job is whole from the moment its seal's send begins, not when it is answered: a send cut off
    // by a Ctrl-C may still have reached the queue, and an `Abandon` after it would end a job that
    // finishes on its own. So the phase moves before the call starts.
    opts.submission.enter(Phase::Sealing);
    // Signed as the submitter's: the controller counts a seal only from a submitter.
    let seal = Outgoing { attrs: Attrs { auth: clients.sign(&seal), ..Attrs::default() }, body: seal, dedup: None };
    results.send_messages(std::slice::from_ref(&seal)).await?;
    opts.submission.enter(Phase::Sealed);
    enqueue.finish().await;
    // The seal may be the last message the controller gets for this job (or the only one, for a job
    // with no chunks): wake it if it is parked.
    if let Some(t) = &clients.triggers {
        announce_on(t.as_ref(), results.as_ref(), 1, "initiator").await;
    }
    Ok(Submitted { job_id, total_chunks, counts, rejected, requests })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csv(dir: &std::path::Path, name: &str, rows: usize) -> PathBuf {
        let mut body = String::from("txn_id,account_id,amount,currency,timestamp\n");
        for i in 0..rows {
            body.push_str(&format!("t{i:07},A{:04},{}.25,EUR,2026-01-01T00:00:00Z\n", i % 1000, i % 90 + 1));
        }
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    }

    fn open(paths: &[PathBuf]) -> Vec<InputFile> {
        open_inputs(paths, &Stdin::default()).unwrap()
    }

    #[test]
    fn the_chunk_size_follows_the_jobs_size_within_its_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let small = csv(dir.path(), "small.csv", 2_000);
        assert_eq!(auto_chunk_size(&open(std::slice::from_ref(&small))), AUTO_CHUNK_MIN);
        // 240,000 rows in two files: about 15,000 a chunk (the estimate within a few percent).
        let (a, b) = (csv(dir.path(), "a.csv", 120_000), csv(dir.path(), "b.csv", 120_000));
        let n = auto_chunk_size(&open(&[a.clone(), b.clone()]));
        assert!((14_500..=15_500).contains(&n), "{n}");
        // 1,200,000 rows: the upper bound.
        let big: Vec<PathBuf> = (0..10).map(|_| a.clone()).collect();
        assert_eq!(auto_chunk_size(&open(&big)), AUTO_CHUNK_MAX);
        // A stream is estimated as a file is when its size is given, as large when not.
        let bytes = std::fs::read(&b).unwrap();
        let stream = |size| InputFile::from_stream("stdin".into(), Box::new(std::io::Cursor::new(bytes.clone())), size).unwrap();
        let mut files = open(std::slice::from_ref(&a));
        files.push(stream(Some(bytes.len() as u64)));
        assert_eq!(auto_chunk_size(&files), n);
        assert_eq!(auto_chunk_size(&[stream(None)]), AUTO_CHUNK_MAX);
    }

    #[tokio::test]
    async fn a_jobs_manifest_is_written_once_never_replaced() {
        // Issue 58: a job's manifest is the authority its results are judged by. A submission under
        // the id of a job that already has one (someone else's) is refused and leaves it unchanged,
        // and no seal goes out.
        use fleet_io::memory::{MemoryQueue, MemoryStore};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = csv(dir.path(), "day.csv", 20);
        let store = MemoryStore::new();
        store.put(&manifest_key("taken"), Bytes::from_static(b"{\"theirs\":1}"), "application/json").await.unwrap();
        let results = MemoryQueue::new("results", Duration::from_secs(30));
        let clients = Clients {
            work: MemoryQueue::new("work", Duration::from_secs(30)),
            results: results.clone(),
            store: store.clone(),
            triggers: None,
            signing_key: None,
        };
        let opts = SubmitOptions { chunk_size: 10, job_id: Some("taken".into()), ..SubmitOptions::new(vec![path.clone()]) };
        let err = submit_inputs(opts, open(std::slice::from_ref(&path)), &clients).await.map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("already has a manifest"), "{err}");
        assert_eq!(store.get(&manifest_key("taken")).await.unwrap().as_deref(), Some(&b"{\"theirs\":1}"[..]), "left unchanged");
        assert!(results.receive(10, Duration::ZERO).await.unwrap().iter().all(|m| !m.body.contains(r#""kind":"sealed""#)), "no seal");
    }

    #[tokio::test]
    async fn a_chunk_is_written_once_never_replaced() {
        // Issue 58: a chunk's rows are what its processor bills. A submission under a job id whose
        // chunk already holds other rows is refused and leaves that chunk unchanged.
        use fleet_io::memory::{MemoryQueue, MemoryStore};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = csv(dir.path(), "day.csv", 20);
        let store = MemoryStore::new();
        store.put(&chunk_key("theirs", 1), Bytes::from_static(b"their rows"), "application/zstd").await.unwrap();
        let clients = Clients {
            work: MemoryQueue::new("work", Duration::from_secs(30)),
            results: MemoryQueue::new("results", Duration::from_secs(30)),
            store: store.clone(),
            triggers: None,
            signing_key: None,
        };
        let opts = |id: &str| SubmitOptions { chunk_size: 10, job_id: Some(id.into()), ..SubmitOptions::new(vec![path.clone()]) };
        let err = submit_inputs(opts("theirs"), open(std::slice::from_ref(&path)), &clients).await.map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("chunk 1 of job theirs already exists"), "{err}");
        assert_eq!(store.get(&chunk_key("theirs", 1)).await.unwrap().as_deref(), Some(&b"their rows"[..]), "left unchanged");
        // The same input again under the same id: its chunks hold these very bytes and pass (a write
        // whose answer was lost is retried the same way); what stops it is the manifest, written once.
        assert_eq!(submit_inputs(opts("mine"), open(std::slice::from_ref(&path)), &clients).await.unwrap().total_chunks, 2);
        let err = submit_inputs(opts("mine"), open(std::slice::from_ref(&path)), &clients).await.map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("already has a manifest") && !err.to_string().contains("chunk"), "{err}");
    }

    /// A submission with a submitter's key: every work item (on both shards of a sharded work queue)
    /// and the seal verify as the submitter's; without a key, none is signed.
    #[tokio::test]
    async fn a_submitters_key_signs_its_work_items_and_its_seal() {
        use fleet_io::auth::{Keyring, Refused, Role};
        use fleet_io::memory::{MemoryQueue, MemoryStore};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = csv(dir.path(), "day.csv", 45);
        let key = Key::generate(Role::Submitter);
        let ring = Keyring::new([key.clone(), Key::generate(Role::Processor)]);
        for signing_key in [Some(key.clone()), None] {
            let shards = [MemoryQueue::new("work", Duration::from_secs(30)), MemoryQueue::new("work-1", Duration::from_secs(30))];
            let work = fleet_io::queue::Sharded::of(shards.iter().map(|q| q.clone() as Arc<dyn Queue>).collect()).unwrap();
            let results = MemoryQueue::new("results", Duration::from_secs(30));
            let clients = Clients { work, results: results.clone(), store: MemoryStore::new(), triggers: None, signing_key: signing_key.clone() };
            let opts = SubmitOptions { chunk_size: 10, ..SubmitOptions::new(vec![path.clone()]) };
            let s = submit_inputs(opts, open(std::slice::from_ref(&path)), &clients).await.unwrap();
            assert_eq!(s.total_chunks, 5);
            let mut items = Vec::new();
            for q in &shards {
                items.extend(q.receive(10, Duration::ZERO).await.unwrap());
            }
            let seals = results.receive(10, Duration::ZERO).await.unwrap();
            assert_eq!((items.len(), seals.len()), (5, 1));
            assert!(seals[0].body.contains(r#""kind":"sealed""#), "{}", seals[0].body);
            for m in items.iter().chain(&seals) {
                let verified = ring.verify(&m.body, m.attrs.auth.as_deref());
                match signing_key {
                    Some(_) => assert_eq!(verified, Ok(Role::Submitter), "{}", m.body),
                    None => assert_eq!((m.attrs.auth.as_deref(), verified), (None, Err(Refused::Unsigned)), "{}", m.body),
                }
            }
        }
    }

    #[test]
    fn standard_input_is_given_once_at_most() {
        let dash = PathBuf::from("-");
        let e = open_inputs(&[dash.clone(), dash], &Stdin::default()).err().unwrap();
        assert_eq!(e.to_string(), "- (standard input) can be given once");
    }
}
