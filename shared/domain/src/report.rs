//! Why: the report is the job's one answer, read by people (the summary), programs (`--json`, the
//! status page) and the warehouse (`accounts.csv`); its shape, its sort orders and its request cost are
//! decided here once, so every reader sees the same document.
//!
//! The job report: the JSON document written to `warehouse/{job}/report.json`, the `accounts.csv`
//! beside it, and the human summary the initiator prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::billing::{money, SortedRows, Tariff, Totals};
use crate::model::{FailedChunk, JobStatus, Manifest, Rejected};
use crate::prices::{ByClass, Prices};
use crate::requests::{RequestCounts, Service};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnCounts {
    pub submitted: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub processed: u64,
    pub failed: u64,
    /// Accepted rows not billed because another job billed their `txn_id` first (each listed in
    /// `rejected` with that job).
    #[serde(default)]
    pub duplicates: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurrencyRow {
    pub currency: String,
    pub count: u64,
    pub gross: String,
    pub fees: String,
    pub net: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountRow {
    pub account_id: String,
    pub currency: String,
    pub count: u64,
    pub gross: String,
    pub fees: String,
    pub net: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestsReport {
    pub sqs: BTreeMap<String, u64>,
    pub s3: BTreeMap<String, u64>,
    pub total: u64,
    /// Total per 1,000 submitted transactions, three decimals.
    pub per_1000_transactions: String,
    /// What these requests cost at the controller's price table (absent from reports written before
    /// it had one, and from `initiator local`'s, which makes none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<CostReport>,
}

/// A job's requests as billed and what they cost, USD (decimal strings, at most 8 places).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostReport {
    /// SQS requests to standard queues as billed: calls plus their payloads' further 64 KiB chunks.
    pub sqs_requests: u64,
    /// The same to FIFO queues (a `--group-by` job's work queue), at the FIFO price.
    #[serde(default)]
    pub sqs_fifo_requests: u64,
    /// S3 PUT-class (PUT, COPY, POST, LIST) and GET-class (GET, HEAD, the rest) requests; DELETE is free.
    pub s3_put_requests: u64,
    pub s3_get_requests: u64,
    pub sqs_usd: String,
    pub s3_usd: String,
    pub total_usd: String,
    /// The total per million submitted transactions (none for an empty job).
    pub per_million_transactions_usd: Option<String>,
    /// The prices used.
    pub prices: Prices,
}

/// A USD amount as the report shows it: at most 8 decimal places, no trailing zeros.
fn usd(d: rust_decimal::Decimal) -> String {
    d.round_dp(8).normalize().to_string()
}

impl RequestsReport {
    pub fn from_counts(c: &RequestCounts, transactions: u64) -> RequestsReport {
        let total = c.total();
        let per = if transactions == 0 { 0 } else { (u128::from(total) * 1_000_000 / u128::from(transactions)) as u64 };
        RequestsReport {
            sqs: c.by_service(Service::Sqs),
            s3: c.by_service(Service::S3),
            total,
            per_1000_transactions: format!("{}.{:03}", per / 1000, per % 1000),
            cost: None,
        }
    }

    /// Prices these requests, `counts` (of a job of `transactions` submitted transactions), at
    /// `prices`: the table reads what each request is, not the name a report lists it under.
    pub fn set_cost(&mut self, prices: &Prices, counts: &RequestCounts, transactions: u64) {
        let billed = ByClass::of(counts);
        let cost = prices.cost(billed);
        self.cost = Some(CostReport {
            sqs_requests: billed.sqs,
            sqs_fifo_requests: billed.sqs_fifo,
            s3_put_requests: billed.s3_put,
            s3_get_requests: billed.s3_get,
            sqs_usd: usd(cost.sqs),
            s3_usd: usd(cost.s3),
            total_usd: usd(cost.total()),
            per_million_transactions_usd: cost.per_million(transactions).map(usd),
            prices: *prices,
        });
    }
}

/// A job's report. `A` holds its account rows: owned [`AccountRow`]s when read back, or [`Accounts`]
/// borrowed from the totals when the controller writes it (a job of a million accounts is not copied
/// into a million owned rows first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report<A = Vec<AccountRow>> {
    pub job_id: String,
    pub status: JobStatus,
    pub created_at: String,
    pub finished_at: String,
    pub files: Vec<String>,
    pub transactions: TxnCounts,
    pub totals: Vec<CurrencyRow>,
    pub accounts: A,
    pub rejected: Vec<Rejected>,
    pub failed_chunks: Vec<FailedChunk>,
    pub requests: RequestsReport,
    pub tariff: Tariff,
    /// Why the job ended as it did, when that is not plain (abandoned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The job whose failed chunks this one billed again (`initiator retry`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completes: Option<String>,
}

/// The account rows of a report as it is written: borrowed from the job's totals and sorted, each
/// row's money formatted only as it is serialized (JSON) or written (CSV).
#[derive(Debug)]
pub struct Accounts<'a>(SortedRows<'a>);

