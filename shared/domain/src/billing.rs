//! Long because its unit tests sit below the code (the code is the first ~370 lines).
//!
//! Billing: the tariff, the per-transaction fee (exact decimals, rounded to cents half away from zero)
//! and the per (account, currency) totals that chunks produce and the controller merges.

use std::collections::{BTreeMap, HashMap};

use std::path::Path;

use rust_decimal::{Decimal, RoundingStrategy};
use serde::{Deserialize, Serialize};

use crate::transaction::Transaction;

/// Fee rule for one currency: `fixed_fee + percent% of amount` for charges, `refund_fee` for refunds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    pub fixed_fee: Decimal,
    pub percent: Decimal,
    #[serde(default)]
    pub refund_fee: Decimal,
}

/// The tariff a job is billed with. Travels inside every work item so that a job is billed the same
/// way by every processor, whatever their configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tariff {
    #[serde(flatten)]
    pub default: Rates,
    /// Per-currency overrides.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub currencies: BTreeMap<String, Rates>,
}

impl Default for Tariff {
    /// 0.30 + 2.9% per charge, nothing for refunds.
    fn default() -> Self {
        Tariff { default: Rates { fixed_fee: Decimal::new(30, 2), percent: Decimal::new(29, 1), refund_fee: Decimal::ZERO }, currencies: BTreeMap::new() }
    }
}

impl Tariff {
    /// Reads a tariff JSON file, e.g. `{"fixed_fee":"0.25","percent":"1.4","currencies":{"GBP":{...}}}`.
    pub fn load(path: &Path) -> Result<Tariff, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let t: Tariff = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        t.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(t)
    }

    /// Rejects negative or absurd rates.
    pub fn check(&self) -> Result<(), String> {
        for (name, r) in std::iter::once(("default", &self.default)).chain(self.currencies.iter().map(|(k, v)| (k.as_str(), v))) {
            if r.fixed_fee.is_sign_negative() || r.refund_fee.is_sign_negative() {
                return Err(format!("{name}: fees must not be negative"));
            }
            // As large as an amount may be: sums of fees then fit as sums of amounts do.
            let max_fee = Decimal::from(10_000_000_000u64);
            if r.fixed_fee > max_fee || r.refund_fee > max_fee {
                return Err(format!("{name}: fees must be at most {max_fee}"));
            }
            if r.percent.is_sign_negative() || r.percent > Decimal::ONE_HUNDRED {
                return Err(format!("{name}: percent must be within 0..=100"));
            }
        }
        for c in self.currencies.keys() {
            crate::validate::parse_currency(c).map_err(|e| format!("currencies: {e}"))?;
        }
        Ok(())
    }

    /// A per-job calculator with the rates prepared.
    pub fn calculator(&self) -> FeeCalculator {
        let prep = |r: &Rates| Prepared { fixed: r.fixed_fee, rate: r.percent / Decimal::ONE_HUNDRED, refund: r.refund_fee };
        FeeCalculator { default: prep(&self.default), overrides: self.currencies.iter().map(|(k, r)| (k.clone(), prep(r))).collect() }
    }
}

#[derive(Debug, Clone)]
struct Prepared {
    fixed: Decimal,
    rate: Decimal,
    refund: Decimal,
}

/// Computes fees for one tariff.
#[derive(Debug, Clone)]
pub struct FeeCalculator {
    default: Prepared,
    overrides: HashMap<String, Prepared>,
}

impl FeeCalculator {
    /// The fee for one amount in one currency, rounded to cents half away from zero.
    pub fn fee(&self, amount: Decimal, currency: &str) -> Decimal {
        let p = if self.overrides.is_empty() { &self.default } else { self.overrides.get(currency).unwrap_or(&self.default) };
        let fee = if amount.is_sign_positive() && !amount.is_zero() { p.fixed + amount * p.rate } else { p.refund };
        fee.round_dp_with_strategy(2, RoundingStrategy::MidpointAwayFromZero)
    }
}

/// Totals for one (account, currency).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountTotals {
    pub account_id: String,
    pub currency: String,
    pub count: u64,
    pub gross: Decimal,
    pub fees: Decimal,
}

impl AccountTotals {
    pub fn net(&self) -> Decimal {
        self.gross - self.fees
    }

