//! Why: analysts ask "what did account A1 pay in November" and "fees per currency per day"; a folder
//! of per-job JSON and CSV answers neither without a script. Every finished job's totals go into two
//! typed tables that query engines read directly (Athena, DuckDB, pyarrow, Spark), filed by the day
//! the job's ending was committed.
//!
//! The tables, Hive-partitioned (`billed_on=YYYY-MM-DD`, not also stored in the files), one Parquet
//! object per job and table, written once:
//!
//! - `tables/v2/accounts/billed_on=D/{job}.parquet`: one row per (job, account, currency) billed;
//! - `tables/v2/jobs/billed_on=D/{job}.parquet`: one row per job.
//!
//! Money is `DECIMAL(38,4)` (`DECIMAL(38,8)` for the request cost in USD): four places hold every
//! ISO 4217 currency's amounts exactly (yen have none, euros two, dinars three, CLF four), as the
//! report shows them, never a string or a float; times are UTC timestamps in milliseconds. The day is
//! the UTC date of the committed ending ([`billed_on`]), the same for whichever controller writes the
//! objects, so a takeover after midnight writes the same keys. Encoding is pure (bytes in memory);
//! the caller writes them with a conditional create.

use std::sync::Arc;

use fleet_domain::model::JobStatus;
use fleet_domain::report::{AccountRows, Report};
use parquet::basic::{Compression, ZstdLevel};
use parquet::data_type::{ByteArray, ByteArrayType, FixedLenByteArray, FixedLenByteArrayType, Int32Type, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::{SerializedFileWriter, SerializedRowGroupWriter};
use rust_decimal::Decimal;

/// Where the tables live in the bucket (beside `warehouse/{job}/`, whose job-named folders a table
/// root must not share).
pub const TABLES_PREFIX: &str = "tables/v2/";
/// The media type the tables' objects are stored with.
pub const MEDIA_TYPE: &str = "application/vnd.apache.parquet";
/// The account rows of a large job are written in row groups of this many rows.
pub const ROW_GROUP_ROWS: usize = 128 * 1024;

/// The places of the accounts table's money columns: the most any ISO 4217 currency has.
pub const MONEY_SCALE: u32 = fleet_domain::currency::MAX_MINOR_UNITS;

/// The accounts table's schema (the partition column `billed_on` is the object's folder).
pub const ACCOUNTS_SCHEMA: &str = "message accounts {
  required binary job_id (STRING);
  required binary account_id (STRING);
  required binary currency (STRING);
  required int64 count;
  required fixed_len_byte_array(16) gross (DECIMAL(38,4));
  required fixed_len_byte_array(16) fees (DECIMAL(38,4));
  required fixed_len_byte_array(16) net (DECIMAL(38,4));
  required binary status (STRING);
  required int64 finished_at (TIMESTAMP(MILLIS,true));
}";

/// The jobs table's schema.
pub const JOBS_SCHEMA: &str = "message jobs {
  required binary job_id (STRING);
  required binary status (STRING);
  required int64 submitted;
  required int64 accepted;
  required int64 rejected;
  required int64 processed;
  required int64 failed;
  required int64 duplicates;
  required group failed_chunks (LIST) {
    repeated group list {
      required int32 element;
    }
  }
  required int64 requests;
  optional fixed_len_byte_array(16) cost_usd (DECIMAL(38,8));
  required int64 submitted_at (TIMESTAMP(MILLIS,true));
  required int64 finished_at (TIMESTAMP(MILLIS,true));
  required group files (LIST) {
    repeated group list {
      required binary element (STRING);
    }
  }
  optional binary note (STRING);
  optional binary completes (STRING);
}";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
    /// A report value the tables cannot hold as it is (a time that is not RFC 3339, money with more
    /// places than its column): what and where.
    #[error("job {job}: {what}")]
    Invalid { job: String, what: String },
}

pub type Result<T> = std::result::Result<T, Error>;