/// One account row as the report shows it (serialized exactly as an [`AccountRow`]).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RowText<'r> {
    pub account_id: &'r str,
    pub currency: &'r str,
    pub count: u64,
    pub gross: &'r str,
    pub fees: &'r str,
    pub net: &'r str,
}

/// The account rows of a report, owned or borrowed: what `accounts.csv` and the summary are made from.
pub trait AccountRows {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Calls `f` with each row, in order.
    fn each(&self, f: &mut dyn FnMut(RowText<'_>));
    /// The bytes of the rows' account ids and currencies (to size an output buffer).
    fn text_bytes(&self) -> usize;
}

impl AccountRows for Vec<AccountRow> {
    fn len(&self) -> usize {
        <[AccountRow]>::len(self)
    }

    fn each(&self, f: &mut dyn FnMut(RowText<'_>)) {
        for a in self {
            f(RowText { account_id: &a.account_id, currency: &a.currency, count: a.count, gross: &a.gross, fees: &a.fees, net: &a.net });
        }
    }

    fn text_bytes(&self) -> usize {
        self.iter().map(|a| a.account_id.len() + a.currency.len()).sum()
    }
}

impl AccountRows for Accounts<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn each(&self, f: &mut dyn FnMut(RowText<'_>)) {
        for r in self.0.iter() {
            let (gross, fees, net) = (money(r.gross, &r.currency), money(r.fees, &r.currency), money(r.net(), &r.currency));
            f(RowText { account_id: r.account_id, currency: r.currency, count: r.count, gross: &gross, fees: &fees, net: &net });
        }
    }

    fn text_bytes(&self) -> usize {
        self.0.iter().map(|r| r.account_id.len() + r.currency.len()).sum()
    }
}

impl Accounts<'_> {
    pub fn to_rows(&self) -> Vec<AccountRow> {
        let mut out = Vec::with_capacity(self.0.len());
        self.each(&mut |r| {
            out.push(AccountRow {
                account_id: r.account_id.to_string(),
                currency: r.currency.to_string(),
                count: r.count,
                gross: r.gross.to_string(),
                fees: r.fees.to_string(),
                net: r.net.to_string(),
            })
        });
        out
    }
}

/// Serialized exactly as a `Vec<AccountRow>` is.
impl Serialize for Accounts<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq as _;
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        let mut failed = None;
        self.each(&mut |r| {
            if failed.is_none() {
                failed = seq.serialize_element(&r).err();
            }
        });
        match failed {
            Some(e) => Err(e),
            None => seq.end(),
        }
    }
}

/// Builds the report of a finished job.
pub fn build(manifest: &Manifest, totals: &Totals, failed_chunks: Vec<FailedChunk>, requests: &RequestCounts) -> Report {
    build_borrowed(manifest, totals, failed_chunks, requests).map_accounts(|a| a.to_rows())
}

