//! The tables read back with the parquet crate's own reader (the pyarrow, DuckDB and Athena readers
//! are exercised against LocalStack in the end-to-end tests).

use super::*;
use fleet_domain::billing::{AccountTotals, Tariff, Totals};
use fleet_domain::model::{FailedChunk, Manifest, Rejected};
use fleet_domain::prices::Prices;
use fleet_domain::report::build;
use fleet_domain::requests::{Billed, Op, RequestCounts};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::{Field, Row};

fn manifest(job: &str) -> Manifest {
    Manifest {
        chunk_lines: Vec::new(),
        completes: None,
        partition: 0,
        v: 1,
        job_id: job.into(),
        created_at: "2026-11-27T23:59:58.250Z".into(),
        files: vec!["a.csv".into(), "b.csv".into()],
        submitted: 7,
        accepted: 6,
        rejected: vec![Rejected { file: "a.csv".into(), line: 3, txn_id: None, reason: "amount: empty".into() }],
        total_chunks: 3,
        chunk_transactions: vec![3, 2, 1],
        tariff: Tariff::default(),
        requests: RequestCounts::default(),
    }
}

fn row(a: &str, cur: &str, n: u64, gross: i64, fees: i64) -> AccountTotals {
    AccountTotals { account_id: a.into(), currency: cur.into(), count: n, gross: Decimal::new(gross, 2), fees: Decimal::new(fees, 2) }
}

fn rows(bytes: Vec<u8>) -> Vec<Row> {
    let r = SerializedFileReader::new(bytes::Bytes::from(bytes)).expect("a parquet file");
    r.get_row_iter(None).expect("rows").map(|r| r.expect("a row")).collect()
}

fn field<'r>(row: &'r Row, name: &str) -> &'r Field {
    row.get_column_iter().find(|(n, _)| n.as_str() == name).map(|(_, f)| f).unwrap_or_else(|| panic!("no column {name}"))
}

/// A decimal field as its text at its scale ("-12.3400").
fn money(f: &Field) -> String {
    let Field::Decimal(d) = f else { panic!("not a decimal: {f:?}") };
    let mut v = [0u8; 16];
    let b = d.data();
    v[16 - b.len()..].copy_from_slice(b);
    if b[0] & 0x80 != 0 {
        v[..16 - b.len()].fill(0xff);
    }
    Decimal::from_i128_with_scale(i128::from_be_bytes(v), d.scale() as u32).to_string()
}

#[test]
fn a_partial_jobs_accounts_and_job_row_read_back_exactly() {
    let mut totals = Totals::new();
    totals.add(&row("acct-1", "EUR", 3, 1_000_050, 2_999));
    totals.add(&row("acct-1", "USD", 1, -505, 0));
    totals.add(&row("acct-2", "EUR", 1, 99_999_999_999_999, 1));
    totals.add(&AccountTotals { account_id: "acct-3".into(), currency: "JPY".into(), count: 2, gross: Decimal::new(1_500, 0), fees: Decimal::new(94, 0) });
    totals.add(&AccountTotals { account_id: "acct-3".into(), currency: "BHD".into(), count: 1, gross: Decimal::new(12_345, 3), fees: Decimal::new(424, 3) });
    let mut req = RequestCounts::default();
    req.add(Billed::call(Op::SqsSendMessageBatch), 4);
    req.add(Billed::call(Op::S3PutObject), 5);
    let mut r = build(&manifest("j-1"), &totals, vec![FailedChunk { lines: Vec::new(), chunk: 1, transactions: 2, reason: "poison".into() }], &req);
    r.finished_at = "2026-11-28T00:00:01.5Z".into();
    r.requests.set_cost(&Prices::default(), &req, r.transactions.submitted);
    assert_eq!(billed_on(&r).unwrap(), "2026-11-28", "the UTC day of the committed ending");
    assert_eq!(Table::Accounts.key("2026-11-28", "j-1"), "tables/v2/accounts/billed_on=2026-11-28/j-1.parquet");
    let key = Table::Jobs.key("2026-11-28", "j-1");
    assert!(key.starts_with(&Table::Jobs.day_prefix("2026-11-28")));
    assert_eq!((Table::Jobs.job_of(&key), Table::Accounts.job_of(&key)), (Some("j-1"), None), "a key names its job, in its own table only");

    let got = rows(Table::Accounts.encode(&r).unwrap());
    let text: Vec<(String, String, String, i64, String, String, String)> = got
        .iter()
        .map(|row| {
            let s = |n| match field(row, n) {
                Field::Str(s) => s.clone(),
                f => panic!("{n}: {f:?}"),
            };
            let Field::Long(count) = field(row, "count") else { panic!() };
            // Stored at four places; shown, as the report shows it, at the currency's own.
            let cur = s("currency");
            let shown = |n| fleet_domain::billing::money(money(field(row, n)).parse().unwrap(), &cur);
            (s("job_id"), s("account_id"), cur.clone(), *count, shown("gross"), shown("fees"), shown("net"))
        })
        .collect();
    // Exactly the report's rows (accounts.csv's), money to the cent, large sums whole.
    let mut csv = Vec::new();
    r.accounts.each(&mut |a| {
        csv.push((
            "j-1".to_string(),
            a.account_id.to_string(),
            a.currency.to_string(),
            a.count as i64,
            a.gross.to_string(),
            a.fees.to_string(),
            a.net.to_string(),
        ))
    });
    assert_eq!(text, csv);
    assert_eq!(text[2].4, "999999999999.99");
    assert_eq!(text[1].4, "-5.05");
    assert_eq!((text[3].2.as_str(), text[3].4.as_str(), text[3].6.as_str()), ("BHD", "12.345", "11.921"), "dinars to the fils");
    assert_eq!((text[4].2.as_str(), text[4].4.as_str(), text[4].6.as_str()), ("JPY", "1500", "1406"), "whole yen");
    assert_eq!(money(field(&got[3], "net")), "11.9210", "stored at four places, exactly");
    for row in &got {
        assert_eq!(field(row, "status"), &Field::Str("partial".into()));
        assert_eq!(field(row, "finished_at"), &Field::TimestampMillis(1_795_824_001_500));
    }

    let job = rows(Table::Jobs.encode(&r).unwrap());
    assert_eq!(job.len(), 1);
    let j = &job[0];
    assert_eq!(field(j, "status"), &Field::Str("partial".into()));
    let longs: Vec<&Field> = ["submitted", "accepted", "rejected", "processed", "failed", "duplicates", "requests"].iter().map(|n| field(j, n)).collect();
    assert_eq!(longs, [&Field::Long(7), &Field::Long(6), &Field::Long(1), &Field::Long(8), &Field::Long(2), &Field::Long(0), &Field::Long(9)]);
    let Field::ListInternal(failed) = field(j, "failed_chunks") else { panic!() };
    assert_eq!(failed.elements(), &[Field::Int(1)]);
    let cost: Decimal = money(field(j, "cost_usd")).parse().unwrap();
    assert_eq!(cost, r.requests.cost.as_ref().unwrap().total_usd.parse::<Decimal>().unwrap(), "the report's cost, exact");
    assert_eq!(field(j, "submitted_at"), &Field::TimestampMillis(1_795_823_998_250));
    assert_eq!(field(j, "note"), &Field::Null);
    let Field::ListInternal(files) = field(j, "files") else { panic!() };
    assert_eq!(files.elements(), &[Field::Str("a.csv".into()), Field::Str("b.csv".into())]);
}

