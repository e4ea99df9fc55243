//! A job in memory and the items applied to it: parsing a message into an item (a chunk result, a
//! seal, an abandon, a dead-lettered work item), fetching and decoding a result's payload before the
//! job is locked, and applying an item to the job exactly once (a chunk already accounted for is a
//! duplicate however often it arrives). `Pending` holds the deliveries applied but not yet covered by a
//! checkpoint.

use super::*;
use fleet_io::queue::Message;

pub(super) enum Item {
    Result(ResultMessage),
    /// `reason`: set when a listener dead-lettered it itself (e.g. `expired`).
    Dead {
        item: WorkItem,
        receives: u32,
        reason: Option<String>,
    },
}

impl Job {
    /// Sealed, with every chunk accounted for (processed or failed).
    pub(super) fn all_in(&self) -> bool {
        self.cp.total_chunks == Some(self.cp.accounted.len() as u32)
    }
}

impl Item {
    pub(super) fn job_id(&self) -> &str {
        match self {
            Item::Result(r) => r.job_id(),
            Item::Dead { item, .. } => &item.job_id,
        }
    }
}

pub(super) struct Job {
    pub(super) cp: Checkpoint,
    pub(super) totals: CheckedTotals,
    /// Accounts whose rows changed since the last checkpoint (large jobs write only these).
    pub(super) changed: HashSet<String>,
    /// Applied in memory, not yet covered by a checkpoint: deleted after the next one.
    pub(super) pending: Pending,
    /// When it was last checkpointed (or loaded).
    pub(super) saved: Instant,
    /// Last message of this job (or when it was resumed, less its checkpoint's age).
    pub(super) last_activity: Instant,
    /// Its `open/{job}` marker is known to exist.
    pub(super) marked_open: bool,
    /// Set by an `Abandon` message: finish now, with this reason.
    pub(super) abandon: Option<String>,
    /// Set when a sealed job stalled (see `scan`): finish now, its missing chunks failed for this reason.
    pub(super) stalled: Option<String>,
    /// This controller's lease on the job.
    pub(super) lease: Held,
    /// ETag of the checkpoint as last read or written (`None`: there is none yet): checkpoints are
    /// written only if it still matches (fencing).
    pub(super) cp_etag: Option<String>,
    /// The aggregator's clock (a checkpoint's `updated_at`).
    pub(super) clock: Clock,
    /// The highest chunk number seen to exist (its chunk blob), before the seal (see `verify_chunks`).
    pub(super) verified: Option<u32>,
}

/// Deliveries applied in memory and waiting for a checkpoint, counted for the whole aggregator (also
/// when a job is dropped with them: they come back after their visibility timeout).
pub(super) struct Pending {
    list: Vec<(Source, Kept)>,
    count: Arc<AtomicUsize>,
}

impl Pending {
    pub(super) fn new(count: Arc<AtomicUsize>) -> Pending {
        Pending { list: Vec::new(), count }
    }

    pub(super) fn extend(&mut self, kept: Vec<(Source, Kept)>) {
        self.count.fetch_add(kept.len(), Ordering::Relaxed);
        self.list.extend(kept);
    }

    /// The messages, for their completion.
    pub(super) fn take(&mut self) -> Vec<Kept> {
        self.take_all().into_iter().map(|(_, k)| k).collect()
    }

    /// The messages with the queue each came from (to apply them again).
    pub(super) fn take_all(&mut self) -> Vec<(Source, Kept)> {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
        std::mem::take(&mut self.list)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Kept> {
        self.list.iter().map(|(_, k)| k)
    }

    pub(super) fn len(&self) -> usize {
        self.list.len()
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.count.fetch_sub(self.list.len(), Ordering::Relaxed);
    }
}

pub(super) fn parse(source: Source, m: &Message) -> Result<Item> {
    let item = match source {
        Source::Results | Source::ResultsDeadLetter => Item::Result(serde_json::from_str(&m.body)?),
        Source::WorkDeadLetter => Item::Dead { item: serde_json::from_str(&m.body)?, receives: m.receive_count, reason: m.attrs.reason.clone() },
    };
    check_job_id(item.job_id()).map_err(Error::corrupt)?;
    Ok(item)
}

/// An item with its result payload fetched and decoded before its job is locked (`None`: it carries
/// no payload).
pub(super) struct Ready {
    pub(super) item: Item,
    pub(super) accounts: Option<Result<Vec<AccountTotals>>>,
    /// GetObject calls made for it.
    pub(super) gets: u64,
}

impl Ready {
    /// The chunk it is about (a result or a dead-lettered work item).
    pub(super) fn chunk(&self) -> Option<u32> {
        match &self.item {
            Item::Result(ResultMessage::Chunk(c)) => Some(c.chunk),
            Item::Dead { item, .. } => Some(item.chunk),
            Item::Result(_) => None,
        }
    }