/// Builds the report of a finished job with its account rows borrowed from `totals`.
pub fn build_borrowed<'a>(manifest: &Manifest, totals: &'a Totals, mut failed_chunks: Vec<FailedChunk>, requests: &RequestCounts) -> Report<Accounts<'a>> {
    failed_chunks.sort_by_key(|f| f.chunk);
    for f in &mut failed_chunks {
        if f.lines.is_empty() {
            f.lines = manifest.chunk_source(f.chunk);
        }
    }
    // Counts from messages: saturating, never wrapping (a hostile count cannot turn a sum small).
    let failed: u64 = failed_chunks.iter().fold(0u64, |n, f| n.saturating_add(f.transactions));
    let processed = totals.transactions();
    let mut rejected = manifest.rejected.clone();
    rejected.sort_by(|a, b| (a.file.as_bytes(), a.line).cmp(&(b.file.as_bytes(), b.line)));
    let status = if failed_chunks.is_empty() { JobStatus::Complete } else { JobStatus::Partial };
    Report {
        job_id: manifest.job_id.clone(),
        status,
        created_at: manifest.created_at.clone(),
        finished_at: crate::model::now_rfc3339(),
        files: manifest.files.clone(),
        transactions: TxnCounts {
            submitted: manifest.submitted,
            accepted: manifest.accepted,
            rejected: manifest.rejected.len() as u64,
            processed,
            failed,
            duplicates: 0,
        },
        totals: totals
            .by_currency()
            .into_iter()
            .map(|t| CurrencyRow { currency: t.currency.clone(), count: t.count, gross: money(t.gross, &t.currency), fees: money(t.fees, &t.currency), net: money(t.net(), &t.currency) })
            .collect(),
        accounts: Accounts(totals.sorted_rows()),
        rejected,
        failed_chunks,
        requests: RequestsReport::from_counts(requests, manifest.submitted),
        tariff: manifest.tariff.clone(),
        note: None,
        completes: manifest.completes.clone(),
    }
}

impl<A> Report<A> {
    /// The same report with its account rows turned into `f(rows)`.
    pub fn map_accounts<B>(self, f: impl FnOnce(A) -> B) -> Report<B> {
        Report {
            job_id: self.job_id,
            status: self.status,
            created_at: self.created_at,
            finished_at: self.finished_at,
            files: self.files,
            transactions: self.transactions,
            totals: self.totals,
            accounts: f(self.accounts),
            rejected: self.rejected,
            failed_chunks: self.failed_chunks,
            requests: self.requests,
            tariff: self.tariff,
            completes: self.completes,
            note: self.note,
        }
    }
}

/// `report.json` (pretty-printed), into a buffer sized up front for its account rows (about 130 bytes
/// of layout per row besides its text): a report of a million rows is written once rather than copied
/// through the doublings of a growing buffer, and the part of the reserve never written is never
/// resident.
pub fn to_json<A: AccountRows + Serialize>(r: &Report<A>) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64 * 1024 + r.accounts.len() * 200 + r.accounts.text_bytes());
    write_json(r, &mut out)?;
    Ok(out)
}

/// `report.json` written as it is made (to a file: a report of a million accounts is never whole in
/// memory).
pub fn write_json<A: AccountRows + Serialize>(r: &Report<A>, w: impl std::io::Write) -> serde_json::Result<()> {
    serde_json::to_writer_pretty(w, r)
}

/// `accounts.csv`: the per-account rows of the report (its buffer sized up front as [`to_json`]'s).
pub fn accounts_csv<A: AccountRows>(r: &Report<A>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + r.accounts.len() * 64 + r.accounts.text_bytes());
    let _ = write_accounts_csv(r, &mut out);
    out
}

