//! Reading the user's transaction CSV files: header mapping, per-row validation, de-duplication of
//! `txn_id` across the whole job, and rejected rows with file, physical line and reason.
//!
//! Headers of every file are checked before any row is read, so a file missing a required column refuses
//! the whole submission before anything is written anywhere.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Mutex;

use crate::model::Rejected;
use crate::transaction::Transaction;
use crate::validate::{validate_row, SeenIds, REQUIRED_COLUMNS};

/// A problem with a whole input file.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{file}: cannot read: {source}")]
    Io { file: String, source: std::io::Error },
    #[error("{file}: no header row (the file is empty)")]
    Empty { file: String },
    #[error("{file}: missing required column \"{column}\" (header has: {found})")]
    MissingColumn { file: String, column: &'static str, found: String },
    #[error("{file}: {detail}")]
    Csv { file: String, detail: String },
}

/// An input file whose header passed the check, ready to be read.
pub struct InputFile {
    pub name: String,
    source: Source,
    columns: [usize; 5],
    /// Its size (a stream's as given, 0 when unknown).
    pub bytes: u64,
    /// Rows in about its first 64 KiB, and the bytes they took: the estimate of its row count.
    head: (u64, u64),
}

/// Where an input's bytes come from: a file, opened again to be read; or a stream (standard input)
/// read once, whose first bytes (the header among them) were taken to check it and are read again
/// from memory, so line numbers and byte offsets are those of the whole stream.
enum Source {
    Path(PathBuf),
    /// Taken by the one read of it.
    Stream(Mutex<Option<Unread>>),
}

/// A stream's first bytes, already read, and the rest of it.
type Unread = (Vec<u8>, Box<dyn Read + Send>);

/// Bytes looked at to estimate a file's row count.
const HEAD: u64 = 64 * 1024;

fn csv_reader<R: Read>(r: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(r)
}

/// The first 64 KiB of `r`, or more up to the end of a first line longer than that (1 MiB at most).
fn read_head(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(HEAD as usize);
    r.take(HEAD).read_to_end(&mut head)?;
    while !head.contains(&b'\n') && head.len() < 1 << 20 {
        if r.take(HEAD).read_to_end(&mut head)? == 0 {
            break;
        }
    }
    Ok(head)
}

/// Line breaks in `head`, and its length.
fn head_of(head: &[u8]) -> (u64, u64) {
    (memchr::memchr_iter(b'\n', head).count() as u64, head.len() as u64)
}

impl InputFile {
    /// Opens a file and maps its header onto the required columns.
    pub fn open(path: &Path) -> Result<InputFile, InputError> {
        let name = path.display().to_string();
        let io = |source| InputError::Io { file: name.clone(), source };
        let mut f = File::open(path).map_err(io)?;
        let bytes = f.metadata().map_err(io)?.len();
        let head = read_head(&mut f).map_err(io)?;
        let columns = columns(&name, (&head[..]).chain(f))?;
        Ok(InputFile { head: head_of(&head), name, source: Source::Path(path.to_path_buf()), columns, bytes })
    }

    /// Takes a stream (standard input) as an input named `name`, `size` bytes long if known: reads its
    /// first 64 KiB (more, up to the end of the header row) and maps the header onto the required
    /// columns. The rows are read from the stream once, by [`Validator::read`].
    pub fn from_stream(name: String, mut stream: Box<dyn Read + Send>, size: Option<u64>) -> Result<InputFile, InputError> {
        let io = |source| InputError::Io { file: name.clone(), source };
        let head = read_head(&mut stream).map_err(io)?;
        let columns = columns(&name, &head[..])?;
        let estimate = head_of(&head);
        let source = Source::Stream(Mutex::new(Some((head, stream))));
        Ok(InputFile { head: estimate, name, source, columns, bytes: size.unwrap_or(0) })
    }

    /// About how many rows it holds: its size over the mean length of the lines in its first 64 KiB.
    /// None for a stream of unknown size.
    pub fn estimated_rows(&self) -> Option<u64> {
        let (lines, len) = self.head;
        match (&self.source, self.bytes) {
            (Source::Stream(_), 0) => None,
            _ if len == 0 => Some(0),
            _ if lines == 0 => Some(1),
            _ => Some(self.bytes * lines / len),
        }
    }

    /// A reader of the whole input from its first byte (a stream's only once).
    fn reader(&self) -> Result<Box<dyn Read + Send + '_>, InputError> {
        let io = |source| InputError::Io { file: self.name.clone(), source };
        match &self.source {
            Source::Path(p) => Ok(Box::new(File::open(p).map_err(io)?)),
            Source::Stream(s) => {
                let taken = s.lock().unwrap_or_else(|e| e.into_inner()).take();
                let (head, rest) = taken.ok_or_else(|| io(std::io::Error::other("a stream is read once, and this one was")))?;
                Ok(Box::new(std::io::Cursor::new(head).chain(rest)))
            }
        }
    }
}

