//! A job's own records as the authority, never a message's word: what the initiator recorded for the
//! job (each chunk's record, written with its blob before its work item is sent; the manifest, written
//! before the seal) judges every message before anything of it is counted, decoded, or makes a job in
//! memory. A message that contradicts them is refused; one they do not know waits a bounded time; a
//! payload is capped by its chunk's recorded figures. Pure: the driver looks the records up
//! (`controller::aggregate::records`) and asks here.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use fleet_domain::model::{ChunkRecord, Manifest, ResultMessage};

use crate::item::{Item, Source};
use crate::limits::{Figures, UNRECORDED_RECEIVES};

/// What the job's records say of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It agrees with them: counted, its payload capped by these figures (`None`: it carries none).
    Agrees(Option<Figures>),
    /// It contradicts them: quarantined with the reason, never counted.
    Refused(String),
    /// The job has no record of it: it waits a bounded time, then is quarantined with the reason.
    Unrecorded(String),
}

/// What is known of one job's records.
#[derive(Debug, Clone, Default)]
pub struct JobRecords {
    /// Its manifest, once read (written before the seal; never changed after).
    pub manifest: Option<Arc<Manifest>>,
    /// Its chunks' records as their blobs' metadata gave them.
    pub chunks: BTreeMap<u32, ChunkRecord>,
    /// Chunks whose blob exists without a record (written by an initiator before records): until the
    /// manifest names them, a message about one is held to its own count, its payload capped by that
    /// count alone, as before records.
    pub unrecorded_blobs: BTreeSet<u32>,
    /// Its checkpoint exists (the job is known to a controller; a chunk blob may be purged).
    pub checkpointed: bool,
    /// Its manifest exists but cannot be read: no authority for a seal, which is let through so that
    /// the job is quarantined when it would finish (see `quarantine`).
    pub manifest_unreadable: bool,
}

impl JobRecords {
    /// The results partition the job's messages travel on, as its records say (the manifest's, else
    /// any chunk's; `None`: written by an initiator before partitions were recorded, or nothing
    /// looked up yet). Records are written once, by the submitter: no message can move a job.
    pub fn partition(&self) -> Option<u16> {
        match &self.manifest {
            Some(m) => Some(m.partition),
            None => self.chunks.values().find_map(|r| r.partition),
        }
    }

    /// Something of the job is on record.
    pub fn known(&self) -> bool {
        self.manifest.is_some() || self.manifest_unreadable || self.checkpointed || !self.chunks.is_empty() || !self.unrecorded_blobs.is_empty()
    }

    /// Takes what a HEAD of chunk `c`'s blob found (its metadata; `None`: no blob).
    pub fn found_chunk(&mut self, c: u32, meta: Option<&BTreeMap<String, String>>) {
        match meta.map(ChunkRecord::from_meta) {
            Some(Some(r)) => {
                self.chunks.insert(c, r);
            }
            Some(None) => {
                self.unrecorded_blobs.insert(c);
            }
            None => {}
        }
    }

    /// Adds what another look at the job found (two batches of one job may look at once).
    pub fn merge(&mut self, other: JobRecords) {
        if self.manifest.is_none() {
            self.manifest = other.manifest;
        }
        self.chunks.extend(other.chunks);
        self.unrecorded_blobs.extend(other.unrecorded_blobs);
        self.checkpointed |= other.checkpointed;
        self.manifest_unreadable |= other.manifest_unreadable;
    }

    /// The figures of chunk `c` as recorded (`Err`: the manifest says the job has no such chunk; `Ok(None)`:
    /// nothing recorded yet).
    /// `looked`: the manifest was looked up (a chunk blob without a record is judged by it when it exists).
    fn chunk(&self, c: u32, declared: u64, looked: bool) -> std::result::Result<Option<Figures>, String> {
        let blob = self.chunks.get(&c).map(|r| Figures { transactions: r.transactions, raw_bytes: Some(r.raw_bytes) });
        match &self.manifest {
            Some(m) if c >= m.total_chunks => Err(format!("chunk {c} is outside the job: its manifest has {} chunks", m.total_chunks)),
            Some(m) => {
                let n = m.chunk_transactions.get(c as usize).copied();
                Ok(match (blob, n) {
                    (Some(f), _) => Some(f),
                    (None, Some(n)) => Some(Figures { transactions: n, raw_bytes: None }),
                    (None, None) => None,
                })
            }
            // A chunk from the release before records: held to the manifest once it exists (looked
            // up first), and only without one to the message's own count.
            None if blob.is_none() && self.unrecorded_blobs.contains(&c) && looked => Ok(Some(Figures { transactions: declared, raw_bytes: None })),
            None if blob.is_none() && self.unrecorded_blobs.contains(&c) => Ok(None),
            None => Ok(blob),
        }
    }

