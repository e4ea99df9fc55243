//! The chunk codec: accepted transactions as CSV, zstd-compressed, with a SHA-256 of the stored bytes;
//! decoding verifies the checksum and size, refuses to expand past a hard cap (no zstd bombs) and
//! validates every row again, because whatever arrives through the queue is untrusted.

use std::io::Read;

use base64::Engine;
use sha2::{Digest, Sha256};

use crate::billing::{RowBatch, RowRef};
use crate::error::{Error, Result};
use crate::model::BlobRef;
use crate::transaction::Transaction;
use crate::validate::{validate_row, SeenIds, REQUIRED_COLUMNS};

/// zstd level for chunks: the fastest level; transaction CSV still shrinks about 4x.
pub const CHUNK_ZSTD_LEVEL: i32 = 1;

/// Accumulates transactions as CSV lines for one chunk.
pub struct ChunkWriter {
    w: csv::Writer<Vec<u8>>,
    rows: u64,
    /// The input lines its rows lie within, per file (see [`ChunkWriter::push_from`]).
    lines: Vec<crate::model::Lines>,
}

impl Default for ChunkWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkWriter {
    pub fn new() -> Self {
        let mut w = csv::WriterBuilder::new().terminator(csv::Terminator::Any(b'\n')).from_writer(Vec::with_capacity(1 << 20));
        // Writing to a Vec cannot fail.
        let _ = w.write_record(REQUIRED_COLUMNS);
        ChunkWriter { w, rows: 0, lines: Vec::new() }
    }

    /// [`ChunkWriter::push`] of a row read from line `line` of input file `file` (by index).
    pub fn push_from(&mut self, t: &Transaction<'_>, file: u32, line: u64) {
        self.push(t);
        match self.lines.last_mut() {
            Some(l) if l.file == file => l.last = line,
            _ => self.lines.push(crate::model::Lines { file, first: line, last: line }),
        }
    }

    /// The input lines its rows lie within, per file (empty unless pushed with [`ChunkWriter::push_from`]).
    pub fn lines(&self) -> &[crate::model::Lines] {
        &self.lines
    }