/// The two tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    Accounts,
    Jobs,
}

impl Table {
    pub const ALL: [Table; 2] = [Table::Accounts, Table::Jobs];

    pub fn name(self) -> &'static str {
        match self {
            Table::Accounts => "accounts",
            Table::Jobs => "jobs",
        }
    }

    /// The object of `job`'s rows in this table, filed under `day` (see [`billed_on`]).
    pub fn key(self, day: &str, job: &str) -> String {
        format!("{TABLES_PREFIX}{}/billed_on={day}/{job}.parquet", self.name())
    }

    /// The folder of the jobs filed under `day` in this table.
    pub fn day_prefix(self, day: &str) -> String {
        format!("{TABLES_PREFIX}{}/billed_on={day}/", self.name())
    }

    /// The job an object of this table holds, from its key (`None` for another key).
    pub fn job_of(self, key: &str) -> Option<&str> {
        let rest = key.strip_prefix(TABLES_PREFIX)?.strip_prefix(self.name())?.strip_prefix("/billed_on=")?;
        rest.split_once('/')?.1.strip_suffix(".parquet")
    }

    /// The object's bytes for the report `r`.
    pub fn encode<A: AccountRows>(self, r: &Report<A>) -> Result<Vec<u8>> {
        match self {
            Table::Accounts => accounts(r),
            Table::Jobs => jobs(r),
        }
    }
}

/// The keys of both tables' objects for the finished job `r`, filed under the day of its ending.
pub fn keys<A>(r: &Report<A>) -> Result<[(Table, String); 2]> {
    let day = billed_on(r)?;
    Ok(Table::ALL.map(|t| (t, t.key(&day, &r.job_id))))
}

/// The `billed_on` day of a UTC date.
pub fn day(d: time::Date) -> String {
    format!("{:04}-{:02}-{:02}", d.year(), u8::from(d.month()), d.day())
}

/// The day a finished job is filed under: the UTC date of its committed ending (`finished_at`).
pub fn billed_on<A>(r: &Report<A>) -> Result<String> {
    let t = timestamp(&r.job_id, "finished_at", &r.finished_at)?;
    Ok(day(t.to_offset(time::UtcOffset::UTC).date()))
}

fn timestamp(job: &str, field: &str, s: &str) -> Result<time::OffsetDateTime> {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map_err(|e| Error::Invalid { job: job.to_string(), what: format!("{field} {s:?} is not an RFC 3339 time: {e}") })
}

fn millis(job: &str, field: &str, s: &str) -> Result<i64> {
    Ok((timestamp(job, field, s)?.unix_timestamp_nanos() / 1_000_000) as i64)
}

/// A decimal string as a `DECIMAL(38, scale)` value: its unscaled integer, 16 bytes big-endian
/// two's complement. More places than `scale` is an error, never a rounding.
fn decimal(job: &str, field: &str, s: &str, scale: u32) -> Result<FixedLenByteArray> {
    let bad = |why: String| Error::Invalid { job: job.to_string(), what: format!("{field} {s:?} {why}") };
    let d: Decimal = s.parse().map_err(|e| bad(format!("is not a decimal: {e}")))?;
    if d.scale() > scale {
        return Err(bad(format!("has more than {scale} decimal places")));
    }
    // `rescale` stops short of `scale` when the value cannot hold it (a 96-bit mantissa): the
    // unscaled integer is made exactly here instead (38 digits hold any such value at 4 places).
    let unscaled = d
        .mantissa()
        .checked_mul(10i128.pow(scale - d.scale()))
        .filter(|u| u.unsigned_abs() < 10u128.pow(38))
        .ok_or_else(|| bad(format!("does not fit DECIMAL(38,{scale})")))?;
    Ok(FixedLenByteArray::from(unscaled.to_be_bytes().to_vec()))
}

