//! `initiator submit`: reads and validates the files, de-duplicates `txn_id`s, splits accepted rows into
//! chunks (by count and by bytes), compresses and stores each chunk on S3 while reading continues,
//! writes the job manifest, sends the work items with SendMessageBatch and publishes a work-detected
//! trigger. With `--strict`, any rejected row refuses the whole submission and nothing is stored.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use shared::billing::Tariff;
use shared::blob::BlobStore;
use shared::codec::{encode_chunk, ChunkWriter, EncodedChunk};
use shared::input::{Counts, InputFile, Validator};
use shared::layout::{chunk_key, manifest_key, new_job_id};
use shared::model::{now_rfc3339, BlobRef, Manifest, Rejected, ResultMessage, WorkItem, WIRE_VERSION};
use shared::queue::{plan_batches, Queue};
use shared::requests::RequestCounts;
use shared::trigger::{TriggerBus, WorkDetected};

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
}

impl SubmitOptions {
    pub fn new(files: Vec<PathBuf>) -> SubmitOptions {
        SubmitOptions { files, chunk_size: 5000, chunk_bytes: 4 << 20, strict: false, tariff: Tariff::default(), upload_concurrency: 16, progress: false }
    }
}

/// The services a submission uses.
#[derive(Clone)]
pub struct Clients {
    pub work: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
    pub store: Arc<dyn BlobStore>,
    pub triggers: Option<Arc<dyn TriggerBus>>,
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

struct StoredChunk {
    number: u32,
    rows: u64,
    blob: BlobRef,
    /// Held back until validation is over (strict mode only).
    held: Option<Bytes>,
}

fn bar(mp: &MultiProgress, len: u64, template: &str) -> ProgressBar {
    let b = mp.add(ProgressBar::new(len));
    b.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    b
}

pub async fn submit(opts: SubmitOptions, clients: &Clients) -> Result<Submitted, CliError> {
    if opts.files.is_empty() {
        return Err(CliError::Input("no input files".into()));
    }
    if opts.chunk_size == 0 {
        return Err(CliError::Input("--chunk-size must be at least 1".into()));
    }
    // Every header is checked before any row is read or anything is stored.
    let files = opts.files.iter().map(|p| InputFile::open(p)).collect::<Result<Vec<_>, _>>().map_err(|e| CliError::Input(e.to_string()))?;
    let job_id = new_job_id();
    let mp = MultiProgress::with_draw_target(if opts.progress { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
    let read_bar = bar(&mp, files.iter().map(|f| f.bytes).sum(), "reading   [{bar:30}] {bytes}/{total_bytes} {msg}");
    let store_bar = bar(&mp, 0, "storing   {pos} chunks {msg}");

    // Reading and validation run on a blocking thread and hand finished chunks over a small channel;
    // compression and uploads overlap with reading.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(u32, ChunkWriter)>(8);
    let (chunk_size, chunk_bytes) = (opts.chunk_size, opts.chunk_bytes);
    let rb = read_bar.clone();
    let reader = tokio::task::spawn_blocking(move || {
        let mut v = Validator::new();
        let mut rejected = Vec::new();
        let mut cur = ChunkWriter::new();
        let mut next = 0u32;
        let closed = AtomicBool::new(false);
        let mut done_bytes = 0;
        let ship = |w: ChunkWriter, next: &mut u32| {
            if !closed.load(Ordering::Relaxed) && tx.blocking_send((*next, w)).is_err() {
                closed.store(true, Ordering::Relaxed);
            }
            *next += 1;
        };
        for f in &files {
            v.read(
                f,
                |t| {
                    cur.push(&t);
                    if cur.rows() >= chunk_size || cur.approx_bytes() >= chunk_bytes {
                        ship(std::mem::take(&mut cur), &mut next);
                    }
                },
                |r| rejected.push(r),
                |b| rb.set_position(done_bytes + b),
            )?;
            done_bytes += f.bytes;
        }
        if cur.rows() > 0 {
            ship(cur, &mut next);
        }
        Ok::<_, shared::input::InputError>((v.counts, rejected))
    });

    let (strict, store) = (opts.strict, clients.store.clone());
    let sb = store_bar.clone();
    let job = job_id.clone();
    let uploads = futures::stream::poll_fn(|cx| rx.poll_recv(cx))
        .map(|(number, w)| {
            let (store, job, sb) = (store.clone(), job.clone(), sb.clone());
            async move {
                let enc: EncodedChunk = tokio::task::spawn_blocking(move || encode_chunk(w)).await.map_err(|e| CliError::Input(format!("compression task failed: {e}")))?;
                let blob = BlobRef { key: chunk_key(&job, number), sha256: enc.sha256, compressed_bytes: enc.bytes.len() as u64, raw_bytes: enc.raw_bytes };
                let bytes = Bytes::from(enc.bytes);
                let held = if strict {
                    Some(bytes)
                } else {
                    store.put(&blob.key, bytes, "application/zstd").await?;
                    None
                };
                sb.inc(1);
                Ok::<_, CliError>(StoredChunk { number, rows: enc.rows, blob, held })
            }
        })
        .buffer_unordered(opts.upload_concurrency.max(1))
        .try_collect::<Vec<_>>();
    let (read, stored) = tokio::join!(reader, uploads);
    let (counts, rejected) = read.map_err(|e| CliError::Input(format!("reading task failed: {e}")))?.map_err(|e| CliError::Input(e.to_string()))?;
    let mut chunks = stored?;
    chunks.sort_by_key(|c| c.number);
    read_bar.finish_with_message(format!("{} rows: {} accepted, {} rejected", counts.submitted, counts.accepted, counts.rejected));

    if opts.strict && !rejected.is_empty() {
        let mut msg = format!("--strict: {} of {} rows rejected; nothing was enqueued. First ones:", rejected.len(), counts.submitted);
        for r in rejected.iter().take(10) {
            msg.push_str(&format!("\n  {}:{}: {}", r.file, r.line, r.reason));
        }
        return Err(CliError::Input(msg));
    }
    if opts.strict {
        futures::stream::iter(chunks.iter_mut())
            .map(|c| {
                let store = store.clone();
                async move {
                    if let Some(b) = c.held.take() {
                        store.put(&c.blob.key, b, "application/zstd").await?;
                    }
                    Ok::<_, CliError>(())
                }
            })
            .buffer_unordered(opts.upload_concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
    }
    store_bar.finish_with_message("stored");

    let total_chunks = chunks.len() as u32;
    let bodies: Vec<String> = chunks
        .iter()
        .map(|c| {
            serde_json::to_string(&WorkItem {
                v: WIRE_VERSION,
                job_id: job_id.clone(),
                chunk: c.number,
                total_chunks,
                transactions: c.rows,
                blob: c.blob.clone(),
                tariff: opts.tariff.clone(),
            })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| CliError::Input(e.to_string()))?;
    let empty_job = (total_chunks == 0)
        .then(|| serde_json::to_string(&ResultMessage::EmptyJob { v: WIRE_VERSION, job_id: job_id.clone() }))
        .transpose()
        .map_err(|e| CliError::Input(e.to_string()))?;

    // The manifest goes first so the controller can always finish the job; it carries this process's
    // calls so far plus the ones that follow it (the manifest write and the sends).
    let mut requests = clients.store.calls().snapshot();
    requests.merge(&clients.work.calls().snapshot());
    requests.add("s3.PutObject", 1);
    let sizes: Vec<usize> = bodies.iter().map(String::len).collect();
    let send_calls: u64 = sizes.chunks(10).map(|c| plan_batches(c).len() as u64).sum();
    requests.add("sqs.SendMessageBatch", send_calls + u64::from(empty_job.is_some()));
    let manifest = Manifest {
        v: WIRE_VERSION,
        job_id: job_id.clone(),
        created_at: now_rfc3339(),
        files: opts.files.iter().map(|p| p.display().to_string()).collect(),
        submitted: counts.submitted,
        accepted: counts.accepted,
        rejected: rejected.clone(),
        total_chunks,
        chunk_transactions: chunks.iter().map(|c| c.rows).collect(),
        tariff: opts.tariff.clone(),
        requests: requests.clone(),
    };
    let manifest_bytes = serde_json::to_vec(&manifest).map_err(|e| CliError::Input(e.to_string()))?;
    clients.store.put(&manifest_key(&job_id), Bytes::from(manifest_bytes), "application/json").await?;

    let send_bar = bar(&mp, bodies.len() as u64, "enqueuing [{bar:30}] {pos}/{len} work items");
    let work = clients.work.clone();
    let made: Vec<u64> = futures::stream::iter(bodies.chunks(10))
        .map(|batch| {
            let (work, sb) = (work.clone(), send_bar.clone());
            async move {
                let n = work.send(batch).await?;
                sb.inc(batch.len() as u64);
                Ok::<_, CliError>(n)
            }
        })
        .buffer_unordered(8)
        .try_collect()
        .await?;
    if let Some(body) = empty_job {
        clients.results.send(&[body]).await?;
    }
    send_bar.finish();
    let made: u64 = made.iter().sum();
    if made != send_calls {
        tracing::warn!(planned = send_calls, made, "some work items needed resending; the report counts the planned calls");
    }
    if let Some(t) = &clients.triggers {
        let ev = WorkDetected { queue: clients.work.name().to_string(), messages: u64::from(total_chunks), source: "initiator".into() };
        if let Err(e) = t.publish(&ev).await {
            tracing::warn!(error = %e, "could not publish the work-detected trigger; processors will find the work by polling");
        }
    }
    Ok(Submitted { job_id, total_chunks, counts, rejected, requests })
}