    pub(super) fn is_seal(&self) -> bool {
        matches!(self.item, Item::Result(ResultMessage::Sealed { .. }))
    }
}

pub(super) async fn prepare(mut item: Item, store: &dyn BlobStore, offload: bool) -> Ready {
    if let Item::Result(ResultMessage::Chunk(ChunkResult { job_id, chunk, transactions, outcome: Outcome::Processed { payload }, .. })) = &mut item {
        let payload = std::mem::replace(payload, AccountsPayload::Inline { accounts: Vec::new() });
        let gets = u64::from(matches!(payload, AccountsPayload::Blob { .. }));
        // What the payload may decompress to follows from the rows it declares (one account row per
        // transaction at most) but never exceeds what a chunk's account rows can be (a message cannot
        // raise it by what it declares), and its blob is the one its job and chunk name: a hostile
        // result can neither make the controller inflate a gigabyte nor point it at another job's
        // objects.
        let cap = accounts_cap(*transactions, MAX_RESULT_BYTES);
        let accounts = Some(match &payload {
            AccountsPayload::Blob { blob } if blob.key != result_key(job_id, *chunk) => {
                Err(Error::corrupt(format!("result blob key {:?} is not the key of job {job_id} chunk {chunk}", blob.key)))
            }
            _ => decode_payload(payload, store, cap, offload).await,
        });
        return Ready { item, accounts, gets };
    }
    Ready { item, accounts: None, gets: 0 }
}

pub(super) fn apply_item(job: &mut Job, ready: Ready, ctl: &mut RequestCounts) -> Result<()> {
    ctl.add("s3.GetObject", ready.gets);
    let Ready { item, accounts, .. } = ready;
    let cp = &mut job.cp;
    let (chunk, transactions) = match &item {
        Item::Result(ResultMessage::Sealed { total_chunks, .. }) => {
            let total = *total_chunks;
            match cp.total_chunks {
                Some(t) if t != total => tracing::error!(job = %cp.job_id, total, sealed_before = t, "conflicting seal ignored"),
                _ => {
                    if let Some(c) = cp.accounted.iter().find(|&&c| c >= total) {
                        tracing::error!(job = %cp.job_id, chunk = c, total, "a counted chunk lies beyond the sealed size");
                    }
                    cp.total_chunks = Some(total);
                }
            }
            return Ok(());
        }
        Item::Result(ResultMessage::Abandon { reason, .. }) => {
            tracing::warn!(job = %cp.job_id, %reason, accounted = cp.accounted.len(), "job abandoned on request");
            job.abandon = Some(reason.clone());
            return Ok(());
        }
        Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions),
        Item::Dead { item, .. } => (item.chunk, item.transactions),
    };
    if cp.total_chunks.is_some_and(|t| chunk >= t) {
        // Not from this job as we know it: drop it loudly rather than corrupt the totals.
        tracing::error!(job = %cp.job_id, chunk, total = ?cp.total_chunks, "chunk beyond the job's size; ignored");
        return Ok(());
    }
    if cp.accounted.contains(&chunk) {
        let real = matches!(&item, Item::Result(ResultMessage::Chunk(ChunkResult { outcome: Outcome::Processed { .. }, .. })));
        match cp.failed_chunks.iter().position(|f| f.chunk == chunk) {
            // A real result beats a dead letter or a failure report (a work item dead-lettered after
            // it was billed, a processor that died between sending a result and deleting its item):
            // the chunk is counted from it instead, as the job is not finished yet.
            Some(i) if real => {
                let failed = cp.failed_chunks.remove(i);
                cp.accounted.remove(&chunk);
                tracing::warn!(job = %cp.job_id, chunk, was = %failed.reason, "a chunk recorded as failed has its real result: counted from it");
            }
            failed => {
                // The processor's own failure report says more than the dead letter: keep its reason.
                if let (Some(i), Item::Result(ResultMessage::Chunk(ChunkResult { outcome: Outcome::Failed { reason }, .. }))) = (failed, &item) {
                    if cp.failed_chunks[i].reason == DEAD_LETTER_REASON {
                        cp.failed_chunks[i].reason = reason.clone();
                    }
                }
                tracing::debug!(job = %cp.job_id, chunk, "duplicate; already counted");
                return Ok(());
            }
        }
    }
    match item {
        Item::Result(ResultMessage::Chunk(c)) => {
            match c.outcome {
                Outcome::Processed { .. } => match accounts.expect("prepared with its payload") {
                    Ok(accounts) => match checked_count(&accounts) {
                        Some(counted) if counted == c.transactions => match job.totals.try_add_all(accounts.iter()) {
                            Ok(()) => {
                                cp.processed_transactions = cp.processed_transactions.saturating_add(counted);
                                // Until a job has parts its next part is a base with every row: nothing to track.
                                if !cp.parts.is_empty() {
                                    job.changed.extend(accounts.into_iter().map(|a| a.account_id));
                                }
                            }
                            Err(e) => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: format!("result not added: {e}") }),
                        },
                        counted => cp.failed_chunks.push(FailedChunk {
                            chunk,
                            transactions,
                            reason: match counted {
                                Some(n) => format!("result counts {n} transactions, the chunk has {}", c.transactions),
                                None => "result counts more transactions than a count can hold".to_string(),
                            },
                        }),
                    },
                    // S3 unreachable: leave the message; it comes back.
                    Err(e) if e.is_retryable() => return Err(e),
                    // Missing or corrupt payload: it never becomes readable; the chunk failed.
                    Err(e) => {
                        tracing::error!(job = %cp.job_id, chunk, error = %e, "result payload unreadable; chunk recorded as failed");
                        cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: format!("result unreadable: {e}") })
                    }
                },
                Outcome::Failed { reason } => cp.failed_chunks.push(FailedChunk { chunk, transactions, reason }),
            }
            cp.requests.merge(&c.requests);
        }
        Item::Dead { receives, reason, .. } => {
            tracing::warn!(job = %cp.job_id, chunk, receives, ?reason, "work item dead-lettered; chunk recorded as failed");
            cp.failed_chunks.push(FailedChunk { chunk, transactions, reason: reason.unwrap_or_else(|| DEAD_LETTER_REASON.to_string()) });
        }
        Item::Result(ResultMessage::Sealed { .. } | ResultMessage::Abandon { .. }) => {}
    }
    cp.accounted.insert(chunk);
    Ok(())
}