fn status(s: JobStatus) -> &'static str {
    match s {
        JobStatus::Running => "running",
        JobStatus::Complete => "complete",
        JobStatus::Partial => "partial",
        JobStatus::Abandoned => "abandoned",
        JobStatus::Quarantined => "quarantined",
    }
}

fn writer(schema: &str) -> Result<SerializedFileWriter<Vec<u8>>> {
    let schema = Arc::new(parquet::schema::parser::parse_message_type(schema)?);
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .set_created_by(format!("billing-fleet {}", env!("CARGO_PKG_VERSION")))
        .build();
    Ok(SerializedFileWriter::new(Vec::new(), schema, Arc::new(props))?)
}

/// The next column of `rg`, which the schema says exists.
fn column<'a, 'b>(rg: &'a mut SerializedRowGroupWriter<'b, Vec<u8>>) -> Result<parquet::file::writer::SerializedColumnWriter<'a>> {
    rg.next_column()?.ok_or_else(|| Error::Parquet(parquet::errors::ParquetError::General("the schema has fewer columns than written".into())))
}

fn strings(rg: &mut SerializedRowGroupWriter<'_, Vec<u8>>, values: &[ByteArray], def: Option<&[i16]>, rep: Option<&[i16]>) -> Result<()> {
    let mut c = column(rg)?;
    c.typed::<ByteArrayType>().write_batch(values, def, rep)?;
    Ok(c.close()?)
}

fn int64s(rg: &mut SerializedRowGroupWriter<'_, Vec<u8>>, values: &[i64]) -> Result<()> {
    let mut c = column(rg)?;
    c.typed::<Int64Type>().write_batch(values, None, None)?;
    Ok(c.close()?)
}

fn decimals(rg: &mut SerializedRowGroupWriter<'_, Vec<u8>>, values: &[FixedLenByteArray], def: Option<&[i16]>) -> Result<()> {
    let mut c = column(rg)?;
    c.typed::<FixedLenByteArrayType>().write_batch(values, def, None)?;
    Ok(c.close()?)
}

/// One row group's account rows, column by column.
#[derive(Default)]
struct AccountColumns {
    account: Vec<ByteArray>,
    currency: Vec<ByteArray>,
    count: Vec<i64>,
    gross: Vec<FixedLenByteArray>,
    fees: Vec<FixedLenByteArray>,
    net: Vec<FixedLenByteArray>,
}

impl AccountColumns {
    fn write(&mut self, w: &mut SerializedFileWriter<Vec<u8>>, job: &ByteArray, status: &ByteArray, finished: i64) -> Result<()> {
        let n = self.count.len();
        let mut rg = w.next_row_group()?;
        strings(&mut rg, &vec![job.clone(); n], None, None)?;
        strings(&mut rg, &self.account, None, None)?;
        strings(&mut rg, &self.currency, None, None)?;
        int64s(&mut rg, &self.count)?;
        decimals(&mut rg, &self.gross, None)?;
        decimals(&mut rg, &self.fees, None)?;
        decimals(&mut rg, &self.net, None)?;
        strings(&mut rg, &vec![status.clone(); n], None, None)?;
        int64s(&mut rg, &vec![finished; n])?;
        rg.close()?;
        *self = AccountColumns::default();
        Ok(())
    }
}