    /// Judges one message from what is known (`None`: a record it needs has not been looked up).
    /// `looked`: every lookup was made, so what is missing is missing.
    pub fn judge(&self, item: &Item, looked: bool) -> Option<Verdict> {
        let job = item.job_id();
        let (chunk, declared, what) = match item {
            Item::Result(ResultMessage::Sealed { total_chunks, .. }) => {
                return match &self.manifest {
                    Some(m) if m.total_chunks == *total_chunks || crate::undo::is(crate::undo::Fix::SealAgainstManifest) => Some(Verdict::Agrees(None)),
                    Some(m) => Some(Verdict::Refused(format!(
                        "the seal of job {job} says {total_chunks} chunks, its manifest {}: a seal that disagrees with the manifest is never applied",
                        m.total_chunks
                    ))),
                    None if self.manifest_unreadable => Some(Verdict::Agrees(None)),
                    None if looked => Some(Verdict::Unrecorded(format!("job {job} has no manifest: a seal is sent only after it is written"))),
                    None => None,
                };
            }
            Item::Result(ResultMessage::Abandon { .. }) => {
                return if self.known() {
                    Some(Verdict::Agrees(None))
                } else if looked {
                    Some(Verdict::Unrecorded(format!("job {job} has no records (no manifest, checkpoint or first chunk)")))
                } else {
                    None
                };
            }
            Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions, "result"),
            Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => (item.chunk, item.transactions, "dead-lettered work item"),
        };
        match self.chunk(chunk, declared, looked) {
            Err(why) => Some(Verdict::Refused(format!("{what} for job {job}: {why}"))),
            Ok(Some(f)) if f.transactions != declared && !crate::undo::is(crate::undo::Fix::CountAgainstRecord) => Some(Verdict::Refused(format!(
                "{what} for job {job} chunk {chunk} declares {declared} transactions; the chunk has {} as recorded",
                f.transactions
            ))),
            Ok(Some(f)) => Some(Verdict::Agrees(Some(f))),
            Ok(None) if looked => Some(Verdict::Unrecorded(if self.checkpointed || self.manifest.is_some() {
                format!("{what} for job {job} chunk {chunk}: the job has no record of the chunk (no chunk blob)")
            } else {
                format!("{what} for job {job} chunk {chunk}: the job has no records (no chunk blob, manifest or checkpoint)")
            })),
            Ok(None) => None,
        }
    }
}

/// What becomes of one message once judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Applied, its payload capped by these figures (`None`: it carries none, or is held to its own
    /// count), holding this share of the decode budget while it is.
    Apply(Option<Figures>, u64),
    /// Back to its queue for a while: its job's record of it may yet come (never in practice: the
    /// initiator writes its records before it sends what names them). Why, for the log.
    Wait(String),
    /// Refused: quarantined with the reason, never counted (`recorded`: the job's records contradict
    /// it; else they do not know it).
    Refuse { why: String, recorded: bool },
}

impl Verdict {
    /// What becomes of a message judged so: `item`, the message; `budget`, the decode budget's bytes;
    /// `source` and `receives`, where it was read and how often. A message the records do not know
    /// waits a few receives on the results queue, never into the dead-letter queue (one that reached a
    /// dead-letter queue waited already), then is refused. One whose decoding could take more than the
    /// whole budget is refused, not decoded alone past it (a result of a chunk from the release before
    /// records, held only to its own count).
    pub fn disposition(self, item: &Item, budget: u64, source: Source, receives: u32) -> Disposition {
        match self {
            Verdict::Agrees(Some(f))
                if f.raw_bytes.is_none() && item.decodes() && f.max_memory() > budget && !crate::undo::is(crate::undo::Fix::RefuseOverBudget) =>
            {
                let why = format!(
                    "decoding the result of job {} chunk {} could take {} MiB, more than the decode budget of {} MiB (--decode-budget-mib): refused; redrive it after raising the budget",
                    item.job_id(),
                    item.chunk().unwrap_or_default(),
                    f.max_memory().div_ceil(1 << 20),
                    budget >> 20
                );
                Disposition::Refuse { why, recorded: true }
            }
            Verdict::Agrees(figures) => Disposition::Apply(figures, figures.map_or(0, Figures::max_memory)),
            Verdict::Refused(why) => Disposition::Refuse { why, recorded: true },
            // Undone: taken as agreeing, its cap from what it declares (as before the records).
            Verdict::Unrecorded(_) if crate::undo::is(crate::undo::Fix::UnrecordedQuarantined) => Disposition::Apply(None, 0),
            Verdict::Unrecorded(why) if source == Source::Results && receives < UNRECORDED_RECEIVES => Disposition::Wait(why),
            Verdict::Unrecorded(why) => Disposition::Refuse { why, recorded: false },
        }
    }
}