/// Reads the header row of `r` (the file `name`) and finds each required column in it.
fn columns(name: &str, r: impl Read) -> Result<[usize; 5], InputError> {
    let mut rdr = csv_reader(r);
    let mut header = csv::ByteRecord::new();
    let got = rdr.read_byte_record(&mut header).map_err(|e| InputError::Csv { file: name.to_string(), detail: e.to_string() })?;
    if !got {
        return Err(InputError::Empty { file: name.to_string() });
    }
    let names: Vec<String> = header
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let h = String::from_utf8_lossy(h);
            // A UTF-8 byte order mark may precede the first column name.
            let h = if i == 0 { h.trim_start_matches('\u{feff}') } else { &h };
            h.trim().to_string()
        })
        .collect();
    let mut columns = [0usize; 5];
    for (slot, col) in columns.iter_mut().zip(REQUIRED_COLUMNS) {
        *slot = names.iter().position(|n| n == col).ok_or_else(|| InputError::MissingColumn { file: name.to_string(), column: col, found: names.join(",") })?;
    }
    Ok(columns)
}

/// Offsets of the CR and LF bytes that have streamed past, for physical line numbers. (The csv crate's
/// own line counter is off with CRLF endings and blank lines.)
type Breaks = Rc<RefCell<VecDeque<(u64, u8)>>>;

/// A reader that records where line-break bytes are as they stream past.
struct BreakRecorder<R> {
    inner: R,
    offset: u64,
    breaks: Breaks,
}

impl<R: Read> Read for BreakRecorder<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let mut breaks = self.breaks.borrow_mut();
        for i in memchr::memchr2_iter(b'\n', b'\r', &buf[..n]) {
            breaks.push_back((self.offset + i as u64, buf[i]));
        }
        self.offset += n as u64;
        Ok(n)
    }
}

/// Turns record byte positions into physical line numbers (1-based; LF, CRLF and lone CR end a line).
struct LineCounter {
    breaks: Breaks,
    /// Line breaks counted so far.
    passed: u64,
}

impl LineCounter {
    fn take(&mut self) {
        let mut breaks = self.breaks.borrow_mut();
        if let Some((off, b)) = breaks.pop_front() {
            let crlf = b == b'\r' && breaks.front() == Some(&(off + 1, b'\n'));
            if !crlf {
                self.passed += 1;
            }
        }
    }

    /// Line of the record whose reading started at byte `pos` (just after the previous record's
    /// terminator): breaks before `pos`, plus the blank lines skipped from there.
    fn line_at(&mut self, pos: u64) -> u64 {
        while self.breaks.borrow().front().is_some_and(|&(off, _)| off < pos) {
            self.take();
        }
        let mut cur = pos;
        while self.breaks.borrow().front().is_some_and(|&(off, _)| off == cur) {
            self.take();
            cur += 1;
        }
        self.passed + 1
    }
}

/// Row counts of a read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub submitted: u64,
    pub accepted: u64,
    pub rejected: u64,
}

/// Validates rows and remembers accepted `txn_id`s for the whole job.
#[derive(Default)]
pub struct Validator {
    /// txn_id -> (file index, line) of the accepted row that first carried it.
    seen: SeenIds<(u32, u64)>,
    files: Vec<String>,
    pub counts: Counts,
}