/// The accounts of a result's payload, decompressed to at most `cap` bytes. Decompression runs on
/// the blocking pool (`offload`; the simulation decodes in place, on its one thread), at most
/// [`DECODES`] at once: a batch of large results neither stalls the async workers nor holds more
/// than that many inflated payloads.
pub(super) async fn decode_payload(payload: AccountsPayload, store: &dyn BlobStore, cap: u64, offload: bool) -> Result<Vec<AccountTotals>> {
    let (data, cap) = match payload {
        AccountsPayload::Inline { accounts } => return Ok(accounts),
        AccountsPayload::ZstdCsv { data } => (Bytes::from(base64_decode(&data).map_err(Error::corrupt)?), cap),
        AccountsPayload::Blob { blob } => {
            // Compressed, a payload is never larger than it may inflate to (plus zstd's framing).
            let data = store
                .get_capped(&blob.key, cap.saturating_add(1024))
                .await?
                .ok_or_else(|| Error::NotFound { service: fleet_io::error::Service::S3, what: format!("result blob {} does not exist", blob.key) })?;
            if sha256_hex(&data) != blob.sha256 {
                return Err(Error::Corrupt(format!("result blob {} checksum mismatch", blob.key)));
            }
            (data, blob.raw_bytes.min(cap))
        }
    };
    static DECODES_AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(DECODES);
    let _permit = DECODES_AT_ONCE.acquire().await.map_err(|_| Error::Corrupt("decoder closed".into()))?;
    if !offload {
        return accounts_from_zstd_csv(&data, cap).map_err(Error::corrupt);
    }
    match tokio::task::spawn_blocking(move || accounts_from_zstd_csv(&data, cap)).await {
        Ok(r) => r.map_err(Error::corrupt),
        Err(e) => Err(Error::Corrupt(format!("result payload decoder failed: {e}"))),
    }
}

/// The sum of the rows' counts, unless it does not fit.
pub(super) fn checked_count(accounts: &[AccountTotals]) -> Option<u64> {
    accounts.iter().try_fold(0u64, |n, a| n.checked_add(a.count))
}