    pub fn push(&mut self, t: &Transaction<'_>) {
        let _ = self.w.write_record([t.txn_id, t.account_id, t.amount_text, t.currency_str(), t.timestamp]);
        self.rows += 1;
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes written so far (approximate until flushed; good enough for size bounds).
    pub fn approx_bytes(&self) -> usize {
        self.w.get_ref().len()
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.w.into_inner().unwrap_or_default()
    }
}

/// A compressed chunk ready to store.
pub struct EncodedChunk {
    pub bytes: Vec<u8>,
    pub sha256: String,
    pub raw_bytes: u64,
    pub rows: u64,
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// Compresses a finished chunk.
pub fn encode_chunk(w: ChunkWriter) -> EncodedChunk {
    let rows = w.rows();
    let raw = w.into_bytes();
    let bytes = zstd::bulk::compress(&raw, CHUNK_ZSTD_LEVEL).expect("zstd compression of an in-memory buffer");
    EncodedChunk { sha256: sha256_hex(&bytes), raw_bytes: raw.len() as u64, bytes, rows }
}

/// Decompresses at most `cap` bytes; more than that is treated as corruption (a decompression bomb).
pub fn decompress_capped(data: &[u8], cap: u64) -> Result<Vec<u8>> {
    let dec = zstd::stream::read::Decoder::new(data).map_err(|e| Error::corrupt(format!("zstd: {e}")))?;
    let mut out = Vec::with_capacity(cap.min(64 << 20) as usize);
    dec.take(cap + 1).read_to_end(&mut out).map_err(|e| Error::corrupt(format!("zstd: {e}")))?;
    if out.len() as u64 > cap {
        return Err(Error::corrupt(format!("decompresses to more than {cap} bytes")));
    }
    Ok(out)
}

/// Verifies and decodes a chunk blob: checksum, sizes, the size cap, the header and every row (no
/// duplicate `txn_id`s, the announced count). Valid rows go to `row`; nothing is kept in between.
pub fn decode_chunk(data: &[u8], blob: &BlobRef, expected_rows: u64, max_raw_bytes: u64, mut row: impl FnMut(&Transaction<'_>)) -> Result<()> {
    if data.len() as u64 != blob.compressed_bytes {
        return Err(Error::corrupt(format!("blob {} is {} bytes, work item says {}", blob.key, data.len(), blob.compressed_bytes)));
    }
    let sum = sha256_hex(data);
    if sum != blob.sha256 {
        return Err(Error::corrupt(format!("blob {} sha256 mismatch: {} != {}", blob.key, sum, blob.sha256)));
    }
    if blob.raw_bytes > max_raw_bytes {
        return Err(Error::corrupt(format!("blob {} declares {} raw bytes, above the cap of {max_raw_bytes}", blob.key, blob.raw_bytes)));
    }
    let raw = decompress_capped(data, blob.raw_bytes)?;
    if raw.len() as u64 != blob.raw_bytes {
        return Err(Error::corrupt(format!("blob {} decompressed to {} bytes, work item says {}", blob.key, raw.len(), blob.raw_bytes)));
    }
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(raw.as_slice());
    let mut rec = csv::ByteRecord::new();
    let mut seen: SeenIds<()> = SeenIds::default();
    let mut rows = 0u64;
    let mut header = true;
    while rdr.read_byte_record(&mut rec).map_err(|e| Error::corrupt(format!("chunk CSV: {e}")))? {
        if header {
            header = false;
            check_chunk_header(&rec)?;
            continue;
        }
        let line = rec.position().map(|p| p.line()).unwrap_or(0);
        let t = validate_row(rec.get(0), rec.get(1), rec.get(2), rec.get(3), rec.get(4)).map_err(|e| Error::corrupt(format!("chunk line {line}: {e}")))?;
        if !seen.insert(t.txn_id, ()) {
            return Err(Error::corrupt(format!("chunk line {line}: duplicate txn_id")));
        }
        rows += 1;
        row(&t);
    }
    if rows != expected_rows {
        return Err(Error::corrupt(format!("chunk holds {rows} transactions, work item says {expected_rows}")));
    }
    Ok(())
}

/// A stored chunk's first record is exactly its header.
pub(crate) fn check_chunk_header(rec: &csv::ByteRecord) -> Result<()> {
    if rec.iter().ne(REQUIRED_COLUMNS.iter().map(|c| c.as_bytes())) {
        return Err(Error::corrupt("chunk header is not txn_id,account_id,amount,currency,timestamp"));
    }
    Ok(())
}

/// Per-account totals as compact CSV (`account_id,currency,count,gross,fees`, no header), zstd-compressed:
/// the encoding of large chunk results, about a third of the JSON size and much cheaper to produce
/// and parse.
pub fn accounts_to_zstd_csv<'a>(rows: impl Iterator<Item = RowRef<'a>>) -> Vec<u8> {
    // Compressed as it is written: a million rows' CSV is never whole in memory.
    let enc = zstd::stream::write::Encoder::new(Vec::with_capacity(rows.size_hint().0 * 12), 1).expect("a zstd encoder over a Vec");
    let mut w = csv::WriterBuilder::new().terminator(csv::Terminator::Any(b'\n')).from_writer(enc);
    let (mut c, mut g, mut f) = (String::new(), String::new(), String::new());
    for r in rows {
        use std::fmt::Write as _;
        c.clear();
        g.clear();
        f.clear();
        let _ = (write!(c, "{}", r.count), write!(g, "{}", r.gross), write!(f, "{}", r.fees));
        let _ = w.write_record([r.account_id, r.currency, &c, &g, &f]);
    }
    let enc = w.into_inner().unwrap_or_else(|e| panic!("writing CSV into memory: {}", e.error()));
    enc.finish().expect("zstd compression into memory")
}

/// The longest account-totals CSV row a valid chunk can produce: an account id of
/// [`MAX_ID_CHARS`](crate::validate::MAX_ID_CHARS) characters of 4 bytes each, quoted; a currency of 3
/// letters; a count of 20 digits; gross and fees of at most 31 characters each (a `Decimal`'s 29
/// digits, sign and point); 4 commas and the newline.
pub const MAX_ACCOUNT_ROW_BYTES: u64 = crate::validate::MAX_ID_CHARS as u64 * 4 + 2 + 3 + 20 + 2 * 31 + 5;

/// The most the account totals of a chunk of `transactions` rows can decompress to (a chunk has at
/// most one account row per transaction), and never more than `limit`.
pub fn accounts_cap(transactions: u64, limit: u64) -> u64 {
    transactions.max(1).saturating_mul(MAX_ACCOUNT_ROW_BYTES).min(limit)
}

/// Inverse of [`accounts_to_zstd_csv`], capped at `cap` decompressed bytes.
/// The rows come packed ([`RowBatch`]): a million-row checkpoint part is not a million pairs of owned
/// strings.
pub fn accounts_from_zstd_csv(data: &[u8], cap: u64) -> Result<RowBatch> {
    accounts_from_zstd_csv_rows(data, cap, u64::MAX)
}

/// [`accounts_from_zstd_csv`] that also refuses more than `max_rows` rows (a chunk of `n` transactions
/// has at most `n` account rows) before it decodes them all.
pub fn accounts_from_zstd_csv_rows(data: &[u8], cap: u64, max_rows: u64) -> Result<RowBatch> {
    accounts_from_csv_rows(&decompress_capped(data, cap)?, max_rows)
}

/// Account totals from their CSV rows (decompressed), at most `max_rows` of them.
pub fn accounts_from_csv_rows(raw: &[u8], max_rows: u64) -> Result<RowBatch> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).from_reader(raw);
    let mut rec = csv::StringRecord::new();
    let mut out = RowBatch::new();
    let bad = |what: &str| Error::corrupt(format!("account totals: bad {what}"));
    while rdr.read_record(&mut rec).map_err(|e| Error::corrupt(format!("account totals CSV: {e}")))? {
        if rec.len() != 5 {
            return Err(bad("row"));
        }
        if out.len() as u64 >= max_rows {
            return Err(Error::corrupt(format!("account totals: more than {max_rows} rows")));
        }
        let count = rec[2].parse().map_err(|_| bad("count"))?;
        out.push(&rec[0], &rec[1], count, rec[3].parse().map_err(|_| bad("gross"))?, rec[4].parse().map_err(|_| bad("fees"))?);
    }
    Ok(out)
}

