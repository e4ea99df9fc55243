//! What an item does to a job: the transition every message makes (a first result counted, a
//! failure recorded, a real result replacing a failure, the seal, an abandon), and a batch applied
//! with its deliveries taken in as unsaved.

use std::time::Instant;

use fleet_domain::model::{ChunkOutcome, ChunkResult, FailedChunk, ResultMessage};

use super::{Job, Phase};
use crate::item::{Item, Ready, Source, Unread};
use crate::limits::DEAD_LETTER_REASON;

impl<H> Job<H> {
    /// Applies a batch's items to it, a seal first (its size, checked against the manifest, is a fact
    /// whatever the order): each delivery is taken in as unsaved. A job whose ending is committed takes
    /// nothing more (what arrives then is a late duplicate or comes too late): its deliveries are only
    /// kept for the finish. On an error (a payload S3 could not give yet) the items not applied and
    /// their deliveries are returned with it, the job keeping what it applied.
    #[allow(clippy::type_complexity)]
    pub fn apply_batch<E: std::fmt::Display>(&mut self, items: Vec<(Ready<E>, (Source, H))>, now: Instant) -> Result<(), (Unread<E>, Vec<(Source, H)>)> {
        let mut pairs = items;
        pairs.sort_by_key(|(r, _)| !r.is_seal());
        let mut applied = Vec::with_capacity(pairs.len());
        let mut pairs = pairs.into_iter();
        let mut failed = None;
        let mut news = false;
        while let Some((item, k)) = pairs.next() {
            if self.is_open() {
                match self.apply(item) {
                    Ok(changed) => news |= changed,
                    Err(e) => {
                        applied.push(k);
                        applied.extend(pairs.by_ref().map(|(_, k)| k));
                        failed = Some(e);
                        break;
                    }
                }
            }
            applied.push(k);
        }
        if crate::undo::is(crate::undo::Fix::DuplicatesNotNews) {
            news = !applied.is_empty();
        }
        if news {
            self.news = now;
            self.changed = true;
        }
        if let Some(e) = failed {
            return Err((e, applied));
        }
        self.unsaved.extend(applied);
        Ok(())
    }

