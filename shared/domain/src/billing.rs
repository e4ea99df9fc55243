//! Long because its unit tests sit below the code (the code is the first ~510 lines).
//!
//! Billing: the tariff, the per-transaction fee (exact decimals, rounded once to the currency's minor
//! unit, half away from zero: whole yen, cents, fils) and the per (account, currency) totals that chunks produce and the controller merges.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher as _;

use std::path::Path;

use rust_decimal::Decimal;
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
        for (c, r) in &self.currencies {
            let (_, places) = crate::validate::parse_currency(c).map_err(|e| format!("currencies: {e}"))?;
            // A fee below the currency's unit would be billed rounded: say so where it is written.
            for (what, fee) in [("fixed_fee", r.fixed_fee), ("refund_fee", r.refund_fee)] {
                if fee.normalize().scale() > places {
                    return Err(format!("{c}: {what} {fee} has more decimals than {c}'s {places} (ISO 4217 minor unit)"));
                }
            }
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
    /// The fee for one amount in one currency: `fixed + amount × percent / 100` for a charge, the
    /// refund fee for a refund, computed exactly and rounded once to the currency's minor unit
    /// (ISO 4217: whole yen, cents, fils), half away from zero.
    pub fn fee(&self, amount: Decimal, currency: &str) -> Decimal {
        let p = if self.overrides.is_empty() { &self.default } else { self.overrides.get(currency).unwrap_or(&self.default) };
        let fee = if amount.is_sign_positive() && !amount.is_zero() { p.fixed + amount * p.rate } else { p.refund };
        crate::currency::rounded(fee, crate::currency::places_or_two(currency))
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

/// Rows decoded from a result's payload or a checkpoint part, packed: their ids and currencies end to
/// end in one string and a fixed 56-byte entry per row, not two owned strings each (a batch of ten
/// 50,000-row results held at once is 30 MB, not 75 MB in a million small allocations).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowBatch {
    text: String,
    rows: Vec<Packed>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed {
    start: usize,
    id_len: u32,
    currency_len: u32,
    sums: Sums,
}

impl RowBatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, account_id: &str, currency: &str, count: u64, gross: Decimal, fees: Decimal) {
        let len32 = |s: &str| u32::try_from(s.len()).expect("an id under 4 GB");
        self.rows.push(Packed { start: self.text.len(), id_len: len32(account_id), currency_len: len32(currency), sums: Sums { count, gross, fees } });
        self.text.push_str(account_id);
        self.text.push_str(currency);
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows, borrowed, in the order they were pushed.
    pub fn iter(&self) -> impl Iterator<Item = RowRef<'_>> + Clone + '_ {
        self.rows.iter().map(|p| {
            let (id_end, end) = (p.start + p.id_len as usize, p.start + p.id_len as usize + p.currency_len as usize);
            RowRef::of(&self.text[p.start..id_end], &self.text[id_end..end], &p.sums)
        })
    }

    /// The sum of the rows' counts, unless it does not fit.
    pub fn transactions(&self) -> Option<u64> {
        self.rows.iter().try_fold(0u64, |n, p| n.checked_add(p.sums.count))
    }

    /// Owned copies of the rows.
    pub fn to_vec(&self) -> Vec<AccountTotals> {
        self.iter().map(|r| r.to_totals()).collect()
    }
}

impl<'a> FromIterator<RowRef<'a>> for RowBatch {
    fn from_iter<I: IntoIterator<Item = RowRef<'a>>>(rows: I) -> Self {
        let mut b = RowBatch::new();
        for r in rows {
            b.push(r.account_id, r.currency, r.count, r.gross, r.fees);
        }
        b
    }
}

/// The rows of a [`Totals`] in order (account_id, then currency, byte order), borrowed from it:
/// four bytes per account (a million accounts' order is 4 MB, not a copy of their rows).
#[derive(Debug)]
pub struct SortedRows<'a> {
    totals: &'a Totals,
    accounts: Vec<u32>,
}

impl<'a> SortedRows<'a> {
    /// Number of (account, currency) rows.
    pub fn len(&self) -> usize {
        self.totals.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.totals.rows.is_empty()
    }

