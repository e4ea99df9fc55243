//! Why one file: the jobs nobody holds in memory (dormant, found by their markers) and the rules that
//! end quiet jobs (abandon, stall, settle) read the same view of the open jobs; split, a rule would
//! judge a job by a view another file keeps.
//!
//! The dormant and expiry scan: open jobs are found by their `open/{job}` markers at start and every
//! `abandon_after` (one HEAD each, remembered dormant until due). A job without news for
//! `abandon_after` that never sealed is finished as `abandoned`; a sealed job without news for
//! `stall_after`, once every message that was in the fleet's queues at its last news has left them
//! (`Emptied`: nothing can still arrive for it, its work item was lost to retention or a FIFO
//! de-duplication drop), is finished as `partial`, naming the chunks it never got. News counts since
//! the controller started, or since the store answered again after an outage, at the earliest, so
//! that a controller that was down (or could not reach S3) does not finish a job whose seal or results
//! wait on its queue (or in its hold). A dormant job is loaded only by the reader of the results
//! partition its checkpoint names (any controller loads one whose checkpoint names none, then takes
//! the partition from the checkpoint it loaded or else from the job's manifest, and gives the job back
//! at once if that partition is read elsewhere), and a partition let go takes its dormant jobs with it.

use std::sync::Arc;
use std::time::Duration;

use fleet_domain::layout::{check_job_id, checkpoint_keys, OPEN_PREFIX};
use fleet_domain::model::Progress;
use fleet_engine::Kept;
use fleet_io::call::counted;
use fleet_io::error::Result;
use fleet_io::queue::Queue;
use tokio::time::Instant;

pub use controller_core::expiry::{Dormant, Emptied, Look, DEPTH_LAG};
use controller_core::expiry::{Ending, QuietRule};

use super::known::Expiry;
use super::limits::MAX_OPEN_JOBS;
use super::{Aggregator, Taken};