    /// The row, borrowed (to write it with rows borrowed from [`Totals`]).
    pub fn borrowed(&self) -> RowRef<'_> {
        RowRef { account_id: &self.account_id, currency: &self.currency, count: self.count, gross: self.gross, fees: self.fees }
    }
}

/// One (account, currency) row borrowed from where it is kept ([`Totals`], an [`AccountTotals`]):
/// what a report or a checkpoint part of a million rows is written from without an owned copy of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRef<'a> {
    pub account_id: &'a str,
    pub currency: &'a str,
    pub count: u64,
    pub gross: Decimal,
    pub fees: Decimal,
}

impl<'a> RowRef<'a> {
    fn of(account_id: &'a str, currency: &'a str, s: &Sums) -> RowRef<'a> {
        RowRef { account_id, currency, count: s.count, gross: s.gross, fees: s.fees }
    }

    pub fn net(&self) -> Decimal {
        self.gross - self.fees
    }

    /// An owned copy of the row.
    pub fn to_totals(&self) -> AccountTotals {
        AccountTotals { account_id: self.account_id.to_string(), currency: self.currency.to_string(), count: self.count, gross: self.gross, fees: self.fees }
    }
}

/// One account of a [`Totals`], borrowed: its id and its rows (one per currency).
#[allow(clippy::borrowed_box)] // the map's own keys, borrowed (no copy of a million ids)
type AccountRef<'a> = (&'a Box<str>, &'a Vec<(String, Sums)>);

/// The rows of a [`Totals`] in order (account_id, then currency, byte order), borrowed from it.
#[derive(Debug)]
pub struct SortedRows<'a> {
    accounts: Vec<AccountRef<'a>>,
    rows: usize,
}

