//! One valid transaction, the unit everything else is made of. It sits apart from the wire documents
//! (`model`) so that validation and billing, which model's documents use, do not import model back.

use rust_decimal::Decimal;

/// One valid transaction, borrowed from the CSV record it was read from (no allocation per row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transaction<'a> {
    pub txn_id: &'a str,
    pub account_id: &'a str,
    /// Exact amount at its currency's ISO 4217 places (scale 0 for JPY, 2 for EUR, 3 for BHD); negative for a refund.
    pub amount: Decimal,
    /// The amount as written (validated), for writing chunks without reformatting.
    pub amount_text: &'a str,
    /// ISO 4217 code, three uppercase ASCII letters.
    pub currency: [u8; 3],
    /// RFC 3339 timestamp, as given.
    pub timestamp: &'a str,
}

impl Transaction<'_> {
    pub fn currency_str(&self) -> &str {
        // Validated as ASCII uppercase on construction.
        std::str::from_utf8(&self.currency).unwrap_or("???")
    }
}
