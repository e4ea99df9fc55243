//! The dormant and expiry scan: open jobs are found by their `open/{job}` markers at start and every
//! `abandon_after` (one HEAD each, remembered dormant until due). A job without news for
//! `abandon_after` that never sealed is finished as `abandoned`; a sealed job without news for
//! `stall_after` while every queue the fleet uses is empty (nothing can still arrive for it: a work
//! item lost to retention, a FIFO de-duplication drop) is finished as `partial`, naming the chunks it
//! never got. News counts since the controller started, or since the store answered again after an
//! outage, at the earliest, so that a controller that was down (or could not reach S3) does not finish
//! a job whose seal or results wait on its queue (or in its hold).

use super::*;

/// Why an idle job is finished.
enum Ending {
    /// It never sealed.
    Abandon(String),
    /// It sealed, and what it lacks can no longer arrive.
    Stalled(String),
}

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
            *lock(&self.idle_floor) = Instant::now();
            return Vec::new();
        }
        let held_jobs = self.held_jobs();
        let floor = *lock(&self.idle_floor);
        // At start (the first tick) and every `after`: jobs whose owner died and whose messages never
        // come back are found here.
        let scan = lock(&self.scanned).is_none_or(|t| t.elapsed() >= after);
        if scan {
            match self.scan_open().await {
                Ok(n) => tracing::info!(open = n, dormant = lock(&self.dormant).len(), "open jobs scanned"),
                Err(e) => tracing::warn!(error = %e, "could not scan the open jobs; trying again later"),
            }
        }
        let now = Instant::now();
        let stall = self.stall.as_ref().map(|s| s.after);
        let limit = |sealed: bool| if sealed { stall } else { Some(after) };
        // A dormant sealed job is loaded once it has been quiet for the settle time (one with every
        // chunk in is then finished from memory; one still missing chunks waits for the stall rule).
        let load_after = |sealed: bool| if sealed { Some(stall.map_or(self.settle, |s| s.min(self.settle))) } else { Some(after) };
        let due: Vec<(String, Dormant)> = lock(&self.dormant)
            .iter()
            .filter(|(k, d)| !held_jobs.contains(*k) && load_after(d.sealed).is_some_and(|l| now.saturating_duration_since(d.since.max(floor)) >= l))
            .map(|(k, d)| (k.clone(), *d))
            .collect();
        let mut queues_seen = None;
        for (job_id, d) in due {
            let mut ctl = RequestCounts::default();
            let slot = self.slot(&job_id);
            {
                let mut held = slot.lock().await;
                if held.is_none() {
                    match self.take(&job_id, &mut ctl).await {
                        // Its idle time is read again from the checkpoint just loaded (news on another
                        // controller since the scan moved it), not from what the scan saw.
                        Ok(Taken::Open(job)) => *held = Some(*job),
                        Ok(Taken::Finished) => {
                            let _ = self.store.delete(&open_key(&job_id)).await;
                        }
                        // Its owner finishes it.
                        Ok(Taken::Busy(_)) => {}
                        Err(e) => {
                            tracing::warn!(job = %job_id, error = %e, "could not load a job due to be finished; trying again later");
                            lock(&self.dormant).insert(job_id.clone(), d);
                        }
                    }
                }
            }
            drop(slot);
            self.prune(&job_id);
        }
        let slots = self.slots();
        let mut idle = Vec::new();
        for (job_id, slot) in &slots {
            // A job being worked on, or with messages held, is not idle.
            if held_jobs.contains(job_id) {
                continue;
            }
            let Ok(held) = slot.try_lock() else { continue };
            let Some(job) = held.as_ref() else { continue };
            let quiet_for = job.quiet_for(now, floor);
            if limit(job.cp.total_chunks.is_some()).is_some_and(|l| quiet_for >= l) {
                idle.push((job_id.clone(), slot.clone(), job.cp.total_chunks.is_some(), quiet_for));
            }
        }
        let quiet = if idle.iter().any(|(_, _, sealed, _)| *sealed) { self.fleet_quiet(&mut queues_seen).await } else { false };
        let mut out = Vec::new();
        for (job_id, slot, sealed, quiet_for) in idle {
            if sealed && !quiet {
                continue;
            }
            let Ok(mut held) = slot.try_lock() else { continue };
            let Some(job) = held.as_mut() else { continue };
            let ending = if sealed {
                Ending::Stalled(format!(
                    "no result for {} s after the job's last news, with every queue of the fleet empty: its work item was lost (queue retention, FIFO de-duplication) and can no longer arrive",
                    quiet_for.as_secs()
                ))
            } else {
                Ending::Abandon(format!("not sealed within {} s of its last result: the submission did not finish", after.as_secs()))
            };
            match ending {
                Ending::Abandon(reason) => {
                    tracing::warn!(job = %job_id, accounted = job.cp.accounted.len(), idle_secs = quiet_for.as_secs(), "job never sealed; abandoning it");
                    job.abandon(reason);
                }
                Ending::Stalled(reason) => {
                    tracing::warn!(job = %job_id, accounted = job.cp.accounted.len(), total = ?job.cp.total_chunks, idle_secs = quiet_for.as_secs(),
                        "sealed job stalled with every queue empty; finishing it as partial");
                    job.stall(reason);
                }
            }
            match self.finish(&job_id, &mut held).await {
                Ok(done) => out.extend(done),
                Err(e) => tracing::warn!(job = %job_id, error = %e, "could not write the idle job's report; trying again later"),
            }
        }
        self.prune_all(slots);
        out
    }

    /// Whether every queue the fleet uses is empty (visible, in flight and delayed): nothing can still
    /// arrive for a job. Approximate counts lag by about a minute; the stall limit is far longer. Asks
    /// the queues once per `seen` (one expiry tick).
    async fn fleet_quiet(&self, seen: &mut Option<bool>) -> bool {
        if let Some(q) = *seen {
            return q;
        }
        let q = self.queues_empty().await;
        *seen = Some(q);
        q
    }

    async fn queues_empty(&self) -> bool {
        let Some(stall) = &self.stall else { return false };
        for q in &stall.queues {
            match q.depth().await {
                Ok(d) if d.visible + d.in_flight + d.delayed == 0 => {}
                Ok(d) => {
                    tracing::debug!(queue = q.name(), ?d, "a sealed job waits: the fleet's queues are not empty");
                    return false;
                }
                Err(e) => {
                    tracing::warn!(queue = q.name(), error = %e, "could not read a queue's depth; no stalled job finished");
                    return false;
                }
            }
        }
        true
    }

    /// Reads the open-job markers: finished jobs lose theirs, unfinished jobs not in memory are
    /// remembered as dormant with their checkpoint's age and whether they sealed (one HEAD request
    /// each: no lease is taken and no checkpoint loaded until one is due). Returns how many unfinished
    /// jobs it found.
    pub async fn scan_open(&self) -> Result<usize> {
        *lock(&self.scanned) = Some(Instant::now());
        let keys = self.store.list(OPEN_PREFIX, MAX_OPEN_JOBS).await?;
        let mut open = 0;
        for key in keys {
            let job_id = &key[OPEN_PREFIX.len()..];
            if check_job_id(job_id).is_err() || self.is_finished(job_id) {
                continue;
            }
            if lock(&self.jobs).contains_key(job_id) {
                open += 1;
                continue;
            }
            // No checkpoint yet (the marker is written just before the first): as good as new.
            let progress = self.store.head(&checkpoint_key(job_id)).await?.and_then(|m| Progress::from_meta(&m));
            if progress.is_some_and(|p| p.status.is_finished()) {
                self.store.delete(&key).await?;
                continue;
            }
            open += 1;
            let age = progress.map_or(Duration::ZERO, |p| self.clock.since_unix(p.updated_unix));
            // Its news may be waiting on the queue since before this controller started (it was down):
            // its idle time counts from the start at the earliest.
            let since = Instant::now().checked_sub(age).unwrap_or_else(Instant::now).max(*lock(&self.idle_floor));
            let sealed = progress.is_some_and(|p| p.sealed);
            // A rescan refreshes what an earlier one saw (the job may have had news elsewhere since).
            lock(&self.dormant).insert(job_id.to_string(), Dormant { since, sealed });
        }
        Ok(open)
    }
}

/// An unfinished job known from its open marker only.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dormant {
    /// Its last news (its checkpoint's time), or the idle floor.
    pub(super) since: Instant,
    pub(super) sealed: bool,
}

/// When a sealed job that no longer progresses is finished as `partial`, and the queues that must be
/// empty first.
pub struct StallLimit {
    pub after: Duration,
    /// Every queue a message of a job may still sit in: work, results and their dead-letter queues.
    pub queues: Vec<Arc<dyn fleet_io::queue::Queue>>,
}
