//! Currencies as ISO 4217 defines them: which three-letter codes are currencies, and how many minor
//! units (decimal places) each has: 0 for JPY, 2 for EUR, 3 for BHD, 4 for the funds CLF and UYW. The
//! table is the `iso_currency` crate's; this module only indexes it for the hot path (one lookup per
//! row) and states the rules the fleet bills by:
//!
//! - an amount has at most its currency's places (`1.5 JPY` is refused, never rounded);
//! - a fee is computed exactly and rounded once, to the currency's places, half away from zero;
//! - a code ISO 4217 does not list, or lists without a minor unit (XAU, XDR, XXX: metals, drawing
//!   rights, "no currency"), is not a currency a transaction is billed in.

use std::sync::LazyLock;

use rust_decimal::{Decimal, RoundingStrategy};

/// The most places any ISO 4217 currency has (CLF, UYW): money columns of this scale hold every
/// currency's amounts exactly.
pub const MAX_MINOR_UNITS: u32 = 4;

/// A code's places, or [`UNKNOWN`] / [`NO_MINOR_UNIT`]; indexed by the code's three letters in base 26.
static PLACES: LazyLock<Box<[u8; 26 * 26 * 26]>> = LazyLock::new(|| {
    let mut t = Box::new([UNKNOWN; 26 * 26 * 26]);
    for (i, slot) in t.iter_mut().enumerate() {
        let code = [b'A' + (i / 676) as u8, b'A' + (i / 26 % 26) as u8, b'A' + (i % 26) as u8];
        let code = std::str::from_utf8(&code).expect("ASCII");
        if let Some(c) = iso_currency::Currency::from_code(code) {
            *slot = c.exponent().and_then(|p| u8::try_from(p).ok()).filter(|&p| u32::from(p) <= MAX_MINOR_UNITS).unwrap_or(NO_MINOR_UNIT);
        }
    }
    t
});

/// Table values that are not places: a code ISO 4217 does not list, and one it lists without a minor unit.
const UNKNOWN: u8 = u8::MAX;
const NO_MINOR_UNIT: u8 = u8::MAX - 1;

/// Why a code is not a currency the fleet bills in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotBillable {
    /// Not three uppercase ASCII letters.
    Malformed,
    /// Three letters ISO 4217 does not list.
    Unknown,
    /// Listed without a minor unit (a metal, a drawing right, "no currency").
    NoMinorUnit,
}

/// The number of places (minor units) of the currency `code`, by ISO 4217.
pub fn minor_units(code: &[u8]) -> Result<u32, NotBillable> {
    let [a, b, c] = <[u8; 3]>::try_from(code).map_err(|_| NotBillable::Malformed)?;
    if !(a.is_ascii_uppercase() && b.is_ascii_uppercase() && c.is_ascii_uppercase()) {
        return Err(NotBillable::Malformed);
    }
    let i = usize::from(a - b'A') * 676 + usize::from(b - b'A') * 26 + usize::from(c - b'A');
    match PLACES[i] {
        UNKNOWN => Err(NotBillable::Unknown),
        NO_MINOR_UNIT => Err(NotBillable::NoMinorUnit),
        p => Ok(u32::from(p)),
    }
}

/// The places a stored total in `currency` is shown with: its minor units, or 2 for a code this
/// version does not bill in (never the case for a row it accepted; kept total for old documents).
pub fn places_or_two(currency: &str) -> u32 {
    minor_units(currency.as_bytes()).unwrap_or(2)
}

/// `d` rounded to `places`, half away from zero, and shown with exactly that many places.
pub fn rounded(d: Decimal, places: u32) -> Decimal {
    let mut r = d.round_dp_with_strategy(places, RoundingStrategy::MidpointAwayFromZero);
    r.rescale(places);
    if r.is_zero() {
        r.set_sign_positive(true);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_by_iso_4217() {
        for (code, places) in [("JPY", 0), ("KRW", 0), ("EUR", 2), ("USD", 2), ("BHD", 3), ("KWD", 3), ("OMR", 3), ("TND", 3), ("CLF", 4), ("UYW", 4)] {
            assert_eq!(minor_units(code.as_bytes()), Ok(places), "{code}");
        }
        for code in ["XAU", "XDR", "XXX"] {
            assert_eq!(minor_units(code.as_bytes()), Err(NotBillable::NoMinorUnit), "{code}");
        }
        for code in ["ABC", "ZZZ", "EUX"] {
            assert_eq!(minor_units(code.as_bytes()), Err(NotBillable::Unknown), "{code}");
        }
        for code in ["eur", "EU", "EURO", "E1R", "ÉUR", ""] {
            assert_eq!(minor_units(code.as_bytes()), Err(NotBillable::Malformed), "{code:?}");
        }
    }

    #[test]
    fn rounding_half_away_from_zero_at_the_currency_places() {
        let d = |s: &str| s.parse::<Decimal>().unwrap();
        assert_eq!(rounded(d("144.5"), 0).to_string(), "145");
        assert_eq!(rounded(d("-144.5"), 0).to_string(), "-145");
        assert_eq!(rounded(d("0.4445"), 3).to_string(), "0.445");
        assert_eq!(rounded(d("5"), 3).to_string(), "5.000");
        assert_eq!(rounded(d("-0.001"), 2).to_string(), "0.00");
    }
}