    /// Applies one item (the transition every message makes); returns whether it changed the job
    /// (its news): a duplicate, a conflicting seal, a chunk beyond its size does not. A payload that
    /// may be read later is the error (the job unchanged).
    pub fn apply<E: std::fmt::Display>(&mut self, ready: Ready<E>) -> Result<bool, Unread<E>> {
        let Ready { item, accounts, .. } = ready;
        let cp = &mut self.tally.cp;
        let (chunk, transactions) = match &item {
            Item::Result(ResultMessage::Sealed { total_chunks, .. }) => {
                let total = *total_chunks;
                return Ok(match cp.total_chunks {
                    Some(t) if t != total => {
                        tracing::error!(job = %cp.job_id, total, sealed_before = t, "conflicting seal ignored");
                        false
                    }
                    Some(_) => false,
                    None => {
                        if let Some(c) = cp.accounted.iter().find(|&&c| c >= total) {
                            tracing::error!(job = %cp.job_id, chunk = c, total, "a counted chunk lies beyond the sealed size");
                        }
                        cp.total_chunks = Some(total);
                        true
                    }
                });
            }
            Item::Result(ResultMessage::Abandon { reason, .. }) => {
                tracing::warn!(job = %cp.job_id, %reason, accounted = cp.accounted.len(), "job abandoned on request");
                return Ok(match &mut self.phase {
                    Phase::Open { abandon: abandon @ None, .. } => {
                        *abandon = Some(reason.clone());
                        true
                    }
                    _ => false,
                });
            }
            Item::Result(ResultMessage::Chunk(c)) => (c.chunk, c.transactions),
            Item::Dead { item, .. } | Item::Result(ResultMessage::DeadLettered { item, .. }) => (item.chunk, item.transactions),
        };
        if cp.total_chunks.is_some_and(|t| chunk >= t) {
            // Not from this job as we know it: drop it loudly rather than corrupt the totals.
            tracing::error!(job = %cp.job_id, chunk, total = ?cp.total_chunks, "chunk beyond the job's size; ignored");
            return Ok(false);
        }
        if cp.accounted.contains(&chunk) {
            let real = matches!(&item, Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Processed { .. }, .. })));
            match cp.failed_chunks.iter().position(|f| f.chunk == chunk) {
                // A real result beats a dead letter or a failure report (a work item dead-lettered after
                // it was billed, a processor that died between sending a result and deleting its item):
                // the chunk is counted from it instead, as the job is not finished yet.
                Some(i) if real => {
                    let failed = cp.failed_chunks.remove(i);
                    cp.accounted.remove(&chunk);
                    tracing::warn!(job = %cp.job_id, chunk, was = %failed.reason, "a chunk recorded as failed has its real result: counted from it");
                }
                failed => {
                    // The processor's own failure report says more than the dead letter: keep its reason.
                    if let (Some(i), Item::Result(ResultMessage::Chunk(ChunkResult { outcome: ChunkOutcome::Failed { reason }, .. }))) = (failed, &item) {
                        if cp.failed_chunks[i].reason == DEAD_LETTER_REASON {
                            cp.failed_chunks[i].reason = reason.clone();
                        }
                    }
                    tracing::debug!(job = %cp.job_id, chunk, "duplicate; already counted");
                    return Ok(false);
                }
            }
        }
        match item {
            Item::Result(ResultMessage::Chunk(c)) => {
                match c.outcome {
                    ChunkOutcome::Processed { .. } => match accounts.expect("prepared with its payload") {
                        Ok(accounts) => match accounts.transactions() {
                            Some(counted) if counted == c.transactions => match self.tally.totals.try_add_all(accounts.iter()) {
                                Ok(()) => cp.processed_transactions = cp.processed_transactions.saturating_add(counted),
                                Err(e) => {
                                    cp.failed_chunks.push(FailedChunk { lines: Vec::new(), chunk, transactions, reason: format!("result not added: {e}") })
                                }
                            },
                            counted => cp.failed_chunks.push(FailedChunk {
                                lines: Vec::new(),
                                chunk,
                                transactions,
                                reason: match counted {
                                    Some(n) => format!("result counts {n} transactions, the chunk has {}", c.transactions),
                                    None => "result counts more transactions than a count can hold".to_string(),
                                },
                            }),
                        },
                        // S3 unreachable: leave the message; it comes back.
                        Err(e) if e.retryable => return Err(e),
                        // Missing or corrupt payload: it never becomes readable; the chunk failed.
                        Err(e) => {
                            tracing::error!(job = %cp.job_id, chunk, error = %e, "result payload unreadable; chunk recorded as failed");
                            cp.failed_chunks.push(FailedChunk { lines: Vec::new(), chunk, transactions, reason: format!("result unreadable: {e}") })
                        }
                    },
                    ChunkOutcome::Failed { reason } => cp.failed_chunks.push(FailedChunk { lines: Vec::new(), chunk, transactions, reason }),
                }
                cp.requests.merge(&c.requests);
            }
            Item::Dead { receives, reason, .. } | Item::Result(ResultMessage::DeadLettered { receives, reason, .. }) => {
                tracing::warn!(job = %cp.job_id, chunk, receives, ?reason, "work item dead-lettered; chunk recorded as failed");
                cp.failed_chunks.push(FailedChunk { lines: Vec::new(), chunk, transactions, reason: reason.unwrap_or_else(|| DEAD_LETTER_REASON.to_string()) });
            }
            Item::Result(ResultMessage::Sealed { .. } | ResultMessage::Abandon { .. }) => {}
        }
        cp.accounted.insert(chunk);
        Ok(true)
    }
}
