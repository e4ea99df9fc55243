//! Field rules for one transaction row. The initiator applies them to the user's CSV and the processor
//! applies them again to every chunk it receives (the queue is untrusted input), so they live here once.

use std::fmt;

use rust_decimal::Decimal;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::currency::NotBillable;
use crate::transaction::Transaction;

/// Longest allowed `txn_id` / `account_id`, in characters.
pub const MAX_ID_CHARS: usize = 64;
/// Most integer digits an amount may have.
pub const MAX_INTEGER_DIGITS: usize = 10;

/// The required input columns, in the order chunks are written.
pub const REQUIRED_COLUMNS: [&str; 5] = ["txn_id", "account_id", "amount", "currency", "timestamp"];

/// Why a row was rejected: the field and the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowError {
    pub field: &'static str,
    pub problem: String,
}

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.problem)
    }
}

fn err(field: &'static str, problem: impl Into<String>) -> RowError {
    RowError { field, problem: problem.into() }
}

/// Shortens a value for an error message (no huge fields in reports).
fn shown(v: &str) -> String {
    let mut s: String = v.chars().take(40).collect();
    if v.chars().count() > 40 {
        s.push('…');
    }
    format!("{s:?}")
}

fn text<'a>(field: &'static str, raw: Option<&'a [u8]>) -> Result<&'a str, RowError> {
    let raw = raw.ok_or_else(|| err(field, "missing (the row has too few fields)"))?;
    std::str::from_utf8(raw).map_err(|_| err(field, "not valid UTF-8"))
}

fn id<'a>(field: &'static str, raw: Option<&'a [u8]>) -> Result<&'a str, RowError> {
    let v = text(field, raw)?;
    if v.is_empty() {
        return Err(err(field, "empty"));
    }
    let n = v.chars().count();
    if n > MAX_ID_CHARS {
        return Err(err(field, format!("{n} characters, more than {MAX_ID_CHARS}")));
    }
    Ok(v)
}

/// Parses `-?digits[.digits]` (at most 10 integer digits and `places` decimals, the currency's minor
/// units), non-zero, into an exact decimal with scale `places`. More decimals than the currency has are
/// refused, never rounded: `1.5` yen is not an amount.
pub fn parse_amount(v: &str, places: u32, currency: &str) -> Result<Decimal, RowError> {
    let bad = || err("amount", format!("{} is not -?digits[.decimals] with at most {MAX_INTEGER_DIGITS} integer digits", shown(v)));
    let b = v.as_bytes();
    let (neg, rest) = match b.first() {
        Some(b'-') => (true, &b[1..]),
        _ => (false, b),
    };
    let (int, frac) = match rest.iter().position(|&c| c == b'.') {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    if int.is_empty() || int.len() > MAX_INTEGER_DIGITS || !int.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    let mut units: i64 = 0;
    for &d in int {
        units = units * 10 + i64::from(d - b'0');
    }
    units *= 10i64.pow(places);
    if let Some(frac) = frac {
        if frac.is_empty() || !frac.iter().all(u8::is_ascii_digit) {
            return Err(bad());
        }
        if frac.len() > places as usize {
            return Err(err("amount", format!("{} has {} decimals; {currency} allows {places} (its ISO 4217 minor unit)", shown(v), frac.len())));
        }
        let mut f = 0i64;
        for &d in frac {
            f = f * 10 + i64::from(d - b'0');
        }
        units += f * 10i64.pow(places - frac.len() as u32);
    }
    if units == 0 {
        return Err(err("amount", "is zero"));
    }
    Ok(Decimal::new(if neg { -units } else { units }, places))
}

/// An ISO 4217 currency code that has a minor unit, and its places.
pub fn parse_currency(v: &str) -> Result<([u8; 3], u32), RowError> {
    match crate::currency::minor_units(v.as_bytes()) {
        Ok(places) => {
            let b = v.as_bytes();
            Ok(([b[0], b[1], b[2]], places))
        }
        Err(NotBillable::Malformed) => Err(err("currency", format!("{} is not three uppercase letters (ISO 4217)", shown(v)))),
        Err(NotBillable::Unknown) => Err(err("currency", format!("{} is not an ISO 4217 currency code", shown(v)))),
        Err(NotBillable::NoMinorUnit) => Err(err("currency", format!("{} has no minor unit in ISO 4217 (a metal, fund or \"no currency\" code, not billed)", shown(v)))),
    }
}

/// An RFC 3339 date-time with an offset (`Z` or `±hh:mm`), `T` as the separator.
pub fn check_timestamp(v: &str) -> Result<(), RowError> {
    let bad = || err("timestamp", format!("{} is not an RFC 3339 date-time with offset", shown(v)));
    // The RFC allows a lowercase `t`/`z` and some parsers accept a space; the contract asks for the
    // canonical form, so require an uppercase `T` at position 10 before handing the rest to `time`.
    if v.as_bytes().get(10) != Some(&b'T') {
        return Err(bad());
    }
    OffsetDateTime::parse(v, &Rfc3339).map(|_| ()).map_err(|_| bad())
}

/// Validates one row's five fields (raw bytes as read from CSV; `None` when the row lacks the field).
pub fn validate_row<'a>(
    txn_id: Option<&'a [u8]>,
    account_id: Option<&'a [u8]>,
    amount: Option<&'a [u8]>,
    currency: Option<&'a [u8]>,
    timestamp: Option<&'a [u8]>,
) -> Result<Transaction<'a>, RowError> {
    let txn_id = id("txn_id", txn_id)?;
    let account_id = id("account_id", account_id)?;
    let amount_text = text("amount", amount)?;
    let currency_text = text("currency", currency)?;
    let (currency, places) = parse_currency(currency_text)?;
    let amount = parse_amount(amount_text, places, currency_text)?;
    let timestamp = text("timestamp", timestamp)?;
    check_timestamp(timestamp)?;
    Ok(Transaction { txn_id, account_id, amount, amount_text, currency, timestamp })
}

