//! The path of one batch through the aggregator: its messages grouped by job, each checked against
//! its job's records, forwarded when it travels on another partition, its payload fetched within the
//! budget, and applied to its job under the job's lock; what then becomes of the messages (deleted,
//! handed back, held, quarantined) and of the job (saved, finished, dropped, handed over).

use std::collections::BTreeMap;
use std::time::Duration;

use fleet_domain::requests::{Billed, Op, RequestCounts};
use fleet_domain::model::{ChunkOutcome, ResultMessage};
use fleet_engine::Kept;
use fleet_io::call::counted;
use fleet_io::error::{Error, Result};
use fleet_io::op::sqs_extra_chunks;
use tokio::time::Instant;

use super::budget;
use super::carried::CarriedCalls;
use super::item::{self, parse, prepare, Item, Ready, Source};
use super::job::{Asker, Job, Next};
use super::limits::{FAILING_FOR, STRAY_RETRY, UNRECORDED_WAITS};
use super::records::Verdict;
use super::{unpaired, Aggregator, Applied, Taken};
use controller_core::records::Disposition;

/// What a job's messages bring to it: items to apply (with the calls that looked its records up), or
/// a failure met before it (its records could not be read), taken as the job's own.
enum Work {
    Apply(Vec<Ready>, RequestCounts),
    Failed(Error),
}

/// What became of a job's messages.
enum Step {
    /// Applied (deletable now, or after the next checkpoint when empty).
    Delete(Vec<Kept>),
    /// The job is another controller's: its messages, to hand back.
    NotMine(Vec<Kept>, Duration),
}

impl Aggregator {
    /// Applies one received batch. Each job's messages are first checked against the job's own
    /// records (see `records`): those that contradict them are quarantined, those the job has no
    /// record of wait (a few receives) and are then quarantined, and only the rest reach the job,
    /// their payloads fetched and decoded within the memory budget (see `budget`) before the job is
    /// locked. Messages of a job whose state could not be saved are not deleted (held, or dropped here
    /// to come back after their visibility timeout), and that job is reloaded from its last
    /// checkpoint next time. Unreadable messages are quarantined, then deleted. The batch's jobs are
    /// applied concurrently. The messages applied and not returned stay with their jobs until a
    /// checkpoint covers them.
    pub async fn apply(&self, source: Source, msgs: Vec<Kept>) -> Applied {
        self.apply_from(source, msgs, Receipt::Received).await
    }

    /// [`apply`](Self::apply), of messages a receive brought now or the hold kept (`receipt`).
    pub(super) async fn apply_from(&self, source: Source, msgs: Vec<Kept>, receipt: Receipt) -> Applied {
        let mut applied = Applied::default();
        let mut groups: BTreeMap<String, Vec<(Kept, Item)>> = BTreeMap::new();
        for m in msgs {
            // Of a partition this controller no longer reads (a held message retried, or a batch that
            // outlived its partition's stop): straight back to the queue for its new reader, never
            // applied here (it would load and lease its job after the partition was let go, and the
            // new reader would hand the job's messages back for ever: seeds 7000529, 7002198).
            if self.reading.not_read(m.queue()) {
                tracing::debug!(queue = m.queue(), message_id = %m.id, "a message of a partition no longer read here: handed back");
                applied.release.push((m, Duration::ZERO));
                continue;
            }
            let parsed = parse(source, &m).map_err(|e| e.to_string());
            // Authority by role: only a role that may send it (checked before anything of the job is
            // looked up, loaded or leased).
            let authorized = match (&self.keyring, parsed) {
                (Some(ring), Ok(item)) if !crate::undo::is(crate::undo::Fix::RolesChecked) => match item::authorize(ring, source, &m, &item) {
                    Ok(_) => Ok(item),
                    Err(why) => {
                        crate::events::MessageUnauthorized { job: item.job_id(), message_id: &m.id, reason: &why }.emit();
                        Err(why)
                    }
                },
                (_, parsed) => parsed,
            };
            match authorized {
                Ok(item) => groups.entry(item.job_id().to_string()).or_default().push((m, item)),
                Err(why) => applied.delete.extend(self.unreadable.keep(source, m, &why, &self.holding).await),
            }
        }
        if self.reading.partitioned() {
            self.memory.with(|r| {
                for (job_id, items) in &groups {
                    // Until its records are read (`apply_group`), which name it for good: a stray
                    // must not move a job this controller holds.
                    if let Some(p) = items.first().and_then(|(k, _)| self.reading.partition_of(k.queue())) {
                        r.came_from(job_id, p);
                    }
                }
            });
        }
        let outcomes = futures::future::join_all(groups.into_iter().map(|(job_id, items)| self.apply_group(source, job_id, items, receipt))).await;
        for a in outcomes {
            applied.delete.extend(a.delete);
            applied.release.extend(a.release);
        }
        applied
    }