pub fn base64_encode(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

pub fn base64_decode(s: &str) -> Result<Vec<u8>> {
    base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| Error::corrupt(format!("base64: {e}")))
}

/// zstd-compressed JSON document (checkpoints).
pub fn to_zstd_json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(v)?;
    zstd::bulk::compress(&json, CHUNK_ZSTD_LEVEL).map_err(|e| Error::corrupt(format!("zstd: {e}")))
}

pub fn from_zstd_json<T: serde::de::DeserializeOwned>(data: &[u8], cap: u64) -> Result<T> {
    Ok(serde_json::from_slice(&decompress_capped(data, cap)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::parse_amount;

    fn ids(i: u32) -> (String, String) {
        (format!("t{i}"), format!("acc,\"{i}\""))
    }

    fn encoded(n: u32) -> (EncodedChunk, BlobRef) {
        let mut w = ChunkWriter::new();
        for i in 0..n {
            let (t, a) = ids(i);
            w.push(&Transaction {
                txn_id: &t,
                account_id: &a,
                amount: parse_amount("-12.5", 2, "EUR").unwrap(),
                amount_text: "-12.5",
                currency: *b"EUR",
                timestamp: "2026-11-21T10:00:00Z",
            });
        }
        let e = encode_chunk(w);
        let b = BlobRef { key: "jobs/j/chunks/0".into(), sha256: e.sha256.clone(), compressed_bytes: e.bytes.len() as u64, raw_bytes: e.raw_bytes };
        (e, b)
    }

    #[test]
    fn round_trip() {
        let (e, b) = encoded(100);
        let mut back = Vec::new();
        decode_chunk(&e.bytes, &b, 100, 1 << 20, |t| back.push((t.txn_id.to_string(), t.account_id.to_string(), t.amount.to_string()))).unwrap();
        assert_eq!(
            back,
            (0..100)
                .map(|i| {
                    let (t, a) = ids(i);
                    (t, a, "-12.50".to_string())
                })
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn detects_corruption_and_count_mismatch() {
        let (mut e, b) = encoded(10);
        assert!(decode_chunk(&e.bytes, &b, 11, 1 << 20, |_| {}).unwrap_err().to_string().contains("holds 10"));
        let last = e.bytes.len() - 1;
        e.bytes[last] ^= 1;
        let err = decode_chunk(&e.bytes, &b, 10, 1 << 20, |_| {}).unwrap_err();
        assert!(err.to_string().contains("sha256 mismatch"), "{err}");
        assert!(!err.is_retryable());
    }

    #[test]
    fn refuses_zstd_bomb() {
        // 64 MiB of zeros compresses to a few KiB; declaring it small must not expand it.
        let bomb = zstd::bulk::compress(&vec![0u8; 64 << 20], 3).unwrap();
        assert!(bomb.len() < 64 << 10);
        let b = BlobRef { key: "k".into(), sha256: sha256_hex(&bomb), compressed_bytes: bomb.len() as u64, raw_bytes: 1000 };
        let err = decode_chunk(&bomb, &b, 1, 1 << 20, |_| {}).unwrap_err();
        assert!(err.to_string().contains("more than 1000 bytes"), "{err}");
        let b2 = BlobRef { raw_bytes: 64 << 20, ..b };
        assert!(decode_chunk(&bomb, &b2, 1, 1 << 20, |_| {}).unwrap_err().to_string().contains("above the cap"));
    }

    #[test]
    fn account_totals_round_trip() {
        use crate::billing::AccountTotals;
        let rows = vec![
            AccountTotals { account_id: "a,\"b\"".into(), currency: "EUR".into(), count: 3, gross: "-12.50".parse().unwrap(), fees: "0.00".parse().unwrap() },
            AccountTotals {
                account_id: "c".into(),
                currency: "USD".into(),
                count: 1,
                gross: "9999999999.99".parse().unwrap(),
                fees: "290000000.30".parse().unwrap(),
            },
        ];
        let z = accounts_to_zstd_csv(rows.iter().map(AccountTotals::borrowed));
        assert_eq!(accounts_from_zstd_csv(&z, 1 << 20).unwrap().to_vec(), rows);
        assert!(accounts_from_zstd_csv(&zstd::bulk::compress(b"a,EUR,x,1,1\n", 1).unwrap(), 1 << 20).is_err());
    }

    #[test]
    fn rejects_invalid_rows_inside_chunk() {
        let raw = b"txn_id,account_id,amount,currency,timestamp\nt1,a,1.234,EUR,2026-11-21T10:00:00Z\n";
        let z = zstd::bulk::compress(raw, 3).unwrap();
        let b = BlobRef { key: "k".into(), sha256: sha256_hex(&z), compressed_bytes: z.len() as u64, raw_bytes: raw.len() as u64 };
        let err = decode_chunk(&z, &b, 1, 1 << 20, |_| {}).unwrap_err().to_string();
        assert!(err.contains("line 2: amount"), "{err}");
    }
}