impl<'a> SortedRows<'a> {
    /// Number of (account, currency) rows.
    pub fn len(&self) -> usize {
        self.rows
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The rows, in order (an account's currencies are kept sorted by [`Totals`]).
    pub fn iter(&self) -> impl Iterator<Item = RowRef<'a>> + '_ {
        self.accounts.iter().flat_map(|&(a, v)| v.iter().map(move |(c, s)| RowRef::of(a, c, s)))
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sums {
    count: u64,
    gross: Decimal,
    fees: Decimal,
}

impl Sums {
    /// `self + (count, gross, fees)`, unless a sum does not fit (u64 count, 96-bit decimal).
    fn checked_plus(&self, count: u64, gross: Decimal, fees: Decimal) -> Option<Sums> {
        let s = Sums { count: self.count.checked_add(count)?, gross: self.gross.checked_add(gross)?, fees: self.fees.checked_add(fees)? };
        // Net is reported too: it must fit as well.
        s.gross.checked_sub(s.fees)?;
        Some(s)
    }
}

/// Adding rows would take a sum past what it can hold (hostile or corrupt input): nothing was added.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} of account {account:?} ({currency}) would overflow")]
pub struct Overflow {
    pub account: String,
    pub currency: String,
    pub what: &'static str,
}

/// Running per (account, currency) totals; merging is commutative and associative, so chunks may be
/// added in any order. Looked up by `&str` (accounts first, then their few currencies), so adding a
/// transaction allocates only when a new (account, currency) appears.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    by_account: foldhash::HashMap<Box<str>, Vec<(String, Sums)>>,
}

impl Totals {
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(&mut self, account: &str, currency: &str) -> &mut Sums {
        if !self.by_account.contains_key(account) {
            self.by_account.insert(account.into(), Vec::with_capacity(1));
        }
        let v = self.by_account.get_mut(account).expect("inserted above");
        // An account's currencies are kept in byte order, so rows read out sorted as they are.
        let i = match v.binary_search_by(|(c, _)| c.as_bytes().cmp(currency.as_bytes())) {
            Ok(i) => i,
            Err(i) => {
                v.insert(i, (currency.to_string(), Sums::default()));
                i
            }
        };
        &mut v[i].1
    }

    /// Bills one transaction (validated amounts: at most 10 integer digits, so sums cannot overflow
    /// before 10^18 transactions).
    pub fn add_txn(&mut self, t: &Transaction<'_>, fees: &FeeCalculator) {
        let fee = fees.fee(t.amount, t.currency_str());
        let s = self.slot(t.account_id, t.currency_str());
        s.count += 1;
        s.gross += t.amount;
        s.fees += fee;
    }

    /// Adds one row this process made; rows from a queue go through [`CheckedTotals`].
    pub fn add(&mut self, a: &AccountTotals) {
        let s = self.slot(&a.account_id, &a.currency);
        s.count += a.count;
        s.gross += a.gross;
        s.fees += a.fees;
    }

    pub fn add_all<'a>(&mut self, rows: impl IntoIterator<Item = &'a AccountTotals>) {
        for r in rows {
            self.add(r);
        }
    }

    /// Replaces the sums of the row's (account, currency) with the row's.
    fn set(&mut self, a: &AccountTotals) {
        *self.slot(&a.account_id, &a.currency) = Sums { count: a.count, gross: a.gross, fees: a.fees };
    }

    /// The rows of one account (one per currency), empty when it has none.
    pub fn account_rows<'a>(&'a self, account: &'a str) -> impl Iterator<Item = RowRef<'a>> + 'a {
        self.by_account.get(account).into_iter().flatten().map(move |(c, s)| RowRef::of(account, c, s))
    }

    fn peek(&self, account: &str, currency: &str) -> Sums {
        self.by_account.get(account).and_then(|v| v.iter().find(|(c, _)| c == currency)).map(|(_, s)| *s).unwrap_or_default()
    }

    /// Number of (account, currency) rows.
    pub fn len(&self) -> usize {
        self.by_account.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_account.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (&str, &str, &Sums)> {
        self.by_account.iter().flat_map(|(a, v)| v.iter().map(move |(c, s)| (a.as_ref(), c.as_str(), s)))
    }

    /// Rows sorted by account_id then currency (byte order), borrowed: two references per account
    /// (16 bytes; a million accounts' order is 16 MB, not a copy of their rows).
    pub fn sorted_rows(&self) -> SortedRows<'_> {
        let mut accounts: Vec<AccountRef<'_>> = self.by_account.iter().collect();
        accounts.sort_unstable_by(|x, y| x.0.as_bytes().cmp(y.0.as_bytes()));
        SortedRows { rows: accounts.iter().map(|(_, v)| v.len()).sum(), accounts }
    }

    /// Rows sorted by account_id then currency (byte order).
    pub fn rows(&self) -> Vec<AccountTotals> {
        self.sorted_rows().iter().map(|r| r.to_totals()).collect()
    }

    /// Per-currency sums, sorted by currency.
    pub fn by_currency(&self) -> Vec<AccountTotals> {
        let mut cur: BTreeMap<&str, Sums> = BTreeMap::new();
        for (_, c, s) in self.iter() {
            let t = cur.entry(c).or_default();
            t.count += s.count;
            t.gross += s.gross;
            t.fees += s.fees;
        }
        cur.into_iter()
            .map(|(c, s)| AccountTotals { account_id: String::new(), currency: c.to_string(), count: s.count, gross: s.gross, fees: s.fees })
            .collect()
    }

    /// Transactions counted (saturating: each currency's count fits, their sum need not).
    pub fn transactions(&self) -> u64 {
        self.iter().fold(0u64, |n, (_, _, s)| n.saturating_add(s.count))
    }
}

/// Totals fed with rows from queues (the controller's): every addition is checked, all or nothing,
/// against the account's and the currency's running sums, so that no sum a report shows (an account,
/// a currency over its accounts, their net) can overflow. The per-currency sums are kept here, off
/// the per-transaction path of [`Totals::add_txn`].
#[derive(Debug, Clone, Default)]
pub struct CheckedTotals {
    totals: Totals,
    by_currency: Vec<(String, Sums)>,
}

impl CheckedTotals {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the rows, or nothing when a sum would overflow (the first such row is named).
    pub fn try_add_all<'a>(&mut self, rows: impl IntoIterator<Item = &'a AccountTotals> + Clone) -> Result<(), Overflow> {
        let mut accounts: HashMap<(&str, &str), Sums> = HashMap::new();
        let mut currencies: HashMap<&str, Sums> = HashMap::new();
        for a in rows.clone() {
            let over = |what| Overflow { account: a.account_id.clone(), currency: a.currency.clone(), what };
            let cur = accounts.get(&(a.account_id.as_str(), a.currency.as_str())).copied().unwrap_or_else(|| self.totals.peek(&a.account_id, &a.currency));
            accounts.insert((&a.account_id, &a.currency), cur.checked_plus(a.count, a.gross, a.fees).ok_or_else(|| over("a sum"))?);
            let cur = currencies.get(a.currency.as_str()).copied().unwrap_or_else(|| self.currency(&a.currency));
            currencies.insert(&a.currency, cur.checked_plus(a.count, a.gross, a.fees).ok_or_else(|| over("the currency's sum"))?);
        }
        self.totals.add_all(rows);
        for (c, s) in currencies {
            match self.by_currency.iter_mut().find(|(k, _)| k == c) {
                Some((_, t)) => *t = s,
                None => self.by_currency.push((c.to_string(), s)),
            }
        }
        Ok(())
    }