/// Remembers `txn_id`s by a keyed 128-bit fingerprint instead of a copy of each id: no allocation per
/// row. The key is random per process, so ids cannot be crafted to collide; an accidental collision
/// (about 1e-27 for a million ids) would reject one row as a duplicate.
pub struct SeenIds<V> {
    seed: u64,
    map: foldhash::HashMap<u128, V>,
}

impl<V> Default for SeenIds<V> {
    fn default() -> Self {
        SeenIds { seed: rand::random(), map: Default::default() }
    }
}

impl<V> SeenIds<V> {
    fn key(&self, id: &str) -> u128 {
        xxhash_rust::xxh3::xxh3_128_with_seed(id.as_bytes(), self.seed)
    }

    pub fn get(&self, id: &str) -> Option<&V> {
        self.map.get(&self.key(id))
    }

    /// Inserts `id` with `v` unless it is there already; then returns the first value.
    pub fn insert_new(&mut self, id: &str, v: V) -> Option<&V> {
        let k = self.key(id);
        match self.map.entry(k) {
            std::collections::hash_map::Entry::Occupied(e) => Some(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(v);
                None
            }
        }
    }

    /// Inserts `id`; returns false (and keeps the first value) when it was already there.
    pub fn insert(&mut self, id: &str, v: V) -> bool {
        self.insert_new(id, v).is_none()
    }