    /// The rows, in order (an account's currencies are kept sorted by [`Totals`]).
    pub fn iter(&self) -> impl Iterator<Item = RowRef<'a>> + '_ {
        let t = self.totals;
        self.accounts.iter().flat_map(move |&a| t.chain(a))
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
/// added in any order. Looked up by `&str`, so adding a transaction allocates only when a new
/// (account, currency) appears.
///
/// Kept dense, because a job may have a million accounts and the controller holds every open job's:
/// the account ids end to end in one string, a 16-byte entry per account, a table of `u32` indexes to
/// find them, and a 48-byte row per (account, currency), chained per account in currency order, with
/// the currency interned. About 80 bytes per account plus its id, against about 200 for a hash map of
/// boxed ids to vectors of owned rows.
#[derive(Clone, Default)]
pub struct Totals {
    /// Every account id, end to end.
    ids: String,
    accounts: Vec<Account>,
    /// Indexes into `accounts`, hashed by the account's id.
    index: hashbrown::HashTable<u32>,
    hasher: foldhash::fast::RandomState,
    rows: Vec<Row>,
    /// Interned currencies, by index; `currency_ids` finds one by name.
    currencies: Vec<Box<str>>,
    currency_ids: foldhash::HashMap<Box<str>, u32>,
}

/// Where an account's id is in [`Totals::ids`], and its first row.
#[derive(Debug, Clone, Copy)]
struct Account {
    id_start: u64,
    id_len: u32,
    first: u32,
}

/// One (account, currency)'s sums, and the account's next row ([`NO_ROW`] for none).
#[derive(Debug, Clone, Copy)]
struct Row {
    sums: Sums,
    currency: u32,
    next: u32,
}

const NO_ROW: u32 = u32::MAX;

impl std::fmt::Debug for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Totals").field("accounts", &self.accounts.len()).field("rows", &self.rows.len()).finish()
    }
}

/// Counts that index a `u32` (rows, accounts, currencies): four billion would need hundreds of GB.
fn index32(n: usize) -> u32 {
    u32::try_from(n).ok().filter(|&i| i != NO_ROW).expect("fewer than 2^32 - 1 accounts, rows and currencies")
}

impl Totals {
    pub fn new() -> Self {
        Self::default()
    }

    fn id(&self, a: u32) -> &str {
        id_in(&self.ids, &self.accounts, a)
    }

    fn find(&self, account: &str) -> Option<u32> {
        let h = self.hasher.hash_one(account);
        self.index.find(h, |&a| self.id(a) == account).copied()
    }

