//! What a message brings to a job, before the job is locked: parsing a message into an item (a
//! chunk result, a seal, an abandon, a dead-lettered work item; the types are the core's,
//! `controller_core::item`), checking its sender's role, and fetching and decoding a result's payload
//! within its chunk's recorded figures (see `records`) and the decoders' limit.

use bytes::Bytes;
use fleet_domain::billing::{AccountTotals, RowBatch};
use fleet_domain::codec::{accounts_from_csv_rows, base64_decode, decompress_capped, sha256_hex};
use fleet_domain::layout::{check_job_id, result_key};
use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, ResultMessage};
use fleet_io::auth::{Keyring, Role};
use fleet_io::blob::BlobStore;
use fleet_io::error::{Error, Result};
use fleet_io::queue::Message;

pub use controller_core::item::Source;
pub(super) use controller_core::item::{Item, Unread};

use super::limits::{Figures, DECODES};

/// An item ready to apply, its payload's error the store's.
pub(super) type Ready = controller_core::item::Ready<Error>;

/// The roles that may send `item` read from `source` (see `fleet_io::auth`): a result or failure
/// report a processor's; a seal a submitter's; an abandon a submitter's or an operator's; a dead letter
/// forwarded to its partition a controller's; a work item in the work dead-letter queue its
/// submitter's (SQS and the listeners keep its signature as they move it).
pub(super) fn may_send(source: Source, item: &Item) -> &'static [Role] {
    match (source, item) {
        (Source::WorkDeadLetter, _) => &[Role::Submitter],
        (_, Item::Dead { .. }) | (_, Item::Result(ResultMessage::DeadLettered { .. })) => &[Role::Controller],
        (_, Item::Result(ResultMessage::Chunk(_))) => &[Role::Processor],
        (_, Item::Result(ResultMessage::Sealed { .. })) => &[Role::Submitter],
        (_, Item::Result(ResultMessage::Abandon { .. })) => &[Role::Submitter, Role::Operator],
    }
}

/// Whether `m` (parsed as `item`) counts: signed by a key of `keyring` whose role may send it. The
/// reason when not (never the signature itself).
pub(super) fn authorize(keyring: &Keyring, source: Source, m: &Message, item: &Item) -> std::result::Result<Role, String> {
    let allowed = may_send(source, item);
    let kind = match item {
        Item::Result(ResultMessage::Chunk(_)) => "a result",
        Item::Result(ResultMessage::Sealed { .. }) => "a seal",
        Item::Result(ResultMessage::Abandon { .. }) => "an abandon",
        Item::Dead { .. } | Item::Result(ResultMessage::DeadLettered { .. }) => "a dead letter",
    };
    let names = || allowed.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(" or ");
    match keyring.verify(&m.body, m.attrs.auth.as_deref()) {
        // A result also carries its chunk's token, which only its work item brought: a processor
        // reports only chunks it was handed.
        Ok(role) if allowed.contains(&role) => match item {
            Item::Result(ResultMessage::Chunk(_)) if crate::undo::is(crate::undo::Fix::ChunkTokenChecked) => Ok(role),
            Item::Result(ResultMessage::Chunk(c)) => match keyring.verify_chunk_token(&c.job_id, c.chunk, m.attrs.chunk_token.as_deref()) {
                Ok(()) => Ok(role),
                Err(e) => Err(format!("{kind} of job {} chunk {} does not count: {e}", c.job_id, c.chunk)),
            },
            _ => Ok(role),
        },
        Ok(role) => Err(format!("{kind} of job {} signed by a {role}, which may not send one (only a {})", item.job_id(), names())),
        Err(e) => Err(format!("{kind} of job {} does not count: {e}; only a {} may send one", item.job_id(), names())),
    }
}

pub(super) fn parse(source: Source, m: &Message) -> Result<Item> {
    let item = match source {
        Source::Results | Source::ResultsDeadLetter => match serde_json::from_str(&m.body)? {
            // A dead-lettered work item forwarded to its job's partition (see `crate::forward`).
            ResultMessage::DeadLettered { item, receives, reason, .. } => Item::Dead { item, receives, reason },
            r => Item::Result(r),
        },
        Source::WorkDeadLetter => Item::Dead { item: serde_json::from_str(&m.body)?, receives: m.receive_count, reason: m.attrs.reason.clone() },
    };
    check_job_id(item.job_id()).map_err(Error::corrupt)?;
    Ok(item)
}