/// The accounts table's object of report `r`: a row per (account, currency) the job billed, in the
/// report's order, in row groups of [`ROW_GROUP_ROWS`] (a job of no account: the schema, no row).
pub fn accounts<A: AccountRows>(r: &Report<A>) -> Result<Vec<u8>> {
    let job = &r.job_id;
    let finished = millis(job, "finished_at", &r.finished_at)?;
    let (job_b, status_b) = (ByteArray::from(job.as_str()), ByteArray::from(status(r.status)));
    let mut w = writer(ACCOUNTS_SCHEMA)?;
    let mut cols = AccountColumns::default();
    let mut failed = None;
    r.accounts.each(&mut |row| {
        if failed.is_some() {
            return;
        }
        let money = (decimal(job, "gross", row.gross, MONEY_SCALE), decimal(job, "fees", row.fees, MONEY_SCALE), decimal(job, "net", row.net, MONEY_SCALE));
        let (gross, fees, net) = match money {
            (Ok(g), Ok(f), Ok(n)) => (g, f, n),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                failed = Some(Error::Invalid { job: job.clone(), what: format!("account {:?} {}: {e}", row.account_id, row.currency) });
                return;
            }
        };
        cols.account.push(ByteArray::from(row.account_id));
        cols.currency.push(ByteArray::from(row.currency));
        cols.count.push(row.count as i64);
        cols.gross.push(gross);
        cols.fees.push(fees);
        cols.net.push(net);
        if cols.count.len() >= ROW_GROUP_ROWS {
            if let Err(e) = cols.write(&mut w, &job_b, &status_b, finished) {
                failed = Some(e);
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if !cols.count.is_empty() {
        cols.write(&mut w, &job_b, &status_b, finished)?;
    }
    Ok(w.into_inner()?)
}

/// The jobs table's object of report `r`: its one row.
pub fn jobs<A>(r: &Report<A>) -> Result<Vec<u8>> {
    let job = &r.job_id;
    let t = &r.transactions;
    let cost = match r.requests.cost.as_ref() {
        Some(c) => Some(decimal(job, "cost total_usd", &c.total_usd, 8)?),
        None => None,
    };
    let mut w = writer(JOBS_SCHEMA)?;
    let mut rg = w.next_row_group()?;
    strings(&mut rg, &[ByteArray::from(job.as_str())], None, None)?;
    strings(&mut rg, &[ByteArray::from(status(r.status))], None, None)?;
    for n in [t.submitted, t.accepted, t.rejected, t.processed, t.failed, t.duplicates] {
        int64s(&mut rg, &[n as i64])?;
    }
    {
        // A list's levels: an empty list is one level 0 and no value; each element is at level 1,
        // the first of the row repeated at 0, the rest at 1.
        let chunks: Vec<i32> = r.failed_chunks.iter().map(|f| f.chunk as i32).collect();
        let (def, rep) = list_levels(chunks.len());
        let mut c = column(&mut rg)?;
        c.typed::<Int32Type>().write_batch(&chunks, Some(&def), Some(&rep))?;
        c.close()?;
    }
    int64s(&mut rg, &[r.requests.total as i64])?;
    match &cost {
        Some(c) => decimals(&mut rg, std::slice::from_ref(c), Some(&[1]))?,
        None => decimals(&mut rg, &[], Some(&[0]))?,
    }
    // A job quarantined without a readable manifest has no submit time: its ending's stands in.
    let submitted_at = if r.created_at.is_empty() { &r.finished_at } else { &r.created_at };
    int64s(&mut rg, &[millis(job, "created_at", submitted_at)?])?;
    int64s(&mut rg, &[millis(job, "finished_at", &r.finished_at)?])?;
    {
        let files: Vec<ByteArray> = r.files.iter().map(|f| ByteArray::from(f.as_str())).collect();
        let (def, rep) = list_levels(files.len());
        strings(&mut rg, &files, Some(&def), Some(&rep))?;
    }
    for text in [&r.note, &r.completes] {
        match text {
            Some(n) => strings(&mut rg, &[ByteArray::from(n.as_str())], Some(&[1]), None)?,
            None => strings(&mut rg, &[], Some(&[0]), None)?,
        }
    }
    rg.close()?;
    Ok(w.into_inner()?)
}

/// The definition and repetition levels of one row's list of `n` required elements.
fn list_levels(n: usize) -> (Vec<i16>, Vec<i16>) {
    if n == 0 {
        return (vec![0], vec![0]);
    }
    let rep = (0..n).map(|i| i16::from(i > 0)).collect();
    (vec![1; n], rep)
}

#[cfg(test)]
mod tests;