    /// Makes room for `n` more ids.
    pub fn reserve(&mut self, n: usize) {
        self.map.reserve(n);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts() {
        let eur = |v: &str| parse_amount(v, 2, "EUR");
        assert_eq!(eur("12").unwrap().to_string(), "12.00");
        assert_eq!(eur("12.5").unwrap().to_string(), "12.50");
        assert_eq!(eur("-0.05").unwrap().to_string(), "-0.05");
        assert_eq!(eur("9999999999.99").unwrap().to_string(), "9999999999.99");
        for bad in ["", "-", "1.", ".5", "1.234", "12345678901", "+1", "1e3", " 1", "1,00", "--1", "1.2.3", "١"] {
            assert_eq!(eur(bad).unwrap_err().field, "amount", "{bad:?} should be rejected");
        }
        assert_eq!(eur("0.00").unwrap_err().problem, "is zero");
        assert_eq!(eur("-0").unwrap_err().problem, "is zero");
    }

    #[test]
    fn amounts_at_their_currency_places() {
        assert_eq!(parse_amount("1500", 0, "JPY").unwrap().to_string(), "1500");
        assert_eq!(parse_amount("9999999999", 0, "JPY").unwrap().to_string(), "9999999999");
        assert_eq!(parse_amount("1.5", 0, "JPY").unwrap_err().to_string(), "amount: \"1.5\" has 1 decimals; JPY allows 0 (its ISO 4217 minor unit)");
        assert_eq!(parse_amount("1.", 0, "JPY").unwrap_err().field, "amount");
        assert_eq!(parse_amount("12.345", 3, "BHD").unwrap().to_string(), "12.345");
        assert_eq!(parse_amount("-0.5", 3, "BHD").unwrap().to_string(), "-0.500");
        assert_eq!(parse_amount("9999999999.999", 3, "BHD").unwrap().to_string(), "9999999999.999");
        assert!(parse_amount("0.0005", 3, "BHD").unwrap_err().problem.contains("BHD allows 3"));
        assert_eq!(parse_amount("0.0001", 4, "CLF").unwrap().to_string(), "0.0001");
        assert_eq!(parse_amount("12.345", 2, "EUR").unwrap_err().to_string(), "amount: \"12.345\" has 3 decimals; EUR allows 2 (its ISO 4217 minor unit)");
    }

    #[test]
    fn currencies() {
        assert_eq!(parse_currency("EUR").unwrap(), (*b"EUR", 2));
        assert_eq!(parse_currency("JPY").unwrap(), (*b"JPY", 0));
        assert_eq!(parse_currency("BHD").unwrap(), (*b"BHD", 3));
        for bad in ["eur", "EU", "EURO", "E1R", "ÉUR", ""] {
            assert!(parse_currency(bad).unwrap_err().problem.contains("three uppercase letters"), "{bad:?}");
        }
        assert_eq!(parse_currency("ABC").unwrap_err().to_string(), "currency: \"ABC\" is not an ISO 4217 currency code");
        assert!(parse_currency("XAU").unwrap_err().problem.contains("no minor unit"));
    }

    #[test]
    fn timestamps() {
        for ok in ["2026-11-21T10:00:00Z", "2026-11-21T10:00:00.250+02:00", "2026-02-28T23:59:59-05:30"] {
            assert!(check_timestamp(ok).is_ok(), "{ok}");
        }
        for bad in ["2026-11-21 10:00:00Z", "2026-11-21T10:00:00", "2026-11-21", "2026-13-01T00:00:00Z", "2026-11-21t10:00:00Z", "yesterday"] {
            assert!(check_timestamp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn seen_ids() {
        let mut s: SeenIds<u32> = SeenIds::default();
        assert!(s.insert("a", 1));
        assert!(!s.insert("a", 2));
        assert_eq!(s.get("a"), Some(&1));
        assert_eq!(s.get("b"), None);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn ids_and_missing_fields() {
        let long = "x".repeat(65);
        let ok = |t: &str, a: &str| validate_row(Some(t.as_bytes()), Some(a.as_bytes()), Some(b"1"), Some(b"EUR"), Some(b"2026-11-21T10:00:00Z")).map(|_| ());
        assert!(ok("t1", "a1").is_ok());
        assert!(ok(&"é".repeat(64), "a").is_ok(), "64 characters are allowed even when multi-byte");
        assert_eq!(ok("", "a1").unwrap_err().to_string(), "txn_id: empty");
        assert_eq!(ok("t1", &long).unwrap_err().field, "account_id");
        let missing = validate_row(Some(b"t"), Some(b"a"), Some(b"1"), None, None).unwrap_err();
        assert_eq!(missing.field, "currency");
        fn row(amount: &'static [u8], currency: &'static [u8]) -> Result<String, RowError> {
            validate_row(Some(b"t"), Some(b"a"), Some(amount), Some(currency), Some(b"2026-11-21T10:00:00Z")).map(|t| t.amount.to_string())
        }
        assert_eq!(row(b"1500", b"JPY").unwrap(), "1500");
        assert_eq!(row(b"1.5", b"JPY").unwrap_err().field, "amount", "yen have no decimals");
        assert_eq!(row(b"1.005", b"BHD").unwrap(), "1.005");
        assert_eq!(row(b"1", b"ABC").unwrap_err().field, "currency", "not ISO 4217");
        let bad_utf8 = validate_row(Some(b"t\xff"), Some(b"a"), Some(b"1"), Some(b"EUR"), Some(b"x")).unwrap_err();
        assert_eq!(bad_utf8.to_string(), "txn_id: not valid UTF-8");
    }
}
