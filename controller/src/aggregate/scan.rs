//! The dormant and expiry scan: open jobs are found by their `open/{job}` markers at start and every
//! `abandon_after` (one HEAD each, remembered dormant until due), and a job without news for
//! `abandon_after` is finished as `abandoned`; news since the controller started, or since the store
//! answered again after an outage, at the earliest, so that a controller that was down (or could not
//! reach S3) does not abandon a job whose seal waits on its queue (or in its hold).

use super::*;

impl Aggregator {
    /// Finishes as `abandoned` every unsealed job without news for `after` (in memory, or dormant:
    /// known from its open marker only); returns the messages the reports cover, for deletion. Scans
    /// the open markers again when the last scan is `after` old.
    pub async fn expire(&self, after: Duration) -> Vec<Kept> {
        // Nothing is abandoned while the store does not answer or results are held through its outage,
        // and no job's idle time counts from before it answered again.
        if self.store.breaker().is_some_and(|b| b.is_open()) || self.held(None) > 0 {
            *lock(&self.idle_floor) = Instant::now();
            return Vec::new();
        }
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
        let due: Vec<(String, Instant)> =
            lock(&self.dormant).iter().filter(|(_, t)| now.saturating_duration_since((**t).max(floor)) >= after).map(|(k, t)| (k.clone(), *t)).collect();
        for (job_id, since) in due {
            let mut ctl = RequestCounts::default();
            let slot = self.slot(&job_id);
            {
                let mut held = slot.lock().await;
                if held.is_none() {
                    match self.take(&job_id, &mut ctl).await {
                        Ok(Taken::Open(mut job)) => {
                            job.last_activity = since;
                            *held = Some(*job);
                        }
                        Ok(Taken::Finished) => {
                            let _ = self.store.delete(&open_key(&job_id)).await;
                        }
                        // Its owner abandons it.
                        Ok(Taken::Busy) => {}
                        Err(e) => {
                            tracing::warn!(job = %job_id, error = %e, "could not load a job due to be abandoned; trying again later");
                            lock(&self.dormant).insert(job_id.clone(), since);
                        }
                    }
                }
            }
            drop(slot);
            self.prune(&job_id);
        }
        let mut out = Vec::new();
        let slots = self.slots();
        for (job_id, slot) in &slots {
            // A job being worked on is not idle.
            let Ok(mut held) = slot.try_lock() else { continue };
            let Some(job) = held.as_mut() else { continue };
            let idle = now.saturating_duration_since(job.last_activity.max(floor));
            if job.cp.total_chunks.is_some() || idle < after {
                continue;
            }
            tracing::warn!(job = %job_id, accounted = job.cp.accounted.len(), idle_secs = idle.as_secs(), "job never sealed; abandoning it");
            job.abandon = Some(format!("not sealed within {} s of its last result: the submission did not finish", after.as_secs()));
            match self.finish(job_id, &mut held).await {
                Ok(done) => out.extend(done),
                Err(e) => tracing::warn!(job = %job_id, error = %e, "could not write the abandoned job's report; trying again later"),
            }
        }
        self.prune_all(slots);
        out
    }

    /// Reads the open-job markers: finished jobs lose theirs, unsealed jobs not in memory are
    /// remembered as dormant with their checkpoint's age (one HEAD request each: no lease is taken and
    /// no checkpoint loaded until one is due). Returns how many unfinished jobs it found.
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
            if progress.is_some_and(|p| p.sealed) {
                // Its results are on their way; a message brings it back.
                continue;
            }
            let age = progress.map_or(Duration::ZERO, |p| p.age());
            // Its news may be waiting on the queue since before this controller started (it was down):
            // its idle time counts from the start at the earliest.
            let since = Instant::now().checked_sub(age).unwrap_or_else(Instant::now).max(*lock(&self.idle_floor));
            lock(&self.dormant).entry(job_id.to_string()).or_insert(since);
        }
        Ok(open)
    }
}
