//! Handling one work item: parse it, fetch the chunk blob (claim check), verify checksum and sizes,
//! decompress under the size cap, validate every row again, bill, and package the per-account totals
//! for the results queue (inline, compressed inline, or as a blob when large).

use bytes::Bytes;
use fleet_domain::billing::Totals;
use fleet_domain::codec::{accounts_to_zstd_csv, base64_encode, decode_chunk, sha256_hex, MAX_ACCOUNT_ROW_BYTES};
use fleet_domain::layout::result_key;
use fleet_domain::model::{AccountsPayload, BlobRef, ChunkOutcome, ChunkResult, WorkItem, WIRE_VERSION};
use fleet_domain::requests::RequestCounts;
use fleet_io::blob::BlobStore;
use fleet_io::error::{Error, Result};

/// Results with up to this many (account, currency) rows travel as plain JSON inside the message.
pub const INLINE_ROWS: usize = 100;
/// Compressed results up to this size (base64) travel inside the message; larger ones as a blob.
pub const COMPRESSED_INLINE_LIMIT: usize = 160 * 1024;

pub use fleet_domain::model::parse_work_item;

/// Processes one work item. Returns the chunk result, and with it (or its error) the requests made for
/// it: the S3 calls, every attempt, as the store's own counter saw them ([`fleet_io::call::counted`]).
pub async fn process(item: &WorkItem, store: &dyn BlobStore, max_chunk_bytes: u64) -> (Result<ChunkResult>, RequestCounts) {
    let (r, requests) = fleet_io::call::counted(bill(item, store, max_chunk_bytes)).await;
    (r.map(|r| ChunkResult { requests: requests.clone(), ..r }), requests)
}

async fn bill(item: &WorkItem, store: &dyn BlobStore, max_chunk_bytes: u64) -> Result<ChunkResult> {
    let data = store.get(&item.blob.key).await?.ok_or_else(|| Error::Corrupt(format!("chunk blob {} does not exist", item.blob.key)))?;
    let (blob, rows, tariff) = (item.blob.clone(), item.transactions, item.tariff.clone());
    let (accounts, packed, n_rows) = fleet_io::blocking(move || {
        let fees = tariff.calculator();
        let mut totals = Totals::new();
        decode_chunk(&data, &blob, rows, max_chunk_bytes, |t| totals.add_txn(t, &fees)).map_err(Error::corrupt)?;
        // Many rows are packed straight from the totals; a few travel inline.
        let n = totals.len();
        Ok::<_, Error>(if n > INLINE_ROWS { (Vec::new(), Some(accounts_to_zstd_csv(totals.sorted_rows().iter())), n) } else { (totals.rows(), None, n) })
    })
    .await
    .map_err(|e| Error::Corrupt(format!("billing task failed: {e}")))??;

    let payload = match packed {
        None => AccountsPayload::Inline { accounts },
        Some(z) if z.len() / 3 * 4 <= COMPRESSED_INLINE_LIMIT => AccountsPayload::ZstdCsv { data: base64_encode(&z) },
        Some(z) => {
            let blob = BlobRef {
                key: result_key(&item.job_id, item.chunk),
                sha256: sha256_hex(&z),
                compressed_bytes: z.len() as u64,
                // A cap for the reader: the longest row the validator's limits allow, per row.
                raw_bytes: n_rows as u64 * MAX_ACCOUNT_ROW_BYTES,
            };
            store.put(&blob.key, Bytes::from(z), "application/zstd").await?;
            AccountsPayload::Blob { blob }
        }
    };
    Ok(ChunkResult {
        v: WIRE_VERSION,
        job_id: item.job_id.clone(),
        chunk: item.chunk,
        transactions: item.transactions,
        outcome: ChunkOutcome::Processed { payload },
        requests: RequestCounts::default(),
    })
}

/// The result sent for a work item that failed for good, with the requests made for it.
pub fn failed_result(item: &WorkItem, reason: String, requests: RequestCounts) -> ChunkResult {
    ChunkResult {
        v: WIRE_VERSION,
        job_id: item.job_id.clone(),
        chunk: item.chunk,
        transactions: item.transactions,
        outcome: ChunkOutcome::Failed { reason },
        requests,
    }
}