#[cfg(test)]
mod tests {
    //! The judgement alone: no store.
    use super::*;
    use crate::limits::{MAX_RESULT_BYTES, ROW_FIGURES_BYTES};
    use fleet_domain::codec::accounts_cap;
    use fleet_domain::model::{ChunkOutcome, ChunkRecord, ChunkResult};
    use fleet_domain::requests::RequestCounts;

    fn result(chunk: u32, n: u64) -> Item {
        Item::Result(ResultMessage::Chunk(ChunkResult {
            v: 1,
            job_id: "j".into(),
            chunk,
            transactions: n,
            outcome: ChunkOutcome::Failed { reason: "x".into() },
            requests: RequestCounts::default(),
        }))
    }

    fn seal(n: u32) -> Item {
        Item::Result(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: n })
    }

    fn manifest(chunks: &[u64]) -> Arc<Manifest> {
        let mut m = crate::job::placeholder_manifest("j", chunks.len() as u32, chunks.iter().sum());
        m.chunk_transactions = chunks.to_vec();
        Arc::new(m)
    }

    #[test]
    fn messages_are_held_to_the_records_never_the_other_way() {
        let mut r = JobRecords::default();
        assert_eq!(r.judge(&result(0, 3), false), None, "not looked up yet");
        assert!(matches!(r.judge(&result(0, 3), true), Some(Verdict::Unrecorded(_))), "no records at all");
        assert!(matches!(r.judge(&seal(3), true), Some(Verdict::Unrecorded(_))), "a seal without a manifest");
        r.chunks.insert(0, ChunkRecord { transactions: 3, raw_bytes: 300, partition: None });
        let f = Figures { transactions: 3, raw_bytes: Some(300) };
        assert_eq!(r.judge(&result(0, 3), false), Some(Verdict::Agrees(Some(f))));
        assert!(matches!(r.judge(&result(0, 11), false), Some(Verdict::Refused(why)) if why.contains("declares 11 transactions; the chunk has 3")));
        assert_eq!(r.judge(&result(1, 3), false), None, "chunk 1 not looked up yet");
        r.manifest = Some(manifest(&[3, 4, 5]));
        assert_eq!(r.judge(&result(2, 5), false), Some(Verdict::Agrees(Some(Figures { transactions: 5, raw_bytes: None }))), "from the manifest");
        assert!(matches!(r.judge(&result(3, 1), false), Some(Verdict::Refused(why)) if why.contains("outside the job")));
        assert_eq!(r.judge(&seal(3), false), Some(Verdict::Agrees(None)));
        assert!(matches!(r.judge(&seal(1), false), Some(Verdict::Refused(why)) if why.contains("says 1 chunks, its manifest 3")));
    }

    #[test]
    fn a_payload_is_capped_by_its_chunk_not_by_what_it_declares() {
        let f = Figures { transactions: 3, raw_bytes: Some(120) };
        assert_eq!(f.max_rows(), 3);
        assert_eq!(f.max_bytes(), 120 + 3 * ROW_FIGURES_BYTES);
        assert!(f.max_memory() < 2048, "a 3-row chunk's result is held to a few kilobytes: {}", f.max_memory());
        let big = Figures { transactions: 200_000, raw_bytes: None };
        assert_eq!(big.max_bytes(), accounts_cap(200_000, MAX_RESULT_BYTES));
    }

    #[test]
    fn an_unknown_message_waits_a_few_receives_on_the_results_queue_only() {
        let unknown = || Verdict::Unrecorded("no record".into());
        let r = result(0, 3);
        assert_eq!(unknown().disposition(&r, 1 << 20, Source::Results, 1), Disposition::Wait("no record".into()));
        assert_eq!(unknown().disposition(&r, 1 << 20, Source::Results, UNRECORDED_RECEIVES), Disposition::Refuse { why: "no record".into(), recorded: false });
        assert_eq!(unknown().disposition(&r, 1 << 20, Source::ResultsDeadLetter, 1), Disposition::Refuse { why: "no record".into(), recorded: false });
        let f = Figures { transactions: 3, raw_bytes: Some(300) };
        assert_eq!(Verdict::Agrees(Some(f)).disposition(&r, 1 << 20, Source::Results, 1), Disposition::Apply(Some(f), f.max_memory()));
        let old = Figures { transactions: 3, raw_bytes: None };
        assert_eq!(
            Verdict::Agrees(Some(old)).disposition(&r, 1 << 20, Source::Results, 1),
            Disposition::Apply(Some(old), old.max_memory()),
            "a failure decodes nothing"
        );
    }
}