    /// The account's index, added when it is new.
    fn account(&mut self, account: &str) -> u32 {
        let Totals { ids, accounts, index, hasher, .. } = self;
        let h = hasher.hash_one(account);
        match index.entry(h, |&a| id_in(ids, accounts, a) == account, |&a| hasher.hash_one(id_in(ids, accounts, a))) {
            hashbrown::hash_table::Entry::Occupied(e) => *e.get(),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let a = index32(accounts.len());
                let id_len = u32::try_from(account.len()).expect("an account id under 4 GB");
                accounts.push(Account { id_start: ids.len() as u64, id_len, first: NO_ROW });
                ids.push_str(account);
                e.insert(a);
                a
            }
        }
    }

    fn intern(&mut self, currency: &str) -> u32 {
        if let Some(&c) = self.currency_ids.get(currency) {
            return c;
        }
        let c = index32(self.currencies.len());
        self.currencies.push(currency.into());
        self.currency_ids.insert(currency.into(), c);
        c
    }

    fn slot(&mut self, account: &str, currency: &str) -> &mut Sums {
        self.slot_of(account, currency).1
    }

    /// The account's index and the sums of its row in `currency`, both added when new.
    fn slot_of(&mut self, account: &str, currency: &str) -> (u32, &mut Sums) {
        let a = self.account(account);
        // An account's rows are chained in currency byte order, so rows read out sorted as they are.
        let (mut prev, mut cur) = (NO_ROW, self.accounts[a as usize].first);
        while cur != NO_ROW {
            let r = &self.rows[cur as usize];
            match self.currencies[r.currency as usize].as_bytes().cmp(currency.as_bytes()) {
                std::cmp::Ordering::Equal => return (a, &mut self.rows[cur as usize].sums),
                std::cmp::Ordering::Greater => break,
                std::cmp::Ordering::Less => (prev, cur) = (cur, r.next),
            }
        }
        let c = self.intern(currency);
        let new = index32(self.rows.len());
        self.rows.push(Row { sums: Sums::default(), currency: c, next: cur });
        if prev == NO_ROW {
            self.accounts[a as usize].first = new;
        } else {
            self.rows[prev as usize].next = new;
        }
        (a, &mut self.rows[new as usize].sums)
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

    /// Adds a borrowed row; returns its account's index.
    fn add_row(&mut self, r: RowRef<'_>) -> u32 {
        let (a, s) = self.slot_of(r.account_id, r.currency);
        s.count += r.count;
        s.gross += r.gross;
        s.fees += r.fees;
        a
    }

    /// Replaces the sums of the row's (account, currency) with the row's.
    fn set(&mut self, r: RowRef<'_>) {
        *self.slot(r.account_id, r.currency) = Sums { count: r.count, gross: r.gross, fees: r.fees };
    }

    /// The rows of account `a` (by index), in currency order.
    fn chain(&self, a: u32) -> impl Iterator<Item = RowRef<'_>> + '_ {
        // A row taken back to a count of zero (`CheckedTotals::try_subtract`) is not listed.
        self.chain_all(a).filter(|r| r.count > 0)
    }

    /// An account's rows, those at a count of zero included (what a checkpoint's part of changed
    /// rows writes, so that a restore replaces the row's earlier value with the zero).
    fn chain_all(&self, a: u32) -> impl Iterator<Item = RowRef<'_>> + '_ {
        let id = self.id(a);
        let mut next = self.accounts[a as usize].first;
        std::iter::from_fn(move || {
            let r = self.rows.get(next as usize)?;
            next = r.next;
            Some(RowRef::of(id, &self.currencies[r.currency as usize], &r.sums))
        })
    }

    /// The rows of one account (one per currency), empty when it has none.
    pub fn account_rows<'a>(&'a self, account: &str) -> impl Iterator<Item = RowRef<'a>> + 'a {
        self.find(account).into_iter().flat_map(move |a| self.chain_all(a))
    }

    fn peek(&self, account: &str, currency: &str) -> Sums {
        let row = self.account_rows(account).find(|r| r.currency == currency);
        row.map(|r| Sums { count: r.count, gross: r.gross, fees: r.fees }).unwrap_or_default()
    }

    /// Number of (account, currency) rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Every row, accounts in the order they came.
    fn iter(&self) -> impl Iterator<Item = RowRef<'_>> {
        (0..index32(self.accounts.len())).flat_map(move |a| self.chain(a))
    }

    /// Rows sorted by account_id then currency (byte order), borrowed.
    pub fn sorted_rows(&self) -> SortedRows<'_> {
        let mut accounts: Vec<u32> = (0..index32(self.accounts.len())).collect();
        accounts.sort_unstable_by(|&x, &y| self.id(x).as_bytes().cmp(self.id(y).as_bytes()));
        SortedRows { totals: self, accounts }
    }

    /// Rows sorted by account_id then currency (byte order).
    pub fn rows(&self) -> Vec<AccountTotals> {
        self.sorted_rows().iter().map(|r| r.to_totals()).collect()
    }

    /// Per-currency sums, sorted by currency.
    pub fn by_currency(&self) -> Vec<AccountTotals> {
        let mut cur: BTreeMap<&str, Sums> = BTreeMap::new();
        for r in &self.rows {
            let t = cur.entry(&self.currencies[r.currency as usize]).or_default();
            t.count += r.sums.count;
            t.gross += r.sums.gross;
            t.fees += r.sums.fees;
        }
        cur.into_iter()
            .filter(|(_, s)| s.count > 0)
            .map(|(c, s)| AccountTotals { account_id: String::new(), currency: c.to_string(), count: s.count, gross: s.gross, fees: s.fees })
            .collect()
    }

    /// Transactions counted (saturating: each currency's count fits, their sum need not).
    pub fn transactions(&self) -> u64 {
        self.rows.iter().fold(0u64, |n, r| n.saturating_add(r.sums.count))
    }
}

fn id_in<'a>(ids: &'a str, accounts: &[Account], a: u32) -> &'a str {
    let acc = &accounts[a as usize];
    let start = acc.id_start as usize;
    &ids[start..start + acc.id_len as usize]
}