    /// One job's messages of a batch: checked against its records, then applied in runs that fit the
    /// memory budget (each run's share taken before the job is locked, given back after).
    async fn apply_group(&self, source: Source, job_id: String, items: Vec<(Kept, Item)>, receipt: Receipt) -> Applied {
        let mut out = Applied::default();
        let (kept, items): (Vec<Kept>, Vec<Item>) = items.into_iter().unzip();
        let nothing = || Work::Apply(Vec::new(), RequestCounts::default());
        if self.books.known.is_finished(&job_id) {
            record_step(&job_id, self.apply_job(&job_id, source, nothing(), kept).await, &mut out);
            return out;
        }
        // A job whose S3 calls just failed is turned back without a call (see `apply_job`).
        let loaded = self.memory.loaded(&job_id);
        // The lookups' calls, as the store counts them: the job's, kept for it on every path that
        // does not apply them to it (`Unspent`).
        let (checked, looked) = match self.memory.turned_back(&job_id, loaded) {
            Some(e) => (Err(e), RequestCounts::default()),
            None => counted(self.books.records.check(&job_id, &items)).await,
        };
        let mut looked = Unspent { carried: self.memory.carried(), job: &job_id, calls: looked };
        // The receive that brought them: SQS's call shared by the jobs of a batch, attributed to each
        // of them by rule, once, with the further 64 KiB of what it brought the job (none for
        // messages applied again from the hold: no receive brought them). See docs/requests.md.
        if receipt == Receipt::Received {
            looked.calls.add(Billed::call(Op::SqsReceiveMessage), 1);
            looked.calls.add(Billed::Extra64KiB { fifo: false }, sqs_extra_chunks(kept.iter().map(|k| k.body.len()).sum()));
        }
        let checked = match checked {
            Ok(c) => c,
            // Taken as a failure of the job (held with it when it may pass).
            Err(e) => {
                record_step(&job_id, self.apply_job(&job_id, source, Work::Failed(e), kept).await, &mut out);
                return out;
            }
        };
        if let Some(status) = checked.finished {
            // Finished, its blobs purged: what arrives are late duplicates (its report written: the
            // lookups are no report's).
            looked.take();
            self.books.remember_finished(&job_id, status);
            record_step(&job_id, self.apply_job(&job_id, source, nothing(), kept).await, &mut out);
            return out;
        }
        // Messages read from a partition other than the one the job's records name are strays: sent
        // on to their partition, never a reason to load or lease the job here (its own reader would
        // hand its real results back for ever while this lease lasted).
        let (kept, items, verdicts) = match checked.partition {
            Some(p) => self.forward_strays(&job_id, p, kept, items, checked.verdicts, &mut out).await,
            None => (kept, items, checked.verdicts),
        };
        if kept.is_empty() {
            return out;
        }
        let mut agreeing = Vec::with_capacity(items.len());
        let budget = self.budget.bytes();
        for ((k, item), verdict) in kept.into_iter().zip(items).zip(verdicts) {
            match verdict.disposition(&item, budget, source, k.receive_count) {
                Disposition::Apply(figures, share) => agreeing.push(((k, item, figures), share)),
                Disposition::Wait(why) => {
                    tracing::debug!(job = %job_id, message_id = %k.id, receives = k.receive_count, %why, "no record yet: back to the queue");
                    out.release.push((k, UNRECORDED_WAITS));
                }
                Disposition::Refuse { why, recorded } => {
                    crate::events::MessageRefused { job: &job_id, message_id: &k.id, reason: &why, recorded }.emit();
                    out.delete.extend(self.unreadable.keep(source, k, &why, &self.holding).await);
                }
            }
        }
        for (run, share) in budget::runs(agreeing, self.budget.bytes()) {
            let reserved = self.budget.take(share).await;
            let (kept, readies): (Vec<Kept>, Vec<_>) = run.into_iter().map(|(k, item, figures)| (k, (item, figures))).unzip();
            // The payloads' reads count for the job, every attempt, as the store counts them.
            let prepared =
                futures::future::join_all(readies.into_iter().map(|(item, figures)| prepare(item, figures, self.store.as_ref(), self.offload_decoding)));
            let (readies, read) = counted(prepared).await;
            let mut calls = looked.take();
            calls.merge(&read);
            let step = self.apply_job(&job_id, source, Work::Apply(readies, calls), kept).await;
            drop(reserved);
            record_step(&job_id, step, &mut out);
        }
        out
    }