impl Aggregator {
    /// Finishes as `abandoned` every unsealed job without news for `after`, and (when a stall limit is
    /// set) as `partial` every sealed job without news for that long while the fleet's queues are
    /// empty; in memory, or dormant (known from its open marker only). Returns the messages the
    /// reports cover, for deletion. Scans the open markers again when the last scan is `after` old.
    pub async fn expire(&self, after: Duration) -> Vec<Kept> {
        // Nothing is finished while the store does not answer, and no job's idle time counts from
        // before it answered again. A job with messages held (its own calls fail, the store answers
        // others) is not finished until they are applied; the other jobs are not held up by it.
        if self.store.breaker().is_some_and(|b| b.is_open()) {
            self.expiry.raise_floor();
            return Vec::new();
        }
        let held_jobs = self.holding.jobs();
        let floor = self.expiry.idle_floor();
        // At start (the first tick) and every `after`: jobs whose owner died and whose messages never
        // come back are found here.
        // A dormant job whose checkpoint names no partition (the release before partitions wrote it)
        // may be loaded by any controller, and may have news at another meanwhile: its news is dated
        // by when this one first saw its checkpoint's time change (one clock), so it is looked at
        // every tick while one is known, not every `after` (a look an abandon time apart dated an
        // owner's last checkpoint at the next look and abandoned the job two abandon times after
        // its last news: found by the simulation, seed 845122901, a rolling upgrade from that
        // release).
        let unpartitioned = !crate::undo::is(crate::undo::Fix::UnpartitionedLookedAtEachTick) && self.books.known.dormant(|d| d.any_unpartitioned());
        let every = if unpartitioned { (after / 10).clamp(Duration::from_millis(200), Duration::from_secs(60)) } else { after };
        let scan = self.expiry.scan_due(every);
        if scan {
            match self.scan_open().await {
                Ok(n) => tracing::info!(open = n, dormant = self.books.known.dormant(|d| d.len()), "open jobs scanned"),
                Err(e) => {
                    // Looked for again at the next tick, not after another `after`: a scan that failed
                    // at start (S3 out) would otherwise leave a restarted controller blind to its
                    // dormant jobs for a whole abandon time (found by the simulation, seed 15).
                    if !crate::undo::is(crate::undo::Fix::ScanRetried) {
                        self.expiry.rescan_soon();
                    }
                    tracing::warn!(error = %e, "could not scan the open jobs; trying again at the next tick");
                }
            }
        }
        let now = Instant::now();
        let stall = self.stall.as_ref().map(|s| s.after);
        let rule = QuietRule { abandon_after: after, stall_after: stall };
        let load_after = |sealed: bool| Some(rule.load_after(sealed, self.settle));
        let skipped = |job: &str, d: &Dormant| held_jobs.contains(job) || !self.reading.loads_here(d.partition);
        let due = self.books.known.dormant(|dormant| dormant.due(now.into_std(), floor.into_std(), skipped, load_after));
        let mut looked = false;
        for (job_id, d) in due {
            let slot = self.memory.slot(&job_id);
            {
                let mut loaded = slot.lock().await;
                if loaded.is_none() {
                    // Its lease, its load and its manifest, as the store counts them: the job's, kept
                    // for it when it is not kept here.
                    let (taken, mut ctl) = counted(self.books.take(&job_id)).await;
                    match taken {
                        // Its idle time is read again from the checkpoint just loaded (news on another
                        // controller since the scan moved it), not from what the scan saw.
                        Ok(Taken::Open(mut job)) => {
                            if crate::undo::is(crate::undo::Fix::NewsFromCheckpoint) {
                                job.heard(Instant::from_std(d.since));
                            }
                            // A checkpoint naming no partition (written by the release before
                            // partitions, before any message of the job came from one) says nothing
                            // of where its messages travel; its manifest, written at submission, does.
                            // Kept by a controller that does not read that partition, the job's lease
                            // would shut the partition's reader out for good (seed 1630).
                            // A manifest that cannot be read for good (too large, refused) is no
                            // authority: the job is kept here, as one without a manifest is.
                            let mut unknown = false;
                            let partitioned = self.reading.partitioned();
                            if partitioned && job.tally().partition().is_none() && !crate::undo::is(crate::undo::Fix::PartitionFromManifest) {
                                let (found, calls) = counted(self.books.manifest_partition(&job_id)).await;
                                ctl.merge(&calls);
                                match found {
                                    Ok(Some(p)) => job.travels_on(p),
                                    Ok(None) => {}
                                    Err(e) if e.is_retryable() => {
                                        tracing::warn!(job = %job_id, error = %e, "could not read the manifest of a dormant job for its partition; given back until it can");
                                        self.books.known.dormant(|dormant| dormant.put_back(&job_id, d));
                                        unknown = true;
                                    }
                                    Err(e) => {
                                        tracing::warn!(job = %job_id, error = %e, "the manifest of a dormant job cannot be read; the job is kept here");
                                    }
                                }
                            }
                            if unknown || !self.reading.loads_here(job.tally().partition()) {
                                // The checkpoint just loaded (or the manifest) names a partition
                                // another controller reads: left to that reader, which finishes it.
                                // Kept here, its lease would shut that reader out while this
                                // controller finished it without them.
                                if !unknown {
                                    tracing::info!(job = %job_id, partition = ?job.tally().partition(), "a dormant job is left to the reader of its partition");
                                }
                                if let Err(e) = self.books.leases.release(&job_id, job.lease()).await {
                                    tracing::warn!(job = %job_id, error = %e, "could not give a lease back; it expires on its own");
                                }
                                self.memory.carried().keep_dropped(&job_id, job.writes().carry());
                            } else {
                                // Let go of with its partition, like a job its messages brought.
                                if let Some(p) = job.tally().partition().filter(|p| self.reading.is_partition(*p)) {
                                    self.memory.with(|r| r.recorded_in(&job_id, p));
                                }
                                job.count(&std::mem::take(&mut ctl));
                                *loaded = Some(*job)
                            }
                        }
                        // Finished (its finish cut short, or its purge not recorded).
                        Ok(Taken::AlreadyFinished) => {
                            let _ = self.books.close_finished(&job_id).await;
                        }
                        // Another controller holds its lease: that owner finishes it, or the lease
                        // runs out, which this controller judges on its own clock (`sighting`), so a
                        // dead owner's lease seen here for the first time looks busy for a lease.
                        // Looked at again then, not at the next scan an abandon time later (found
                        // by the simulation, seed 1: a stalled job finished 3,533 s late).
                        Ok(Taken::Busy(after)) => {
                            if !crate::undo::is(crate::undo::Fix::OneClock) {
                                let not_before = Some((Instant::now() + after.max(self.books.leases.ttl() / 2)).into_std());
                                self.books.known.dormant(|dormant| dormant.keep(&job_id, Dormant { not_before, ..d }));
                            }
                        }
                        Err(e) => {
                            tracing::warn!(job = %job_id, error = %e, "could not load a job due to be finished; trying again later");
                            self.books.known.dormant(|dormant| dormant.put_back(&job_id, d));
                        }
                    }
                    if !self.books.known.is_finished(&job_id) {
                        self.memory.carried().keep(&job_id, &ctl);
                    }
                }
            }
            drop(slot);
            self.memory.prune(&job_id);
        }
        let slots = self.memory.slots();
        let mut idle = Vec::new();
        for (job_id, slot) in &slots {
            // A job being worked on, or with messages held, is not idle.
            if held_jobs.contains(job_id) {
                continue;
            }
            let Ok(loaded) = slot.try_lock() else { continue };
            let Some(job) = loaded.as_ref() else { continue };
            let quiet_for = job.quiet_for(now, floor);
            let sealed = job.tally().total_chunks().is_some();
            if rule.is_due(sealed, quiet_for) {
                idle.push((job_id.clone(), slot.clone(), sealed, quiet_for));
            }
        }
        let mut out = Vec::new();
        for (job_id, slot, sealed, quiet_for) in idle {
            let Ok(mut loaded) = slot.try_lock() else { continue };
            let Some(job) = loaded.as_mut() else { continue };
            if sealed && !emptied_since(&self.expiry, self.stall.as_ref(), job.news(), &mut looked).await {
                tracing::debug!(job = %job_id, "a sealed job waits: the fleet's queues have not emptied since its last news");
                continue;
            }
            let ending = rule.ending(sealed, quiet_for);
            match &ending {
                Ending::Abandon(_) => {
                    tracing::warn!(job = %job_id, accounted = job.tally().accounted(), idle_secs = quiet_for.as_secs(), "job never sealed; abandoning it");
                }
                Ending::Stalled(_) => {
                    tracing::warn!(job = %job_id, accounted = job.tally().accounted(), total = ?job.tally().total_chunks(), idle_secs = quiet_for.as_secs(),
                        "sealed job stalled, the fleet's queues emptied since its last news; finishing it as partial");
                }
            }
            job.ask_to_end(ending);
            match self.books.finish(&job_id, &mut loaded).await {
                Ok(done) => out.extend(done),
                Err(e) => tracing::warn!(job = %job_id, error = %e, "could not write the idle job's report; trying again later"),
            }
        }
        self.memory.prune_all(slots);
        out
    }