/// `accounts.csv` written as it is made (see [`write_json`]).
pub fn write_accounts_csv<A: AccountRows>(r: &Report<A>, out: impl std::io::Write) -> std::io::Result<()> {
    let mut w = csv::WriterBuilder::new().terminator(csv::Terminator::Any(b'\n')).from_writer(out);
    w.write_record(["account_id", "currency", "count", "gross", "fees", "net"])?;
    let mut count = String::new();
    let mut failed = None;
    r.accounts.each(&mut |a| {
        use std::fmt::Write as _;
        if failed.is_some() {
            return;
        }
        count.clear();
        let _ = write!(count, "{}", a.count);
        failed = w.write_record([a.account_id, a.currency, &count, a.gross, a.fees, a.net]).err();
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    w.flush()
}

/// A short human summary.
pub fn summary<A: AccountRows>(r: &Report<A>) -> String {
    let mut s = String::new();
    let t = &r.transactions;
    let _ = writeln!(
        s,
        "job {}: {}",
        r.job_id,
        match r.status {
            JobStatus::Complete => "complete",
            JobStatus::Partial => "PARTIAL (some chunks failed)",
            JobStatus::Running => "running",
            JobStatus::Abandoned => "ABANDONED (finished with what was processed)",
            JobStatus::Quarantined => "QUARANTINED (its state could not be read; see the note)",
        }
    );
    if let Some(note) = &r.note {
        let _ = writeln!(s, "note: {note}");
    }
    if let Some(job) = &r.completes {
        let _ = writeln!(s, "completes job {job}: its failed chunks billed again (`initiator retry`)");
    }
    let _ = writeln!(
        s,
        "transactions: {} submitted, {} accepted, {} rejected, {} processed, {} failed",
        t.submitted, t.accepted, t.rejected, t.processed, t.failed
    );
    if t.duplicates > 0 {
        let _ = writeln!(s, "duplicates: {} rows already billed by earlier jobs, not billed again (listed with the rejected rows)", t.duplicates);
    }
    if !r.totals.is_empty() {
        let _ = writeln!(s, "{:<8} {:>10} {:>18} {:>14} {:>18}", "currency", "count", "gross", "fees", "net");
        for c in &r.totals {
            let _ = writeln!(s, "{:<8} {:>10} {:>18} {:>14} {:>18}", c.currency, c.count, c.gross, c.fees, c.net);
        }
    }
    let _ = writeln!(s, "accounts: {} (account, currency) rows", r.accounts.len());
    if !r.rejected.is_empty() {
        let _ = writeln!(s, "rejected rows (first {} of {}):", r.rejected.len().min(10), r.rejected.len());
        for x in r.rejected.iter().take(10) {
            let _ = writeln!(s, "  {}:{} {}: {}", x.file, x.line, x.txn_id.as_deref().unwrap_or("-"), x.reason);
        }
    }
    for f in &r.failed_chunks {
        let lines: Vec<String> = f.lines.iter().map(|l| format!("{} lines {}-{}", l.file, l.first, l.last)).collect();
        let from = if lines.is_empty() { String::new() } else { format!(", from {}", lines.join(", ")) };
        let _ = writeln!(s, "failed chunk {} ({} transactions{from}): {}", f.chunk, f.transactions, f.reason);
    }
    if !r.failed_chunks.is_empty() && r.status == JobStatus::Partial {
        let _ = writeln!(s, "to bill the failed chunks once their cause is fixed: `initiator retry {}` (their blobs are kept for 30 days)", r.job_id);
    }
    let _ = writeln!(
        s,
        "requests: {} total (SQS {}, S3 {}), {} per 1,000 transactions",
        r.requests.total,
        r.requests.sqs.values().sum::<u64>(),
        r.requests.s3.values().sum::<u64>(),
        r.requests.per_1000_transactions
    );
    if let Some(c) = &r.requests.cost {
        let per_million = c.per_million_transactions_usd.as_deref().map(|p| format!(", ${p} per million transactions")).unwrap_or_default();
        let _ = writeln!(s, "request cost: ${} (SQS ${}, S3 ${}){per_million}, at {}", c.total_usd, c.sqs_usd, c.s3_usd, c.prices);
    }
    let _ = write!(s, "report: warehouse/{}/report.json, warehouse/{}/accounts.csv", r.job_id, r.job_id);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::billing::AccountTotals;
    use crate::requests::{Billed, Op};
    use rust_decimal::Decimal;

    #[test]
    fn report_counts_sorting_and_csv() {
        let manifest = Manifest {
            chunk_lines: Vec::new(),
            completes: None,
            partition: 0,
            v: 1,
            job_id: "j".into(),
            created_at: "2026-11-21T10:00:00Z".into(),
            files: vec!["b.csv".into(), "a.csv".into()],
            submitted: 6,
            accepted: 4,
            rejected: vec![
                Rejected { file: "b.csv".into(), line: 2, txn_id: None, reason: "x".into() },
                Rejected { file: "a.csv".into(), line: 9, txn_id: Some("t".into()), reason: "y".into() },
            ],
            total_chunks: 2,
            chunk_transactions: vec![3, 1],
            tariff: Tariff::default(),
            requests: RequestCounts::default(),
        };
        let mut totals = Totals::new();
        totals.add(&AccountTotals { account_id: "z\"q".into(), currency: "EUR".into(), count: 3, gross: Decimal::new(1000, 2), fees: Decimal::new(59, 2) });
        let mut req = RequestCounts::default();
        req.add(Billed::call(Op::SqsReceiveMessage), 2);
        req.add(Billed::call(Op::S3PutObject), 1);
        let r = build(&manifest, &totals, vec![FailedChunk { lines: Vec::new(), chunk: 1, transactions: 1, reason: "dlq".into() }], &req);
        assert_eq!(r.status, JobStatus::Partial);
        assert_eq!(r.transactions, TxnCounts { submitted: 6, accepted: 4, rejected: 2, processed: 3, failed: 1, duplicates: 0 });
        assert_eq!(r.transactions.accepted, r.transactions.processed + r.transactions.failed);
        assert_eq!(r.rejected[0].file, "a.csv");
        assert_eq!(r.totals[0].net, "9.41");
        assert_eq!(r.requests.total, 3);
        assert_eq!(r.requests.per_1000_transactions, "500.000");
        let csv = String::from_utf8(accounts_csv(&r)).unwrap();
        assert_eq!(csv, "account_id,currency,count,gross,fees,net\n\"z\"\"q\",EUR,3,10.00,0.59,9.41\n");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["status"], "partial");
        assert_eq!(json["accounts"][0]["gross"], "10.00");
        assert!(summary(&r).contains("failed chunk 1"));
        assert!(json["requests"].get("cost").is_none() && !summary(&r).contains("request cost"), "unpriced: no cost shown");

        // Priced: 2 SQS requests at $0.40/M and a PUT at $0.005/k, for 6 transactions.
        let mut r = r;
        r.requests.set_cost(&Prices::default(), &req, r.transactions.submitted);
        let c = r.requests.cost.clone().unwrap();
        assert_eq!((c.sqs_requests, c.s3_put_requests, c.s3_get_requests), (2, 1, 0));
        assert_eq!((c.sqs_usd.as_str(), c.s3_usd.as_str(), c.total_usd.as_str()), ("0.0000008", "0.000005", "0.0000058"));
        assert_eq!(c.per_million_transactions_usd.as_deref(), Some("0.96666667"));
        assert!(
            summary(&r).contains(
                "request cost: $0.0000058 (SQS $0.0000008, S3 $0.000005), $0.96666667 per million transactions, at sqs=0.40,sqs_fifo=0.50,s3_put=0.005,s3_get=0.0004"
            ),
            "{}",
            summary(&r)
        );
        let back: Report = serde_json::from_slice(&to_json(&r).unwrap()).unwrap();
        assert_eq!(back.requests.cost, r.requests.cost, "the cost reads back");
    }

    #[test]
    fn a_report_written_from_borrowed_rows_reads_back_as_the_owned_one() {
        let manifest = Manifest {
            chunk_lines: Vec::new(),
            completes: None,
            partition: 0,
            v: 1,
            job_id: "j".into(),
            created_at: "2026-11-21T10:00:00Z".into(),
            files: vec!["a.csv".into()],
            submitted: 9,
            accepted: 9,
            rejected: Vec::new(),
            total_chunks: 1,
            chunk_transactions: vec![9],
            tariff: Tariff::default(),
            requests: RequestCounts::default(),
        };
        let mut totals = Totals::new();
        for (a, c, n, g, f) in [("b", "USD", 2, 1999, 7), ("a,\"x", "EUR", 3, -500, 0), ("b", "EUR", 1, 1, 1), ("a", "USD", 3, 123_456_789, 12_345)] {
            totals.add(&AccountTotals { account_id: a.into(), currency: c.into(), count: n, gross: Decimal::new(g, 2), fees: Decimal::new(f, 2) });
        }
        let borrowed = build_borrowed(&manifest, &totals, Vec::new(), &RequestCounts::default());
        let json = to_json(&borrowed).unwrap();
        let csv = accounts_csv(&borrowed);
        let text = summary(&borrowed);
        let owned = borrowed.map_accounts(|a| a.to_rows());
        assert_eq!(json, serde_json::to_vec_pretty(&owned).unwrap(), "the same document, byte for byte");
        assert_eq!(csv, accounts_csv(&owned));
        assert_eq!(text, summary(&owned));
        let read: Report = serde_json::from_slice(&json).unwrap();
        assert_eq!(read, owned);
        let ids: Vec<(&str, &str, &str)> = read.accounts.iter().map(|a| (a.account_id.as_str(), a.currency.as_str(), a.net.as_str())).collect();
        assert_eq!(ids, vec![("a", "USD", "1234444.44"), ("a,\"x", "EUR", "-5.00"), ("b", "EUR", "0.00"), ("b", "USD", "19.92")]);
        let csv = String::from_utf8(csv).unwrap();
        assert_eq!(csv.lines().nth(2), Some("\"a,\"\"x\",EUR,3,-5.00,0.00,-5.00"));
    }
}