    /// Sends on the messages of a job whose records name results partition `p` that were read from
    /// another partition's queue, and returns the rest (with their items and verdicts). A forwarded
    /// stray is deleted once sent (at its job's reader it is judged again, a duplicate when it is a
    /// copy); one whose send failed comes back later. The job's partition in memory is the recorded one.
    async fn forward_strays(
        &self,
        job_id: &str,
        p: u16,
        kept: Vec<Kept>,
        items: Vec<Item>,
        verdicts: Vec<Verdict>,
        out: &mut Applied,
    ) -> (Vec<Kept>, Vec<Item>, Vec<Verdict>) {
        if self.reading.is_partition(p) {
            self.memory.with(|r| r.recorded_in(job_id, p));
        }
        let to = self.strays_to.get(&p).filter(|_| !crate::undo::is(crate::undo::Fix::StraysForwarded));
        let mut rest = (Vec::with_capacity(kept.len()), Vec::with_capacity(kept.len()), Vec::with_capacity(kept.len()));
        let mut strays = Vec::new();
        for ((k, item), verdict) in kept.into_iter().zip(items).zip(verdicts) {
            match (self.reading.partition_of(k.queue()), to) {
                (Some(from), Some(_)) if from != p => {
                    crate::events::MessageStray { job: job_id, message_id: &k.id, from, to: p }.emit();
                    strays.push(k);
                }
                _ => {
                    rest.0.push(k);
                    rest.1.push(item);
                    rest.2.push(verdict);
                }
            }
        }
        // A job only strays were read of leaves nothing here (its partition's entry was the stray's).
        if rest.0.is_empty() {
            self.memory.with(|r| r.only_strays(job_id));
        }
        if let (Some(to), false) = (to, strays.is_empty()) {
            let outgoing: Vec<fleet_io::queue::Outgoing> =
                strays.iter().map(|k| fleet_io::queue::Outgoing { body: k.body.clone(), attrs: k.attrs.clone(), dedup: None }).collect();
            match to.send_messages(&outgoing).await {
                Ok(_) => out.delete.extend(strays),
                Err(e) => {
                    tracing::warn!(job = %job_id, partition = p, error = %e, "could not forward strays to their job's partition; they come back");
                    out.release.extend(strays.into_iter().map(|k| (k, STRAY_RETRY)));
                }
            }
        }
        rest
    }

    /// Applies a job's items under its lock; returns the messages that may be deleted now (the job
    /// finished or was checkpointed, or they belong to a job finished before). On an error everything
    /// applied since the last checkpoint is dropped with the job; those messages were not deleted:
    /// held, with this batch's, when the failure may pass, else they come back.
    async fn apply_job(&self, job_id: &str, source: Source, work: Work, kept: Vec<Kept>) -> Result<Step> {
        if self.books.known.is_finished(job_id) {
            tracing::debug!(job = %job_id, n = kept.len(), "late messages of a finished job");
            return Ok(Step::Delete(
                self.unreadable.complete_late(&self.books.known, &self.holding, job_id, kept.into_iter().map(|k| (source, k)).collect()).await,
            ));
        }
        let mut kept: Vec<(Source, Kept)> = kept.into_iter().map(|k| (source, k)).collect();
        let slot = self.memory.slot(job_id);
        let step = {
            let mut loaded = slot.lock().await;
            let marked = self.memory.with(|r| r.failing_mark(job_id));
            let failing = marked.is_some_and(|until| Instant::now().into_std() < until);
            let step = match (work, self.memory.turned_back(job_id, loaded.is_some())) {
                (Work::Failed(e), _) => Err(e),
                (Work::Apply(_, measured), Some(e)) => {
                    self.memory.carried().keep(job_id, &measured);
                    Err(e)
                }
                (Work::Apply(items, looked), None) => self.apply_locked(job_id, &mut loaded, items, &mut kept, looked).await,
            };
            match &step {
                Err(e) => {
                    // The batch's span (`apply_results`) shows the failure.
                    fleet_io::telemetry::fail(&tracing::Span::current(), format_args!("job {job_id}: {e}"));
                    if e.is_retryable() && !failing {
                        self.memory.with(|r| r.failed(job_id, (Instant::now() + FAILING_FOR).into_std()));
                    }
                    self.holding.drop_job(&mut loaded, std::mem::take(&mut kept), e);
                }
                Ok(_) if marked.is_some() => {
                    self.memory.with(|r| r.answered(job_id));
                }
                Ok(_) => {}
            }
            step
        };
        drop(slot);
        self.memory.prune(job_id);
        step
    }

