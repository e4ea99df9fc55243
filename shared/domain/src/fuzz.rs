//! Entry points for fuzzing the parsers that read untrusted bytes: CSV rows (as a file and as a chunk
//! blob) and work items. Each takes arbitrary bytes and must never panic, however hostile the input;
//! errors are the expected answer. The cargo-fuzz targets in `shared/fuzz/` call these (result
//! messages are fuzzed through the controller's aggregator there), and a unit test feeds them random
//! and mutated inputs so they run on stable in CI too.

use crate::billing::{Tariff, Totals};
use crate::codec::{decode_chunk, sha256_hex};
use crate::model::BlobRef;
use crate::validate::validate_row;

/// CSV rows as a user's file holds them: every row validated and billed.
pub fn csv_rows(data: &[u8]) {
    let fees = Tariff::default().calculator();
    let mut totals = Totals::new();
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(data);
    let mut rec = csv::ByteRecord::new();
    while let Ok(true) = rdr.read_byte_record(&mut rec) {
        if let Ok(t) = validate_row(rec.get(0), rec.get(1), rec.get(2), rec.get(3), rec.get(4)) {
            totals.add_txn(&t, &fees);
        }
    }
    let _ = (totals.rows(), totals.by_currency(), totals.transactions());
}

/// A chunk blob as a processor reads it: the first 8 bytes say the raw size and row count it claims,
/// the rest is the (zstd) blob; checksum and size match, so decompression and parsing are reached.
pub fn chunk_blob(data: &[u8]) {
    if data.len() < 8 {
        return;
    }
    let raw_bytes = u64::from(u32::from_le_bytes([data[0], data[1], data[2], data[3]]));
    let rows = u64::from(u32::from_le_bytes([data[4], data[5], data[6], data[7]]));
    let blob = &data[8..];
    let r = BlobRef { key: "jobs/f/chunks/000000.csv.zst".into(), sha256: sha256_hex(blob), compressed_bytes: blob.len() as u64, raw_bytes };
    let fees = Tariff::default().calculator();
    let mut totals = Totals::new();
    let _ = decode_chunk(blob, &r, rows, 1 << 24, |t| totals.add_txn(t, &fees));
}

/// A work item body as a processor receives it.
pub fn work_item(data: &[u8]) {
    if let Ok(body) = std::str::from_utf8(data) {
        if let Ok(w) = crate::model::parse_work_item(body) {
            let _ = w.tariff.calculator();
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    fn mutate(rng: &mut rand_chacha::ChaCha8Rng, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        for _ in 0..rng.random_range(1..8) {
            match rng.random_range(0..4) {
                0 if !v.is_empty() => {
                    let i = rng.random_range(0..v.len());
                    v[i] = rng.random();
                }
                1 if !v.is_empty() => {
                    let i = rng.random_range(0..v.len());
                    v.remove(i);
                }
                2 => {
                    let i = rng.random_range(0..=v.len());
                    let b = *b"9,.-\"\n{}:0123456789e+";
                    v.insert(i, b[rng.random_range(0..b.len())]);
                }
                _ => {
                    let i = rng.random_range(0..=v.len());
                    v.splice(i..i, b"99999999999999999999".iter().copied());
                }
            }
        }
        v
    }

    /// 20,000 mutated inputs through every entry point: none panics.
    #[test]
    fn hostile_inputs_never_panic() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let csv = b"txn_id,account_id,amount,currency,timestamp\nt1,a,9999999999.99,EUR,2026-11-21T10:00:00Z\nt2,b,-0.01,USD,2026-11-21T10:00:00+01:00\n";
        let raw = csv.to_vec();
        let z = zstd::encode_all(raw.as_slice(), 3).unwrap();
        let mut blob = (raw.len() as u32).to_le_bytes().to_vec();
        blob.extend(2u32.to_le_bytes());
        blob.extend(&z);
        let item = br#"{"v":1,"job_id":"j","chunk":0,"transactions":2,"blob":{"key":"jobs/j/chunks/000000.csv.zst","sha256":"00","compressed_bytes":1,"raw_bytes":1},"tariff":{"fixed_fee":"0.30","percent":"2.9"}}"#;
        for _ in 0..20_000 {
            csv_rows(&mutate(&mut rng, csv));
            chunk_blob(&mutate(&mut rng, &blob));
            work_item(&mutate(&mut rng, item));
        }
        chunk_blob(&blob);
    }
}