#[test]
fn a_job_of_no_account_has_an_empty_accounts_object_and_its_row() {
    let mut r = build(&manifest("empty"), &Totals::new(), Vec::new(), &RequestCounts::default());
    r.finished_at = "2026-11-28T10:00:00Z".into();
    r.note = Some("abandoned: nothing came".into());
    assert!(rows(Table::Accounts.encode(&r).unwrap()).is_empty());
    let j = rows(Table::Jobs.encode(&r).unwrap());
    assert_eq!(field(&j[0], "note"), &Field::Str("abandoned: nothing came".into()));
    assert_eq!(field(&j[0], "cost_usd"), &Field::Null, "unpriced: no cost");
    let Field::ListInternal(failed) = field(&j[0], "failed_chunks") else { panic!() };
    assert!(failed.elements().is_empty());
}

#[test]
fn many_accounts_span_row_groups_and_every_row_reads_back() {
    let mut totals = Totals::new();
    let n = ROW_GROUP_ROWS + 10;
    for i in 0..n {
        totals.add(&row(&format!("a{i:07}"), "EUR", 1, i as i64, 1));
    }
    let mut r = build(&manifest("big"), &totals, Vec::new(), &RequestCounts::default());
    r.finished_at = "2026-11-28T10:00:00Z".into();
    let bytes = Table::Accounts.encode(&r).unwrap();
    let reader = SerializedFileReader::new(bytes::Bytes::from(bytes.clone())).unwrap();
    assert_eq!(reader.metadata().num_row_groups(), 2);
    assert_eq!(reader.metadata().file_metadata().num_rows(), n as i64);
    let got = rows(bytes);
    assert_eq!(money(field(&got[n - 1], "gross")), format!("{}.{:02}00", (n - 1) / 100, (n - 1) % 100));
}

#[test]
fn a_time_that_is_not_rfc3339_is_refused_with_where() {
    let mut r = build(&manifest("bad"), &Totals::new(), Vec::new(), &RequestCounts::default());
    r.finished_at = "yesterday".into();
    let e = billed_on(&r).unwrap_err().to_string();
    assert!(e.contains("job bad") && e.contains("finished_at") && e.contains("yesterday"), "{e}");
}

/// A sum too large for a 96-bit mantissa at four places is still stored exactly (`rescale` would
/// stop short of the column's scale and the value would read a power of ten off).
#[test]
fn a_large_sum_is_stored_at_the_columns_scale() {
    let mut totals = Totals::new();
    // 7.9e26 at two places: rescaled to four it would need 2^96 * 100.
    let big: Decimal = "792281625142643375935439503.35".parse().unwrap();
    totals.add(&AccountTotals { account_id: "a".into(), currency: "EUR".into(), count: 1, gross: big, fees: Decimal::ZERO });
    let r = build(&manifest("big-sum"), &totals, Vec::new(), &RequestCounts::default());
    let got = rows(Table::Accounts.encode(&r).unwrap());
    let Field::Decimal(d) = field(&got[0], "gross") else { panic!() };
    let mut v = [0u8; 16];
    v[16 - d.data().len()..].copy_from_slice(d.data());
    assert_eq!((i128::from_be_bytes(v), d.scale()), (7_922_816_251_426_433_759_354_395_033_500, 4));
}