    /// Applies items to a job in memory (loaded first if it is not): the messages of `kept` are taken
    /// by the job (or returned in the step); on an error, those not taken are left in it.
    async fn apply_locked(
        &self,
        job_id: &str,
        loaded: &mut Option<Job>,
        items: Vec<Ready>,
        kept: &mut Vec<(Source, Kept)>,
        looked: RequestCounts,
    ) -> Result<Step> {
        // The calls made for it before its lock (its records looked up, its payloads read, the
        // receive attributed to it) count for it, kept for it when it is not taken here now.
        let mut ctl = looked;
        // A job in memory whose lease could not be kept fresh is reloaded (or left to its new owner).
        let stale = match loaded.as_ref() {
            Some(j) => !self.books.leases.fresh(j.lease()).await,
            None => false,
        };
        if stale {
            self.keep_lease(job_id, loaded).await;
        }
        if loaded.is_none() {
            // Its lease and its load, as the store counts them; kept for the job when it is not
            // taken here now (another controller's, or a store error).
            let (taken, calls) = counted(self.books.take(job_id)).await;
            ctl.merge(&calls);
            let taken = match taken {
                Ok(t) => t,
                Err(e) => {
                    self.memory.carried().keep(job_id, &ctl);
                    return Err(e);
                }
            };
            if matches!(taken, Taken::Busy(_)) {
                self.memory.carried().keep(job_id, &ctl);
            }
            match taken {
                // Its partition let go of while the job was being taken: given back at once with its
                // messages, for the partition's new reader.
                Taken::Open(job) if kept.iter().any(|(_, k)| self.reading.not_read(k.queue())) => {
                    self.memory.carried().keep(job_id, &ctl);
                    self.memory.carried().keep_dropped(job_id, job.writes().carry());
                    if let Err(e) = self.books.leases.release(job_id, job.lease()).await {
                        tracing::warn!(job = %job_id, error = %e, "could not give a lease back; it expires on its own");
                    }
                    return Ok(Step::NotMine(unpaired(kept), Duration::ZERO));
                }
                Taken::Open(job) => *loaded = Some(*job),
                Taken::AlreadyFinished => {
                    return Ok(Step::Delete(self.unreadable.complete_late(&self.books.known, &self.holding, job_id, std::mem::take(kept)).await))
                }
                Taken::Busy(after) => {
                    tracing::debug!(job = %job_id, n = kept.len(), after_ms = after.as_millis() as u64, "job owned by another controller; messages handed back");
                    return Ok(Step::NotMine(unpaired(kept), after));
                }
            }
        }
        let job = loaded.as_mut().expect("loaded above");
        // Every item here agrees with the job's records (see `records`).
        let taken = std::mem::take(kept);
        debug_assert_eq!(taken.len(), items.len(), "one message per item");
        let now = Instant::now();
        job.count(&ctl);
        // The chunks this batch brings processed results for: read ahead of the job's claim.
        let processed: Vec<(u32, u64)> = items
            .iter()
            .filter_map(|r| match &r.item {
                Item::Result(ResultMessage::Chunk(c)) if matches!(c.outcome, ChunkOutcome::Processed { .. }) => Some((c.chunk, c.transactions)),
                _ => None,
            })
            .collect();
        if let Err((e, back)) = job.apply_batch(items.into_iter().zip(taken).collect(), now) {
            *kept = back;
            return Err(e);
        }
        for (chunk, rows) in processed {
            self.books.read_ahead(job_id, chunk, rows);
        }
        let floor = self.expiry.idle_floor();
        match job.next(now, floor, self.settle, Asker::Batch) {
            // Every chunk in: finished now, unless some of them failed, when a real result may still
            // replace a failure (see `settle`).
            Next::Finish => self.books.finish(job_id, loaded).await.map(Step::Delete),
            Next::Save => Ok(Step::Delete(self.flush_job(job_id, loaded).await)),
            Next::Wait => Ok(Step::Delete(Vec::new())),
        }
    }
}

/// How a batch's messages came: a receive brought them now (its call attributed to their jobs), or
/// the hold kept them through an outage (no receive made).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Receipt {
    Received,
    Held,
}

/// Calls made for a job that are its own whatever becomes of its messages: applied to the job when
/// they reach it (`take`), else kept for it when this is dropped, whichever path returned first.
struct Unspent<'a> {
    carried: &'a CarriedCalls,
    job: &'a str,
    calls: RequestCounts,
}

impl Unspent<'_> {
    /// The calls, to apply to the job (nothing is left to keep).
    fn take(&mut self) -> RequestCounts {
        std::mem::take(&mut self.calls)
    }
}

impl Drop for Unspent<'_> {
    fn drop(&mut self) {
        self.carried.keep(self.job, &self.calls);
    }
}

/// Adds what became of a job's messages to `out`.
fn record_step(job_id: &str, step: Result<Step>, out: &mut Applied) {
    match step {
        Ok(Step::Delete(deletable)) => out.delete.extend(deletable),
        Ok(Step::NotMine(kept, after)) => out.release.extend(kept.into_iter().map(|k| (k, after))),
        // Held (see `hold`) when the failure may pass.
        Err(e) if e.is_retryable() => tracing::debug!(job = %job_id, error = %e, "could not apply results; held"),
        Err(e) => tracing::warn!(job = %job_id, error = %e, "could not apply results; they will be redelivered"),
    }
}
