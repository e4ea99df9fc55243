//! A job's checkpoint planned, pure: the document to write (its rows inline or in parts), the part to
//! write before it, the condition it is written on, what it commits and the parts it no longer names.
//! The controller writes it (`controller::aggregate::checkpoint`) and reports back to the job
//! ([`crate::job::Job::saved`]).

use std::collections::HashSet;

use bytes::Bytes;
use fleet_domain::billing::CheckedTotals;
use fleet_domain::codec::{accounts_to_zstd_csv, sha256_hex, to_zstd_json};
use fleet_domain::error::Result;
use fleet_domain::layout::checkpoint_parts_prefix;
use fleet_domain::model::{Checkpoint, CheckpointPart, Progress};

use crate::decision::Commit;
use crate::limits::{INLINE_ROWS, MAX_PARTS};

/// The condition a checkpoint is written on (S3's `If-None-Match: *` / `If-Match: etag`): fencing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precondition {
    /// Only where none is (the job has no checkpoint yet where this release writes it).
    Absent,
    /// Only if the checkpoint in place is the one last read or written (its ETag).
    Matches(String),
}

/// What a checkpoint keeps of a job's totals.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Every row, inline or in parts (only the rows changed since the last checkpoint are written).
    Keep,
    /// None (the job finished: its rows are in the warehouse); its parts are deleted.
    Drop,
}

/// A checkpoint planned (see [`plan`]): the document to write and, for a large job, the part to
/// write before it; what it commits; the parts it no longer names.
pub struct Save {
    doc: Checkpoint,
    body: Bytes,
    meta: std::collections::BTreeMap<String, String>,
    cond: Precondition,
    part: Option<(CheckpointPart, Bytes)>,
    commit: Commit,
    stale: Vec<String>,
}

impl Save {
    pub fn part(&self) -> Option<&(CheckpointPart, Bytes)> {
        self.part.as_ref()
    }

    pub fn body(&self) -> &Bytes {
        &self.body
    }

    pub fn meta(&self) -> std::collections::BTreeMap<String, String> {
        self.meta.clone()
    }

    /// Written only if this holds (fencing: the ETag last read or written, or no checkpoint yet).
    pub fn cond(&self) -> &Precondition {
        &self.cond
    }

    /// The document written (its rows taken out), what it commits, the parts it no longer names.
    pub fn into_parts(self) -> (Checkpoint, Commit, Vec<String>) {
        (self.doc, self.commit, self.stale)
    }
}

/// Plans a job's checkpoint (pure: encoding only). A small job's rows travel inside the document; a
/// large job's in parts: the rows of the accounts changed since the last checkpoint, or, when the
/// parts since the last base would outweigh the job, a new base with every row (the parts it
/// replaces are named in `stale`, deleted once the document naming the new one is written). `doc`:
/// the document without rows, its `parts` those the last written one names; `part_id`: names a new
/// part, asked only when one is written (unique: a part is never written over).
pub fn plan(mut doc: Checkpoint, totals: &CheckedTotals, rows: Rows, commit: Commit, etag: Option<String>, part_id: impl FnOnce() -> String) -> Result<Save> {
    let before = doc.parts.clone();
    let n = totals.len();
    let mut part = None;
    match rows {
        Rows::Drop => doc.parts.clear(),
        Rows::Keep if doc.parts.is_empty() && n <= INLINE_ROWS => doc.accounts = totals.rows(),
        Rows::Keep => {
            let since_base: usize = doc.parts.iter().skip(1).map(|p| p.rows as usize).sum();
            let full = doc.parts.is_empty() || doc.parts.len() >= MAX_PARTS || since_base + totals.changed_accounts() > n;
            // Borrowed from the totals: a base of a million rows is not copied before it is encoded.
            let (rows, data) = if full {
                let sorted = totals.sorted_rows();
                (sorted.len() as u64, accounts_to_zstd_csv(sorted.iter()))
            } else {
                let rows = totals.changed_rows().count();
                (rows as u64, accounts_to_zstd_csv(totals.changed_rows()))
            };
            let p = CheckpointPart {
                key: format!("{}{}.csv.zst", checkpoint_parts_prefix(&doc.job_id), part_id()),
                rows,
                bytes: data.len() as u64,
                sha256: sha256_hex(&data),
                full,
            };
            if full {
                doc.parts.clear();
            }
            doc.parts.push(p.clone());
            part = Some((p, Bytes::from(data)));
        }
    }
    let body = Bytes::from(to_zstd_json(&doc)?);
    let meta = Progress::of(&doc).to_meta();
    doc.accounts = Vec::new();
    // A finished job's parts are all deleted by its end (with what a fenced owner may have left).
    let stale = if rows == Rows::Drop {
        Vec::new()
    } else {
        let kept: HashSet<&str> = doc.parts.iter().map(|p| p.key.as_str()).collect();
        before.iter().filter(|p| !kept.contains(p.key.as_str())).map(|p| p.key.clone()).collect()
    };
    let cond = match etag {
        Some(e) => Precondition::Matches(e),
        None => Precondition::Absent,
    };
    Ok(Save { doc, body, meta, cond, part, commit, stale })
}