impl Validator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads every row of `file`; accepted rows go to `accept`, rejected ones to `reject`.
    /// `progress` is called with the bytes read so far in this file, now and then.
    pub fn read(
        &mut self,
        file: &InputFile,
        mut accept: impl FnMut(&Transaction<'_>),
        reject: impl FnMut(Rejected),
        progress: impl FnMut(u64),
    ) -> Result<(), InputError> {
        self.read_lines(file, |t, _| accept(t), reject, progress)
    }

    /// [`Validator::read`] that also gives each accepted row's physical line.
    pub fn read_lines(
        &mut self,
        file: &InputFile,
        mut accept: impl FnMut(&Transaction<'_>, u64),
        mut reject: impl FnMut(Rejected),
        mut progress: impl FnMut(u64),
    ) -> Result<(), InputError> {
        let f = file.reader()?;
        let breaks: Breaks = Rc::default();
        let mut lines = LineCounter { breaks: breaks.clone(), passed: 0 };
        let mut rdr = csv_reader(BreakRecorder { inner: BufReader::with_capacity(1 << 20, f), offset: 0, breaks });
        let file_idx = self.files.len() as u32;
        self.files.push(file.name.clone());
        let mut rec = csv::ByteRecord::new();
        let mut first = true;
        let [ti, ai, mi, ci, si] = file.columns;
        loop {
            let more = rdr.read_byte_record(&mut rec).map_err(|e| match e.into_kind() {
                csv::ErrorKind::Io(source) => InputError::Io { file: file.name.clone(), source },
                other => InputError::Csv { file: file.name.clone(), detail: format!("{other:?}") },
            })?;
            if !more {
                break;
            }
            let line = lines.line_at(rec.position().map_or(0, |p| p.byte()));
            if first {
                first = false; // the header, checked in open()
                continue;
            }
            self.counts.submitted += 1;
            if self.counts.submitted.is_multiple_of(65_536) {
                progress(rec.position().map(|p| p.byte()).unwrap_or(0));
            }
            let result = validate_row(rec.get(ti), rec.get(ai), rec.get(mi), rec.get(ci), rec.get(si)).map_err(|e| e.to_string()).and_then(|t| {
                match self.seen.insert_new(t.txn_id, (file_idx, line)) {
                    Some(&(fi, fl)) => Err(format!("txn_id: duplicate of the accepted row at {}:{fl}", self.files[fi as usize])),
                    None => Ok(t),
                }
            });
            match result {
                Ok(t) => {
                    self.counts.accepted += 1;
                    accept(&t, line);
                }
                Err(reason) => {
                    self.counts.rejected += 1;
                    let txn_id = rec.get(ti).filter(|v| !v.is_empty()).map(|v| String::from_utf8_lossy(v).into_owned());
                    reject(Rejected { file: file.name.clone(), line, txn_id, reason });
                }
            }
        }
        progress(file.bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(dir: &tempfile::TempDir, name: &str, body: &str) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::File::create(&p).unwrap().write_all(body.as_bytes()).unwrap();
        p
    }

    /// Accepted rows as (txn_id, account_id, amount), rejected rows, counts.
    type Accepted = Vec<(String, String, String)>;

    fn read_all(paths: &[PathBuf]) -> Result<(Accepted, Vec<Rejected>, Counts), InputError> {
        let files = paths.iter().map(|p| InputFile::open(p)).collect::<Result<Vec<_>, _>>()?;
        let mut v = Validator::new();
        let (mut acc, mut rej) = (vec![], vec![]);
        for f in &files {
            v.read(f, |t| acc.push((t.txn_id.to_string(), t.account_id.to_string(), t.amount.to_string())), |r| rej.push(r), |_| {})?;
        }
        Ok((acc, rej, v.counts))
    }

    #[test]
    fn columns_in_any_order_quotes_crlf_blank_lines_and_line_numbers() {
        let d = tempfile::tempdir().unwrap();
        let body = "\u{feff}note,timestamp,currency,amount,account_id,txn_id\r\n\
                    \"multi\nline\",2026-11-21T10:00:00Z,EUR,10.00,A1,t1\r\n\
                    \r\n\
                    x,2026-11-21T10:00:00Z,EUR,abc,A1,t2\r\n\
                    y,2026-11-21T10:00:00Z,EUR,\"1,5\",\"A,2\",t3\r\n\
                    z,2026-11-21T10:00:00+01:00,USD,-3.5,\"A,2\",t4\r\n";
        let p = file(&d, "in.csv", body);
        let (acc, rej, counts) = read_all(&[p]).unwrap();
        assert_eq!(counts, Counts { submitted: 4, accepted: 2, rejected: 2 });
        assert_eq!(acc[0].0, "t1");
        assert_eq!(acc[1].1, "A,2");
        assert_eq!(acc[1].2, "-3.50");
        // header line 1, t1 spans lines 2-3, blank line 4, t2 on line 5, t3 on line 6
        assert_eq!(rej.iter().map(|r| r.line).collect::<Vec<_>>(), [5, 6]);
        assert!(rej[0].reason.starts_with("amount:"), "{}", rej[0].reason);
        assert_eq!(rej[0].txn_id.as_deref(), Some("t2"));
    }

    #[test]
    fn physical_line_numbers_with_crlf_and_blank_lines() {
        let d = tempfile::tempdir().unwrap();
        let hdr = "txn_id,account_id,amount,currency,timestamp";
        for (name, body) in [
            ("lf.csv", format!("{hdr}\n\nt1,A,x,EUR,2026-11-21T10:00:00Z\n\n\nt2,A,x,EUR,2026-11-21T10:00:00Z\n")),
            ("crlf.csv", format!("{hdr}\r\n\r\nt1,A,x,EUR,2026-11-21T10:00:00Z\r\n\r\n\r\nt2,A,x,EUR,2026-11-21T10:00:00Z\r\n")),
            ("nofinal.csv", format!("{hdr}\r\n\r\nt1,A,x,EUR,2026-11-21T10:00:00Z\r\n\r\n\r\nt2,A,x,EUR,2026-11-21T10:00:00Z")),
        ] {
            let p = file(&d, name, &body);
            let (_, rej, counts) = read_all(&[p]).unwrap();
            assert_eq!(counts.submitted, 2, "{name}");
            assert_eq!(rej.iter().map(|r| r.line).collect::<Vec<_>>(), [3, 6], "{name}");
        }
    }

    #[test]
    fn duplicates_across_files_and_missing_fields() {
        let d = tempfile::tempdir().unwrap();
        let a = file(&d, "a.csv", "txn_id,account_id,amount,currency,timestamp\nt1,A,1,EUR,2026-11-21T10:00:00Z\nt2,A,0,EUR,2026-11-21T10:00:00Z\n");
        let b = file(&d, "b.csv", "txn_id,account_id,amount,currency,timestamp\nt1,B,2,EUR,2026-11-21T10:00:00Z\nt2,B,2,EUR,2026-11-21T10:00:00Z\n,B,2\n");
        let (acc, rej, counts) = read_all(&[a.clone(), b]).unwrap();
        assert_eq!(counts, Counts { submitted: 5, accepted: 2, rejected: 3 });
        // t2 was first rejected (zero amount), so its later valid row is accepted
        assert_eq!(acc.iter().map(|t| (t.0.as_str(), t.1.as_str())).collect::<Vec<_>>(), [("t1", "A"), ("t2", "B")]);
        assert_eq!(rej[1].reason, format!("txn_id: duplicate of the accepted row at {}:2", a.display()));
        assert_eq!(rej[2].txn_id, None);
        assert_eq!(rej[2].line, 4);
    }

    #[test]
    fn a_stream_reads_as_the_same_file_would_once() {
        let d = tempfile::tempdir().unwrap();
        // A header past the first 64 KiB's end, CRLF endings, a blank line, a multi-line field.
        let pad = "p".repeat(70_000);
        let body = format!(
            "{pad},txn_id,account_id,amount,currency,timestamp\r\nx,t1,A,1,EUR,2026-11-21T10:00:00Z\r\n\r\n\"a\nb\",t2,A,zz,EUR,2026-11-21T10:00:00Z\r\ny,t1,B,2,EUR,2026-11-21T10:00:00Z\r\n"
        );
        let p = file(&d, "in.csv", &body);
        let (acc, rej, counts) = read_all(std::slice::from_ref(&p)).unwrap();
        let name = p.display().to_string();
        let s = InputFile::from_stream(name.clone(), Box::new(std::io::Cursor::new(body.clone().into_bytes())), None).unwrap();
        assert_eq!(s.estimated_rows(), None, "a stream of unknown size");
        let mut v = Validator::new();
        let (mut sacc, mut srej) = (vec![], vec![]);
        v.read(&s, |t| sacc.push((t.txn_id.to_string(), t.account_id.to_string(), t.amount.to_string())), |r| srej.push(r), |_| {}).unwrap();
        assert_eq!((sacc, v.counts), (acc, counts));
        assert_eq!(srej.iter().map(|r| (r.line, r.reason.clone())).collect::<Vec<_>>(), rej.iter().map(|r| (r.line, r.reason.clone())).collect::<Vec<_>>());
        assert_eq!(srej.iter().map(|r| r.line).collect::<Vec<_>>(), [4, 6]);
        let again = v.read(&s, |_| {}, |_| {}, |_| {}).err().unwrap().to_string();
        assert!(again.starts_with(&format!("{name}: cannot read")) && again.contains("read once"), "{again}");
        // With its size given, its rows are estimated as a file's are.
        let sized = InputFile::from_stream("in.csv".into(), Box::new(std::io::Cursor::new(body.clone().into_bytes())), Some(body.len() as u64)).unwrap();
        assert_eq!(sized.estimated_rows(), InputFile::open(&p).unwrap().estimated_rows());
        let bad = InputFile::from_stream("stdin".into(), Box::new(std::io::Cursor::new(b"txn_id,amount\nt1,2\n".to_vec())), None).err().unwrap();
        assert_eq!(bad.to_string(), "stdin: missing required column \"account_id\" (header has: txn_id,amount)");
        assert!(matches!(InputFile::from_stream("stdin".into(), Box::new(std::io::empty()), None), Err(InputError::Empty { .. })));
    }

    #[test]
    fn missing_column_refuses_file() {
        let d = tempfile::tempdir().unwrap();
        let p = file(&d, "bad.csv", "txn_id,account_id,amount,timestamp\nt1,A,1,2026-11-21T10:00:00Z\n");
        let e = InputFile::open(&p).err().unwrap();
        let msg = e.to_string();
        assert!(msg.contains("bad.csv") && msg.contains("\"currency\""), "{msg}");
        let empty = file(&d, "empty.csv", "");
        assert!(matches!(InputFile::open(&empty), Err(InputError::Empty { .. })));
    }
}
