//! The job report: the JSON document written to `warehouse/{job}/report.json`, the `accounts.csv`
//! beside it, and the human summary the initiator prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::billing::{money, Tariff, Totals};
use crate::model::{FailedChunk, JobStatus, Manifest, Rejected};
use crate::requests::RequestCounts;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnCounts {
    pub submitted: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub processed: u64,
    pub failed: u64,
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
}

impl RequestsReport {
    pub fn from_counts(c: &RequestCounts, transactions: u64) -> RequestsReport {
        let total = c.total();
        let per = if transactions == 0 { 0 } else { (u128::from(total) * 1_000_000 / u128::from(transactions)) as u64 };
        RequestsReport { sqs: c.by_service("sqs"), s3: c.by_service("s3"), total, per_1000_transactions: format!("{}.{:03}", per / 1000, per % 1000) }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub job_id: String,
    pub status: JobStatus,
    pub created_at: String,
    pub finished_at: String,
    pub files: Vec<String>,
    pub transactions: TxnCounts,
    pub totals: Vec<CurrencyRow>,
    pub accounts: Vec<AccountRow>,
    pub rejected: Vec<Rejected>,
    pub failed_chunks: Vec<FailedChunk>,
    pub requests: RequestsReport,
    pub tariff: Tariff,
    /// Why the job ended as it did, when that is not plain (abandoned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Builds the report of a finished job.
pub fn build(manifest: &Manifest, totals: &Totals, mut failed_chunks: Vec<FailedChunk>, requests: &RequestCounts) -> Report {
    failed_chunks.sort_by_key(|f| f.chunk);
    let failed: u64 = failed_chunks.iter().map(|f| f.transactions).sum();
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
        transactions: TxnCounts { submitted: manifest.submitted, accepted: manifest.accepted, rejected: manifest.rejected.len() as u64, processed, failed },
        totals: totals
            .by_currency()
            .into_iter()
            .map(|t| CurrencyRow { currency: t.currency.clone(), count: t.count, gross: money(t.gross), fees: money(t.fees), net: money(t.net()) })
            .collect(),
        accounts: totals
            .rows()
            .into_iter()
            .map(|t| AccountRow {
                net: money(t.net()),
                gross: money(t.gross),
                fees: money(t.fees),
                account_id: t.account_id,
                currency: t.currency,
                count: t.count,
            })
            .collect(),
        rejected,
        failed_chunks,
        requests: RequestsReport::from_counts(requests, manifest.submitted),
        tariff: manifest.tariff.clone(),
        note: None,
    }
}

/// `accounts.csv`: the per-account rows of the report.
pub fn accounts_csv(r: &Report) -> Vec<u8> {
    let mut w = csv::WriterBuilder::new().terminator(csv::Terminator::Any(b'\n')).from_writer(Vec::new());
    let _ = w.write_record(["account_id", "currency", "count", "gross", "fees", "net"]);
    for a in &r.accounts {
        let count = a.count.to_string();
        let _ = w.write_record([&a.account_id, &a.currency, &count, &a.gross, &a.fees, &a.net]);
    }
    w.into_inner().unwrap_or_default()
}

/// A short human summary.
pub fn summary(r: &Report) -> String {
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
        }
    );
    if let Some(note) = &r.note {
        let _ = writeln!(s, "note: {note}");
    }
    let _ = writeln!(
        s,
        "transactions: {} submitted, {} accepted, {} rejected, {} processed, {} failed",
        t.submitted, t.accepted, t.rejected, t.processed, t.failed
    );
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
        let _ = writeln!(s, "failed chunk {} ({} transactions): {}", f.chunk, f.transactions, f.reason);
    }
    let _ = writeln!(
        s,
        "requests: {} total (SQS {}, S3 {}), {} per 1,000 transactions",
        r.requests.total,
        r.requests.sqs.values().sum::<u64>(),
        r.requests.s3.values().sum::<u64>(),
        r.requests.per_1000_transactions
    );
    let _ = write!(s, "report: warehouse/{}/report.json, warehouse/{}/accounts.csv", r.job_id, r.job_id);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::billing::AccountTotals;
    use rust_decimal::Decimal;

    #[test]
    fn report_counts_sorting_and_csv() {
        let manifest = Manifest {
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
        req.add("sqs.ReceiveMessage", 2);
        req.add("s3.PutObject", 1);
        let r = build(&manifest, &totals, vec![FailedChunk { chunk: 1, transactions: 1, reason: "dlq".into() }], &req);
        assert_eq!(r.status, JobStatus::Partial);
        assert_eq!(r.transactions, TxnCounts { submitted: 6, accepted: 4, rejected: 2, processed: 3, failed: 1 });
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
    }
}