    /// Totals restored from snapshots of rows (a checkpoint and the parts written after it): each row
    /// replaces what an earlier batch held for its (account, currency). Fails when a per-currency sum
    /// (or a row's net) would overflow, which only a corrupt or hostile snapshot can cause.
    pub fn restore<'a, B>(batches: impl IntoIterator<Item = B>) -> Result<CheckedTotals, Overflow>
    where
        B: IntoIterator<Item = &'a AccountTotals>,
    {
        let mut totals = Totals::new();
        for batch in batches {
            for row in batch {
                totals.set(row);
            }
        }
        let mut by_currency: Vec<(String, Sums)> = Vec::new();
        for (a, c, s) in totals.iter() {
            let over = |what| Overflow { account: a.to_string(), currency: c.to_string(), what };
            Sums::default().checked_plus(s.count, s.gross, s.fees).ok_or_else(|| over("a sum"))?;
            let i = match by_currency.iter().position(|(k, _)| k == c) {
                Some(i) => i,
                None => {
                    by_currency.push((c.to_string(), Sums::default()));
                    by_currency.len() - 1
                }
            };
            by_currency[i].1 = by_currency[i].1.checked_plus(s.count, s.gross, s.fees).ok_or_else(|| over("the currency's sum"))?;
        }
        Ok(CheckedTotals { totals, by_currency })
    }

    fn currency(&self, currency: &str) -> Sums {
        self.by_currency.iter().find(|(c, _)| c == currency).map(|(_, s)| *s).unwrap_or_default()
    }
}

impl std::ops::Deref for CheckedTotals {
    type Target = Totals;

    fn deref(&self) -> &Totals {
        &self.totals
    }
}

