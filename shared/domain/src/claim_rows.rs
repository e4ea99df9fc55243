//! What a job claims of a chunk it bills (see `controller_core::claims`): each row's `txn_id`
//! fingerprint and its day, read from the chunk blob as stored (the controller reads a counted chunk
//! again at its job's finish), and the rows found duplicates read again to be taken out.
//!
//! The fingerprint is 128 bits of xxh3 (seed 0, stable across releases and platforms: claims outlive
//! the process that wrote them); an accidental collision is about 1e-27 for a million ids a day, and
//! would make one row a duplicate, named in its report. The day is the transaction's own, in UTC.

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::codec::{check_chunk_header, decompress_capped};
use crate::error::{Error, Result};
use crate::transaction::Transaction;
use crate::validate::validate_row;

/// The fingerprint a claim is made under.
pub fn fingerprint(txn_id: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(txn_id)
}

/// The UTC day of an RFC 3339 timestamp, as yyyymmdd (`Z` read as it stands, an offset converted).
pub fn day_of(ts: &[u8]) -> Option<u32> {
    let digits = |s: &[u8]| s.iter().try_fold(0u32, |n, &b| b.is_ascii_digit().then(|| n * 10 + u32::from(b - b'0')));
    if ts.len() >= 20 && ts.last() == Some(&b'Z') && ts[4] == b'-' && ts[7] == b'-' {
        return Some(digits(&ts[..4])? * 10_000 + digits(&ts[5..7])? * 100 + digits(&ts[8..10])?);
    }
    let t = OffsetDateTime::parse(std::str::from_utf8(ts).ok()?, &Rfc3339).ok()?.to_offset(time::UtcOffset::UTC);
    u32::try_from(t.year()).ok().map(|y| y * 10_000 + u32::from(u8::from(t.month())) * 100 + u32::from(t.day()))
}

/// `yyyymmdd` as `yyyy-mm-dd`.
pub fn day_text(day: u32) -> String {
    format!("{:04}-{:02}-{:02}", day / 10_000, day / 100 % 100, day % 100)
}

/// Each row of a stored chunk (zstd CSV, decompressed up to `raw_cap` bytes) as `(row, day,
/// fingerprint)`, rows counted from 0. The chunk was billed whole (a processor validated every row),
/// so only its header and each row's id and timestamp are read here.
pub fn chunk_claim_rows(data: &[u8], raw_cap: u64, mut row: impl FnMut(u32, u32, u128)) -> Result<()> {
    let raw = decompress_capped(data, raw_cap)?;
    let mut rdr = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(raw.as_slice());
    let mut rec = csv::ByteRecord::new();
    let mut header = true;
    let mut n = 0u32;
    while rdr.read_byte_record(&mut rec).map_err(|e| Error::corrupt(format!("chunk CSV: {e}")))? {
        if header {
            header = false;
            check_chunk_header(&rec)?;
            continue;
        }
        let (Some(id), Some(ts)) = (rec.get(0), rec.get(4)) else { return Err(Error::corrupt(format!("chunk row {n}: fewer than five fields"))) };
        let day = day_of(ts).ok_or_else(|| Error::corrupt(format!("chunk row {n}: timestamp is not RFC 3339")))?;
        row(n, day, fingerprint(id));
        n += 1;
    }
    Ok(())
}

/// The rows `wanted` (sorted row numbers) of a stored chunk, validated, each given to `f` with its
/// row number.
pub fn chunk_rows_at(data: &[u8], raw_cap: u64, wanted: &[u32], mut f: impl FnMut(u32, &Transaction<'_>)) -> Result<()> {
    let raw = decompress_capped(data, raw_cap)?;
    let mut rdr = csv::ReaderBuilder::new().has_headers(true).flexible(true).from_reader(raw.as_slice());
    let mut rec = csv::ByteRecord::new();
    let mut n = 0u32;
    let mut next = wanted.iter().peekable();
    while next.peek().is_some() && rdr.read_byte_record(&mut rec).map_err(|e| Error::corrupt(format!("chunk CSV: {e}")))? {
        if next.peek() == Some(&&n) {
            next.next();
            let t = validate_row(rec.get(0), rec.get(1), rec.get(2), rec.get(3), rec.get(4)).map_err(|e| Error::corrupt(format!("chunk row {n}: {e}")))?;
            f(n, &t);
        }
        n += 1;
    }
    match next.next() {
        Some(missing) => Err(Error::corrupt(format!("chunk has no row {missing}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_in_utc_whatever_the_offset() {
        assert_eq!(day_of(b"2026-12-01T10:00:00Z"), Some(20261201));
        assert_eq!(day_of(b"2026-12-01T23:30:00-05:00"), Some(20261202));
        assert_eq!(day_of(b"2026-12-01T01:30:00+02:00"), Some(20261130));
        assert_eq!(day_of(b"2026-12-01T01:30:00.123Z"), Some(20261201));
        assert_eq!(day_of(b"yesterday"), None);
        assert_eq!(day_text(20261201), "2026-12-01");
    }

    #[test]
    fn rows_read_back_by_number() {
        let csv = "txn_id,account_id,amount,currency,timestamp\na,A1,1.00,EUR,2026-12-01T10:00:00Z\nb,A2,2.00,EUR,2026-12-02T10:00:00Z\nc,A1,3.00,EUR,2026-12-02T10:00:00+01:00\n";
        let z = zstd::bulk::compress(csv.as_bytes(), 1).unwrap();
        let mut rows = Vec::new();
        chunk_claim_rows(&z, 1 << 20, |n, d, fp| rows.push((n, d, fp))).unwrap();
        assert_eq!(rows.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(), [(0, 20261201), (1, 20261202), (2, 20261202)]);
        assert_eq!(rows[1].2, fingerprint(b"b"));
        let mut got = Vec::new();
        chunk_rows_at(&z, 1 << 20, &[0, 2], |n, t| got.push((n, t.txn_id.to_string()))).unwrap();
        assert_eq!(got, [(0, "a".to_string()), (2, "c".to_string())]);
        assert!(chunk_rows_at(&z, 1 << 20, &[5], |_, _| {}).is_err());
    }
}