    /// Scans the open markers again at the next expiry tick instead of after a whole abandon time:
    /// a partition was gained, and the jobs of it that have gone quiet (sealed, waiting for the stall
    /// or settle rule) were held by its last reader only; no message will bring them here (found by
    /// the simulation, seed 175: a stalled job finished 4,668 s late).
    pub fn rescan_soon(&self) {
        self.expiry.rescan_soon();
    }

    /// Reads the open-job markers: finished jobs lose theirs, unfinished jobs not in memory are
    /// remembered as dormant with their checkpoint's age and whether they sealed (one HEAD request
    /// each: no lease is taken and no checkpoint loaded until one is due). Returns how many unfinished
    /// jobs it found.
    pub async fn scan_open(&self) -> Result<usize> {
        self.expiry.scanning();
        let keys = self.store.list(OPEN_PREFIX, MAX_OPEN_JOBS).await?;
        {
            let open: std::collections::HashSet<&str> = keys.iter().map(|k| &k[OPEN_PREFIX.len().min(k.len())..]).collect();
            self.expiry.still_open(|j| open.contains(j));
        }
        let mut open = 0;
        for key in keys {
            let job_id = &key[OPEN_PREFIX.len()..];
            if check_job_id(job_id).is_err() {
                continue;
            }
            // Finished here, its marker kept: its purge was not recorded in time.
            if self.books.known.is_finished(job_id) {
                self.books.close_finished(job_id).await?;
                continue;
            }
            if self.memory.with(|r| r.get(job_id).is_some()) {
                open += 1;
                continue;
            }
            // No checkpoint yet (the marker is written just before the first): as good as new.
            let progress = fleet_io::blob::head_first(self.store.as_ref(), &checkpoint_keys(job_id)).await?.and_then(|m| Progress::from_meta(&m));
            // A finished job whose marker stayed: its finish was cut short, or its purge not
            // recorded. A quarantined job keeps its blobs.
            if let Some(p) = progress.as_ref().filter(|p| p.status.is_finished()) {
                if p.status == fleet_domain::model::JobStatus::Quarantined {
                    self.store.delete(&key).await?;
                } else {
                    self.books.close_finished(job_id).await?;
                }
                continue;
            }
            open += 1;
            // Dated on this controller's clock: when it first saw the checkpoint at this time.
            let seen = progress.map_or_else(Instant::now, |p| self.expiry.news_at(job_id, p.updated_unix));
            // Its news may be waiting on the queue since before this controller started (it was down):
            // its idle time counts from the start at the earliest.
            let since = seen.max(self.expiry.idle_floor());
            let sealed = progress.is_some_and(|p| p.sealed);
            let partition = progress.and_then(|p| p.partition);
            self.books.known.dormant(|dormant| dormant.seen(job_id, since.into_std(), sealed, partition));
        }
        Ok(open)
    }
}