/// Formats an amount as a string with exactly two decimals (`-12.50`).
pub fn money(d: Decimal) -> String {
    let mut r = d.round_dp_with_strategy(2, RoundingStrategy::MidpointAwayFromZero);
    r.rescale(2);
    if r.is_zero() {
        r.set_sign_positive(true);
    }
    r.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::parse_amount;

    fn fee(amount: &str) -> String {
        money(Tariff::default().calculator().fee(parse_amount(amount).unwrap(), "EUR"))
    }

    #[test]
    fn default_tariff_and_half_up_rounding() {
        assert_eq!(fee("100"), "3.20"); // 0.30 + 2.90
        assert_eq!(fee("10.00"), "0.59"); // 0.30 + 0.29
        assert_eq!(fee("0.50"), "0.31"); // 0.30 + 0.0145 = 0.3145
        assert_eq!(fee("1.50"), "0.34"); // 0.30 + 0.0435 -> 0.3435 -> 0.34
        assert_eq!(fee("0.05"), "0.30"); // 0.30 + 0.00145
        assert_eq!(fee("8.62"), "0.55"); // 0.30 + 0.24998
        assert_eq!(fee("12.50"), "0.66"); // 0.30 + 0.3625 = 0.6625 -> 0.66
        assert_eq!(fee("15.00"), "0.74"); // 0.30 + 0.435 = 0.735 -> half away from zero -> 0.74
        assert_eq!(fee("-15.00"), "0.00"); // refunds carry no fee
        assert_eq!(fee("9999999999.99"), "290000000.30"); // 0.30 + 289999999.9997 -> 290000000.2997
    }

    #[test]
    fn overrides_and_check() {
        let t: Tariff =
            serde_json::from_str(r#"{"fixed_fee":"0.25","percent":"1.4","refund_fee":"0.10","currencies":{"GBP":{"fixed_fee":"0.20","percent":"2.5"}}}"#)
                .unwrap();
        t.check().unwrap();
        let c = t.calculator();
        assert_eq!(money(c.fee(Decimal::new(10000, 2), "EUR")), "1.65");
        assert_eq!(money(c.fee(Decimal::new(10000, 2), "GBP")), "2.70");
        assert_eq!(money(c.fee(Decimal::new(-10000, 2), "EUR")), "0.10");
        let bad: Tariff = serde_json::from_str(r#"{"fixed_fee":"-1","percent":"1"}"#).unwrap();
        assert!(bad.check().is_err());
        assert!(serde_json::from_str::<Tariff>(r#"{"fixed_fee":"1","percent":"1","typo":1}"#).is_err());
    }

    #[test]
    fn merge_is_order_independent_and_sorted() {
        let row = |a: &str, c: &str, n, g: i64, f: i64| AccountTotals {
            account_id: a.into(),
            currency: c.into(),
            count: n,
            gross: Decimal::new(g, 2),
            fees: Decimal::new(f, 2),
        };
        let rows = [row("b", "EUR", 1, 100, 10), row("a", "USD", 2, -50, 0), row("a", "EUR", 1, 1, 1), row("b", "EUR", 3, 200, 20)];
        let mut fwd = Totals::new();
        fwd.add_all(rows.iter());
        let mut rev = Totals::new();
        rev.add_all(rows.iter().rev());
        assert_eq!(fwd.rows(), rev.rows());
        let out = fwd.rows();
        assert_eq!(out.iter().map(|r| (r.account_id.as_str(), r.currency.as_str())).collect::<Vec<_>>(), [("a", "EUR"), ("a", "USD"), ("b", "EUR")]);
        assert_eq!(out[2].count, 4);
        assert_eq!(money(out[2].gross), "3.00");
        assert_eq!(money(out[2].net()), "2.70");
        let cur = fwd.by_currency();
        assert_eq!(cur.len(), 2);
        assert_eq!(cur[0].currency, "EUR");
        assert_eq!(cur[0].count, 5);
        assert_eq!(fwd.transactions(), 7);
    }

    #[test]
    fn restore_lets_later_rows_replace_earlier_ones_and_checks_currency_sums() {
        let row =
            |a: &str, c: &str, n, g: i64| AccountTotals { account_id: a.into(), currency: c.into(), count: n, gross: Decimal::new(g, 2), fees: Decimal::ZERO };
        let mut live = CheckedTotals::new();
        let first = [row("a", "EUR", 1, 100), row("b", "EUR", 2, 200)];
        live.try_add_all(first.iter()).unwrap();
        let base = live.rows();
        let second = [row("a", "EUR", 4, 400), row("c", "USD", 1, 5)];
        live.try_add_all(second.iter()).unwrap();
        // What changed since the base: the rows of the accounts touched, as they now stand.
        let changed: Vec<AccountTotals> = ["a", "c"].iter().flat_map(|a| live.account_rows(a)).map(|r| r.to_totals()).collect();
        assert_eq!(changed.len(), 2);
        let restored = CheckedTotals::restore([base.iter(), changed.iter()]).unwrap();
        assert_eq!(restored.rows(), live.rows());
        assert_eq!(restored.by_currency(), live.by_currency());
        // The restored currency sums are the ones later additions are checked against.
        let mut restored = restored;
        let huge = [row("z", "EUR", 1, 0)];
        let mut near = huge.clone();
        near[0].gross = Decimal::MAX - Decimal::new(100, 2);
        assert!(restored.try_add_all(near.iter()).is_err(), "EUR already sums 7.00: MAX - 1.00 more would overflow");
        let bad = [row("x", "EUR", 1, 0), row("y", "EUR", 1, 0)].map(|mut r| {
            r.gross = Decimal::MAX;
            r
        });
        let e = CheckedTotals::restore([bad.iter()]).unwrap_err();
        assert_eq!(e.what, "the currency's sum");
    }

    #[test]
    fn money_format() {
        assert_eq!(money(Decimal::new(-1250, 3)), "-1.25");
        assert_eq!(money(Decimal::new(5, 0)), "5.00");
        assert_eq!(money(Decimal::new(-0, 2)), "0.00");
    }
}