/// Fetches and decodes a result's payload, within `figures`: its chunk's recorded figures (see
/// `records`), which it has been checked against.
pub(super) async fn prepare(mut item: Item, figures: Option<Figures>, store: &dyn BlobStore, offload: bool) -> Ready {
    if let Item::Result(ResultMessage::Chunk(ChunkResult { job_id, chunk, transactions, outcome: ChunkOutcome::Processed { payload }, .. })) = &mut item {
        let payload = std::mem::replace(payload, AccountsPayload::Inline { accounts: Vec::new() });
        // What the payload may decompress and decode to follows from its chunk's record (one account
        // row per transaction at most, no longer than the chunk's rows and their figures), never from
        // what the message declares, and its blob is the one its job and chunk name: a hostile result
        // can neither make the controller inflate a gigabyte nor point it at another job's objects.
        let figures = figures.unwrap_or(Figures { transactions: *transactions, raw_bytes: None });
        let accounts = Some(
            match &payload {
                AccountsPayload::Blob { blob } if blob.key != result_key(job_id, *chunk) => {
                    Err(Error::corrupt(format!("result blob key {:?} is not the key of job {job_id} chunk {chunk}", blob.key)))
                }
                AccountsPayload::Inline { accounts } if accounts.len() as u64 > figures.max_rows() => {
                    Err(Error::corrupt(format!("result has {} account rows; its chunk has {} transactions", accounts.len(), figures.transactions)))
                }
                _ => decode_payload(payload, store, figures, offload).await,
            }
            .map_err(|error| Unread { retryable: error.is_retryable(), error }),
        );
        return Ready { item, accounts };
    }
    Ready { item, accounts: None }
}

/// The accounts of a result's payload, decompressed to at most `cap` bytes. Decompression runs on
/// the blocking pool (`offload`; the simulation decodes in place, on its one thread), at most
/// [`DECODES`] at once: a batch of large results neither stalls the async workers nor holds more
/// than that many inflated payloads.
async fn decode_payload(payload: AccountsPayload, store: &dyn BlobStore, figures: Figures, offload: bool) -> Result<RowBatch> {
    let (cap, rows) =
        if crate::undo::is(crate::undo::Fix::DecodeCapFromRecord) { (super::MAX_RESULT_BYTES, u64::MAX) } else { (figures.max_bytes(), figures.max_rows()) };
    let (data, cap) = match payload {
        AccountsPayload::Inline { accounts } => return Ok(accounts.iter().map(AccountTotals::borrowed).collect()),
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
    // (A decode in place holds its thread until it ends: the permit bounds the blocking pool's. The
    // simulation's seeds, one runtime per thread, share no permit, so that none waits on another's.)
    let _permit = match offload {
        true => Some(DECODES_AT_ONCE.acquire().await.map_err(|_| Error::Corrupt("decoder closed".into()))?),
        false => None,
    };
    // What the budget reserved for this decode (see `apply_group`): what it holds must fit in it.
    let share = figures.max_memory();
    let decode = move || -> fleet_domain::Result<RowBatch> {
        let raw = decompress_capped(&data, cap)?;
        // Measured, not assumed (the simulation holds every decode to its share).
        tracing::debug!(target: MEMORY_TARGET, held = raw.capacity() as u64, share, "result payload inflated");
        accounts_from_csv_rows(&raw, rows)
    };
    if !offload {
        return decode().map_err(Error::corrupt);
    }
    match tokio::task::spawn_blocking(decode).await {
        Ok(r) => r.map_err(Error::corrupt),
        Err(e) => Err(Error::Corrupt(format!("result payload decoder failed: {e}"))),
    }
}

/// The target of the events that measure memory (a payload inflated: the bytes it holds, and the
/// share of the decode budget reserved for it).
pub const MEMORY_TARGET: &str = "fleet::memory";