/// When a sealed job that no longer progresses is finished as `partial`, and the queues that must
/// have emptied first.
pub struct StallLimit {
    pub after: Duration,
    pub queues: FleetQueues,
}

/// Every queue a message of a job may still sit in, in the order a message moves through them.
#[derive(Clone)]
pub struct FleetQueues {
    pub work: Arc<dyn Queue>,
    pub work_dlq: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
    pub results_dlq: Arc<dyn Queue>,
    /// Where a look announces a queue whose messages wait with nobody taking them (the bus, if any).
    pub announce: Option<Arc<dyn fleet_io::trigger::TriggerBus>>,
}

impl FleetQueues {
    /// Reads which queues are empty (visible, in flight and delayed), in the order [`Emptied`] needs:
    /// the work queue before its dead-letter queue and the results queue, the results queue before
    /// its dead-letter queue. A queue that cannot be read counts as not empty, and so does every
    /// queue after it.
    async fn look(&self) -> Look {
        let mut empty = [false; 4];
        for (i, q) in [&self.work, &self.work_dlq, &self.results, &self.results_dlq].into_iter().enumerate() {
            match q.depth().await {
                Ok(d) => {
                    empty[i] = d.visible + d.in_flight + d.delayed == 0;
                    // Messages waiting that nobody takes (a dead letter SQS moved while the scaling
                    // agent only looked at the work queue, or with the agent down) hold every sealed
                    // job's stall back until someone reads them: announced, their parked listeners
                    // look now, not at their hourly poll (found by the simulation, fresh seed
                    // 26121503: a dead-lettered duplicate of a finished job held a stalled job an hour).
                    if let (Some(bus), true) = (&self.announce, d.visible > 0 && d.in_flight == 0 && !crate::undo::is(crate::undo::Fix::StallLookAnnounces)) {
                        tracing::info!(queue = q.name(), visible = d.visible, "messages wait with nobody taking them: announced");
                        // A hint, sent apart: a broker slow to confirm holds up no job's look.
                        let (bus, q, visible) = (bus.clone(), q.clone(), d.visible);
                        tokio::spawn(async move { fleet_io::trigger::announce_on(bus.as_ref(), q.as_ref(), visible, "controller").await });
                    }
                }
                Err(e) => {
                    tracing::warn!(queue = q.name(), error = %e, "could not read a queue's depth; no stalled job finished on this look");
                    break;
                }
            }
        }
        let [work, work_dlq, results, results_dlq] = empty;
        tracing::debug!(work, work_dlq, results, results_dlq, "the fleet's queues looked at for stalled jobs");
        Look { work, work_dlq, results, results_dlq }
    }
}

/// Looks at the fleet's queues (once per expiry tick, `looked`) and says whether every message
/// that was in them at the job's last news has left them since (see [`Emptied`]); never without a stall rule.
async fn emptied_since(expiry: &Expiry, stall: Option<&StallLimit>, news: Instant, looked: &mut bool) -> bool {
    let Some(stall) = stall else { return false };
    if !*looked {
        *looked = true;
        // The look counts from when it started: its depth calls take a round trip each, and a
        // look stamped after them falls short of the lag at the next tick, one tick apart, so each
        // step of a pass took a tick more (the simulation with the real processors, seed 449: a
        // stalled job finished 178 s past its two ticks).
        let at = Instant::now();
        let look = stall.queues.look().await;
        expiry.emptied(|e| e.observe(at.into_std(), look));
    }
    expiry.emptied(|e| e.emptied_after(news.into_std()))
}