/// Totals fed with rows from queues (the controller's): every addition is checked, all or nothing,
/// against the account's and the currency's running sums, so that no sum a report shows (an account,
/// a currency over its accounts, their net) can overflow. The per-currency sums are kept here, off
/// the per-transaction path of [`Totals::add_txn`]. It also marks the accounts that additions change
/// (one bit each), for a checkpoint that writes only those.
#[derive(Debug, Clone, Default)]
pub struct CheckedTotals {
    totals: Totals,
    by_currency: Vec<(String, Sums)>,
    /// One bit per account (by index): changed since [`CheckedTotals::clear_changed`].
    changed: Vec<u64>,
    changed_accounts: usize,
}

impl CheckedTotals {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the rows, or nothing when a sum would overflow (the first such row is named).
    pub fn try_add_all<'a>(&mut self, rows: impl IntoIterator<Item = RowRef<'a>> + Clone) -> Result<(), Overflow> {
        let mut accounts: HashMap<(&str, &str), Sums> = HashMap::new();
        let mut currencies: HashMap<&str, Sums> = HashMap::new();
        for a in rows.clone() {
            let over = |what| Overflow { account: a.account_id.to_string(), currency: a.currency.to_string(), what };
            let cur = accounts.get(&(a.account_id, a.currency)).copied().unwrap_or_else(|| self.totals.peek(a.account_id, a.currency));
            accounts.insert((a.account_id, a.currency), cur.checked_plus(a.count, a.gross, a.fees).ok_or_else(|| over("a sum"))?);
            let cur = currencies.get(a.currency).copied().unwrap_or_else(|| self.currency(a.currency));
            currencies.insert(a.currency, cur.checked_plus(a.count, a.gross, a.fees).ok_or_else(|| over("the currency's sum"))?);
        }
        for r in rows {
            let a = self.totals.add_row(r) as usize;
            if self.changed.len() <= a / 64 {
                self.changed.resize(a / 64 + 1, 0);
            }
            let bit = 1u64 << (a % 64);
            if self.changed[a / 64] & bit == 0 {
                self.changed[a / 64] |= bit;
                self.changed_accounts += 1;
            }
        }
        for (c, s) in currencies {
            match self.by_currency.iter_mut().find(|(k, _)| k == c) {
                Some((_, t)) => *t = s,
                None => self.by_currency.push((c.to_string(), s)),
            }
        }
        Ok(())
    }

    /// Takes rows back out (a job's rows that another job billed first): each must be within what
    /// its (account, currency) holds, else nothing is taken and the first that is not is named. A row
    /// left at a count of zero is no longer listed.
    pub fn try_subtract(&mut self, rows: &[AccountTotals]) -> Result<(), Overflow> {
        let mut left: HashMap<(&str, &str), Sums> = HashMap::new();
        for a in rows {
            let over = || Overflow { account: a.account_id.clone(), currency: a.currency.clone(), what: "a subtraction" };
            let cur = left.get(&(a.account_id.as_str(), a.currency.as_str())).copied().unwrap_or_else(|| self.totals.peek(&a.account_id, &a.currency));
            let next = Sums {
                count: cur.count.checked_sub(a.count).ok_or_else(over)?,
                gross: cur.gross.checked_sub(a.gross).ok_or_else(over)?,
                fees: cur.fees.checked_sub(a.fees).ok_or_else(over)?,
            };
            // What is taken out is what was billed: no transaction left means no money left.
            if next.count == 0 && (!next.gross.is_zero() || !next.fees.is_zero()) {
                return Err(over());
            }
            left.insert((a.account_id.as_str(), a.currency.as_str()), next);
        }
        for a in rows {
            let (i, s) = self.totals.slot_of(&a.account_id, &a.currency);
            s.count -= a.count;
            s.gross -= a.gross;
            s.fees -= a.fees;
            let i = i as usize;
            if self.changed.len() <= i / 64 {
                self.changed.resize(i / 64 + 1, 0);
            }
            if self.changed[i / 64] & (1 << (i % 64)) == 0 {
                self.changed[i / 64] |= 1 << (i % 64);
                self.changed_accounts += 1;
            }
            if let Some((_, t)) = self.by_currency.iter_mut().find(|(k, _)| *k == a.currency) {
                t.count -= a.count;
                t.gross -= a.gross;
                t.fees -= a.fees;
            }
        }
        Ok(())
    }

    /// Accounts changed since the last [`CheckedTotals::clear_changed`] (or since the totals were
    /// restored).
    pub fn changed_accounts(&self) -> usize {
        self.changed_accounts
    }

    /// The rows of the changed accounts, accounts in the order they first came.
    pub fn changed_rows(&self) -> impl Iterator<Item = RowRef<'_>> + '_ {
        let words = self.changed.iter().enumerate().filter(|(_, w)| **w != 0);
        let accounts = words.flat_map(|(i, &w)| (0..64u32).filter(move |b| w & (1 << b) != 0).map(move |b| i as u32 * 64 + b));
        accounts.flat_map(|a| self.totals.chain_all(a))
    }

    pub fn clear_changed(&mut self) {
        self.changed.clear();
        self.changed_accounts = 0;
    }

    /// Totals restored from snapshots of rows (a checkpoint and the parts written after it): each row
    /// replaces what an earlier batch held for its (account, currency). Fails when a per-currency sum
    /// (or a row's net) would overflow, which only a corrupt or hostile snapshot can cause.
    pub fn restore<'a, B>(batches: impl IntoIterator<Item = B>) -> Result<CheckedTotals, Overflow>
    where
        B: IntoIterator<Item = RowRef<'a>>,
    {
        let mut totals = Totals::new();
        for batch in batches {
            for row in batch {
                totals.set(row);
            }
        }
        let mut by_currency: Vec<(String, Sums)> = Vec::new();
        for r in totals.iter() {
            let over = |what| Overflow { account: r.account_id.to_string(), currency: r.currency.to_string(), what };
            Sums::default().checked_plus(r.count, r.gross, r.fees).ok_or_else(|| over("a sum"))?;
            let i = match by_currency.iter().position(|(k, _)| k == r.currency) {
                Some(i) => i,
                None => {
                    by_currency.push((r.currency.to_string(), Sums::default()));
                    by_currency.len() - 1
                }
            };
            by_currency[i].1 = by_currency[i].1.checked_plus(r.count, r.gross, r.fees).ok_or_else(|| over("the currency's sum"))?;
        }
        Ok(CheckedTotals { totals, by_currency, changed: Vec::new(), changed_accounts: 0 })
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

/// Formats an amount in `currency` with exactly the currency's places (`-12.50` EUR, `1500` JPY,
/// `3.250` BHD).
pub fn money(d: Decimal, currency: &str) -> String {
    crate::currency::rounded(d, crate::currency::places_or_two(currency)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::parse_amount;

    fn fee(amount: &str) -> String {
        money(Tariff::default().calculator().fee(parse_amount(amount, 2, "EUR").unwrap(), "EUR"), "EUR")
    }

    /// Each fee rounded once, in its currency's unit, half away from zero; worked by hand.
    #[test]
    fn fees_in_each_currency_unit() {
        let t: Tariff = serde_json::from_str(
            r#"{"fixed_fee":"0.30","percent":"2.9","currencies":{"JPY":{"fixed_fee":"40","percent":"3.6"},"BHD":{"fixed_fee":"0.115","percent":"2.5","refund_fee":"0.05"}}}"#,
        )
        .unwrap();
        t.check().unwrap();
        let c = t.calculator();
        let fee = |amount: &str, cur: &str, places| money(c.fee(parse_amount(amount, places, cur).unwrap(), cur), cur);
        assert_eq!(fee("1500", "JPY", 0), "94"); // 40 + 54
        assert_eq!(fee("125", "JPY", 0), "45"); // 40 + 4.5: half away from zero (half to even: 44)
        assert_eq!(fee("1", "JPY", 0), "40"); // 40 + 0.036
        assert_eq!(fee("-300", "JPY", 0), "0");
        assert_eq!(fee("12.345", "BHD", 3), "0.424"); // 0.115 + 0.308625
        assert_eq!(fee("0.100", "BHD", 3), "0.118"); // 0.115 + 0.0025 = 0.1175
        assert_eq!(fee("0.02", "BHD", 3), "0.116"); // 0.115 + 0.0005
        assert_eq!(fee("-1", "BHD", 3), "0.050");
        assert_eq!(fee("10", "EUR", 2), "0.59");
        // The default rates in a currency without cents: 0.30 + 2.9% of 100 yen = 3.20, billed 3.
        assert_eq!(Tariff::default().calculator().fee(Decimal::from(100), "JPY").to_string(), "3");
        let half_yen: Tariff = serde_json::from_str(r#"{"fixed_fee":"0","percent":"1","currencies":{"JPY":{"fixed_fee":"0.5","percent":"1"}}}"#).unwrap();
        assert_eq!(half_yen.check().unwrap_err(), "JPY: fixed_fee 0.5 has more decimals than JPY's 0 (ISO 4217 minor unit)");
        let unknown: Tariff = serde_json::from_str(r#"{"fixed_fee":"0","percent":"1","currencies":{"ABC":{"fixed_fee":"1","percent":"1"}}}"#).unwrap();
        assert!(unknown.check().unwrap_err().contains("not an ISO 4217 currency code"));
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
        assert_eq!(money(c.fee(Decimal::new(10000, 2), "EUR"), "EUR"), "1.65");
        assert_eq!(money(c.fee(Decimal::new(10000, 2), "GBP"), "GBP"), "2.70");
        assert_eq!(money(c.fee(Decimal::new(-10000, 2), "EUR"), "EUR"), "0.10");
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
        assert_eq!(money(out[2].gross, "EUR"), "3.00");
        assert_eq!(money(out[2].net(), "EUR"), "2.70");
        let cur = fwd.by_currency();
        assert_eq!(cur.len(), 2);
        assert_eq!(cur[0].currency, "EUR");
        assert_eq!(cur[0].count, 5);
        assert_eq!(fwd.transactions(), 7);
    }

    /// The dense table against a plain ordered map, on seeded rows: many accounts (the index grows
    /// past several rehashes), several currencies per account arriving in any order, ids of any length.
    #[test]
    fn dense_totals_agree_with_an_ordered_map() {
        use rand::{Rng, SeedableRng};
        for seed in 0..20u64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let currencies = ["USD", "EUR", "GBP", "JPY", "AUD", "ZZZ", "A"];
            let mut model: BTreeMap<(String, String), (u64, i64, i64)> = BTreeMap::new();
            let mut t = Totals::new();
            for _ in 0..rng.random_range(0..5_000) {
                let n = rng.random_range(0..2_000u32);
                let account = format!("{}{n}", "x".repeat(n as usize % 13));
                let currency = currencies[rng.random_range(0..currencies.len())];
                let (count, g, f) = (rng.random_range(1..5u64), rng.random_range(-10_000..10_000i64), rng.random_range(0..100i64));
                let row = AccountTotals { account_id: account.clone(), currency: currency.into(), count, gross: Decimal::new(g, 2), fees: Decimal::new(f, 2) };
                t.add(&row);
                let m = model.entry((account, currency.into())).or_default();
                *m = (m.0 + count, m.1 + g, m.2 + f);
            }
            let want: Vec<AccountTotals> = model
                .iter()
                .map(|((a, c), &(n, g, f))| AccountTotals {
                    account_id: a.clone(),
                    currency: c.clone(),
                    count: n,
                    gross: Decimal::new(g, 2),
                    fees: Decimal::new(f, 2),
                })
                .collect();
            assert_eq!(t.rows(), want, "seed {seed}");
            assert_eq!(t.len(), want.len());
            assert_eq!(t.transactions(), want.iter().map(|r| r.count).sum::<u64>());
            for r in want.iter().step_by(7) {
                let mine: Vec<AccountTotals> = t.account_rows(&r.account_id).map(|x| x.to_totals()).collect();
                assert_eq!(mine, want.iter().filter(|w| w.account_id == r.account_id).cloned().collect::<Vec<_>>());
                assert_eq!(t.peek(&r.account_id, &r.currency).count, r.count);
            }
            assert_eq!(t.account_rows("absent").count(), 0);
            assert_eq!(t.clone().rows(), want, "a clone finds its accounts with the same hasher");
        }
    }

    #[test]
    fn restore_lets_later_rows_replace_earlier_ones_and_checks_currency_sums() {
        let row =
            |a: &str, c: &str, n, g: i64| AccountTotals { account_id: a.into(), currency: c.into(), count: n, gross: Decimal::new(g, 2), fees: Decimal::ZERO };
        let mut live = CheckedTotals::new();
        let first = [row("a", "EUR", 1, 100), row("b", "EUR", 2, 200)];
        live.try_add_all(first.iter().map(AccountTotals::borrowed)).unwrap();
        let base = live.rows();
        live.clear_changed();
        let second = [row("a", "EUR", 4, 400), row("c", "USD", 1, 5)];
        live.try_add_all(second.iter().map(AccountTotals::borrowed)).unwrap();
        // What changed since the base: the rows of the accounts touched, as they now stand.
        let changed: RowBatch = live.changed_rows().collect();
        assert_eq!(changed.len(), 2);
        assert_eq!(live.changed_accounts(), 2);
        let restored = CheckedTotals::restore([base.iter().map(AccountTotals::borrowed).collect::<RowBatch>().iter(), changed.iter()]).unwrap();
        assert_eq!(restored.changed_accounts(), 0, "restored totals have changed nothing yet");
        assert_eq!(restored.rows(), live.rows());
        assert_eq!(restored.by_currency(), live.by_currency());
        // The restored currency sums are the ones later additions are checked against.
        let mut restored = restored;
        let huge = [row("z", "EUR", 1, 0)];
        let mut near = huge.clone();
        near[0].gross = Decimal::MAX - Decimal::new(100, 2);
        assert!(restored.try_add_all(near.iter().map(AccountTotals::borrowed)).is_err(), "EUR already sums 7.00: MAX - 1.00 more would overflow");
        let bad = [row("x", "EUR", 1, 0), row("y", "EUR", 1, 0)].map(|mut r| {
            r.gross = Decimal::MAX;
            r
        });
        let e = CheckedTotals::restore([bad.iter().map(AccountTotals::borrowed)]).unwrap_err();
        assert_eq!(e.what, "the currency's sum");
    }

    #[test]
    fn subtracting_takes_rows_back_out_all_or_nothing() {
        let row =
            |a: &str, c: &str, n, g: i64| AccountTotals { account_id: a.into(), currency: c.into(), count: n, gross: Decimal::new(g, 2), fees: Decimal::ZERO };
        let mut t = CheckedTotals::new();
        let rows = [row("a", "EUR", 2, 300), row("b", "EUR", 1, 100), row("b", "USD", 1, 50)];
        t.try_add_all(rows.iter().map(AccountTotals::borrowed)).unwrap();
        // More than b's USD holds, or all its transactions but not all its money: nothing is taken.
        assert!(t.try_subtract(&[row("a", "EUR", 1, 100), row("b", "USD", 2, 50)]).is_err());
        assert!(t.try_subtract(&[row("a", "EUR", 1, 100), row("b", "USD", 1, 49)]).is_err());
        assert_eq!(t.totals.transactions(), 4);
        t.try_subtract(&[row("a", "EUR", 1, 100), row("b", "USD", 1, 50)]).unwrap();
        let left: Vec<(String, String, u64)> = t.totals.rows().into_iter().map(|r| (r.account_id, r.currency, r.count)).collect();
        assert_eq!(left, [("a".into(), "EUR".into(), 1), ("b".into(), "EUR".into(), 1)], "b's USD row, at zero, is no longer listed");
        assert_eq!(t.totals.by_currency().iter().map(|c| (c.currency.as_str(), c.count)).collect::<Vec<_>>(), [("EUR", 2)]);
        assert_eq!(t.changed_accounts(), 2);
        // A checkpoint's part of changed rows carries the zero, so a restore from an earlier base
        // and that part does not bring b's USD back.
        let base = [row("a", "EUR", 2, 300), row("b", "EUR", 1, 100), row("b", "USD", 1, 50)];
        let changed: RowBatch = t.changed_rows().map(|r| r.to_totals()).collect::<Vec<_>>().iter().map(AccountTotals::borrowed).collect();
        assert!(changed.iter().any(|r| r.account_id == "b" && r.currency == "USD" && r.count == 0));
        let restored = CheckedTotals::restore([base.iter().map(AccountTotals::borrowed).collect::<RowBatch>().iter(), changed.iter()]).unwrap();
        assert_eq!(restored.totals.rows(), t.totals.rows());
    }

    #[test]
    fn money_format() {
        assert_eq!(money(Decimal::new(-1250, 3), "EUR"), "-1.25");
        assert_eq!(money(Decimal::new(5, 0), "EUR"), "5.00");
        assert_eq!(money(Decimal::new(-0, 2), "EUR"), "0.00");
        assert_eq!(money(Decimal::new(1500, 0), "JPY"), "1500");
        assert_eq!(money(Decimal::new(325, 2), "BHD"), "3.250");
        assert_eq!(money(Decimal::new(5, 0), "CLF"), "5.0000");
    }
}
