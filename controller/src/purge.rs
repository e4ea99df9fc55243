//! Why one file: a purge's record (its marker), the look that finds due markers and the deletes are
//! one protocol whose order keeps a finished job's blobs from being forgotten; the tests at the end
//! check it with a store that fails.
//!
//! Data at rest: a finished job's transactions do not stay in the bucket. Once its report is written,
//! its chunk blobs (`jobs/{job}/chunks/`), result blobs (`jobs/{job}/results/`) and checkpoint parts
//! are deleted, at once (the default) or after `--blob-retention-secs`. Either way the purge is
//! recorded first, as a `purge-due/` marker that holds the due time and that the controller's tick
//! reads, and only then does the job's open marker go: a purge that fails, or a controller that dies
//! between a report and its purge, leaves a marker or an open marker that a later look or scan
//! finds (the simulation found chunk blobs left for good both ways). The report, accounts, manifest
//! and checkpoint stay, and so do the job's tariff (`tariff.json`, whose metadata `initiator jobs`
//! shows: the files and the submit time) and a partial job's failed chunks (its `kept.json`, written
//! before its report, names them), for `initiator retry`. The bucket's lifecycle rule (provisioning)
//! is the backstop: it ends those too, after 30 days.
//!
//! Idempotent: a purge that stops halfway runs again from its marker; a work item redelivered after
//! the purge finds no chunk and reports it failed, which the finished job ignores.
//!
//! Markers are named by their due time (`purge-due/{due:011}/{job}`, so a listing is in due order;
//! outside `purge/`, where a controller of the older form would take them for unreadable markers):
//! a look lists the first page and stops at the first marker not yet due, reading no marker's body
//! (one request a look while nothing is due). Markers of the older form (`purge/{job}`, the due time
//! in the body, written by controllers of an older release) are renamed to the new form at the first
//! look and every hour after (a rolling upgrade).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;

use fleet_domain::layout::{checkpoint_parts_prefix, chunk_key, kept_key, legacy_checkpoint_parts_prefix, JOBS_PREFIX};
use fleet_io::blob::BlobStore;
use fleet_io::error::Result;

use crate::clock::Clock;

/// A finished job, and where to say whether its purge is recorded (see [`Purger::finished`]).
pub type ToPurge = (String, tokio::sync::oneshot::Sender<bool>);

/// Where the markers of purges not yet due live.
pub const PURGE_PREFIX: &str = "purge/";
/// Deletes in flight at once.
const PARALLEL: usize = 16;
/// Keys listed per round.
const PAGE: usize = 1000;
/// Most purge markers read per look (listed a page at a time).
pub const MAX_MARKERS: usize = 100_000;
/// Where markers that cannot be acted on are set aside.
pub const SET_ASIDE_PREFIX: &str = "purge-unreadable/";

/// Where markers named by their due time live (see the module header).
pub const DUE_PREFIX: &str = "purge-due/";
/// How often markers of the older form are looked for.
const LEGACY_EVERY: u64 = 3600;

/// The marker of job `job`'s purge, due at `due` (Unix seconds).
pub fn marker_key(job: &str, due: u64) -> String {
    format!("{DUE_PREFIX}{due:011}/{job}")
}

/// The due time and job a marker's name holds (`None`: not a marker of the current form).
fn parse_marker(key: &str) -> Option<(u64, &str)> {
    let (due, job) = key.strip_prefix(DUE_PREFIX)?.split_once('/')?;
    Some((due.parse().ok()?, job))
}

/// Deletes finished job `job`'s chunk and result blobs and checkpoint parts, but the failed chunks
/// its `kept.json` names; returns how many were deleted.
pub async fn purge_job(store: &Arc<dyn BlobStore>, job: &str) -> Result<usize> {
    let mut deleted = 0;
    // A kept list that cannot be read keeps every chunk (the lifecycle rule ends them): never a
    // failed chunk deleted for a document that was there.
    let kept: Option<std::collections::BTreeSet<String>> = match store.get(&kept_key(job)).await? {
        None => Some(Default::default()),
        Some(b) => match serde_json::from_slice::<fleet_domain::model::Kept>(&b) {
            Ok(_) if crate::undo::is(crate::undo::Fix::FailedChunksKept) => Some(Default::default()),
            Ok(k) if k.job_id == job => Some(k.chunks.iter().map(|&c| chunk_key(job, c)).collect()),
            _ => {
                tracing::warn!(job, "the job's kept.json cannot be read: its chunk blobs are all kept");
                None
            }
        },
    };
    // A finished job's checkpoint parts too: its finish deletes them, and one whose listing failed
    // left them for good (found by the simulation).
    // (Also where releases before `checkpoints/` kept the parts: a job moved mid-way names them.)
    let prefixes =
        [format!("{JOBS_PREFIX}{job}/chunks/"), format!("{JOBS_PREFIX}{job}/results/"), checkpoint_parts_prefix(job), legacy_checkpoint_parts_prefix(job)];
    for prefix in prefixes {
        loop {
            let listed = store.list(&prefix, PAGE).await?;
            let full = listed.len() >= PAGE;
            let chunks = prefix.ends_with("/chunks/");
            let keys: Vec<String> = listed.into_iter().filter(|k| !chunks || kept.as_ref().is_some_and(|kept| !kept.contains(k))).collect();
            if keys.is_empty() && !full {
                break;
            }
            let n = keys.len();
            let deletes = keys.into_iter().map(|k| {
                let store = store.clone();
                async move { store.delete(&k).await }
            });
            let results: Vec<Result<()>> = futures::stream::iter(deletes).buffer_unordered(PARALLEL).collect().await;
            results.into_iter().collect::<Result<Vec<()>>>()?;
            deleted += n;
            if !full {
                break;
            }
            // A full page of chunks all kept: the listing cannot go past them (it has no start
            // point), so the job's other chunks are left to the lifecycle rule.
            if n == 0 {
                tracing::warn!(job, "a page of chunk blobs all kept (a thousand failed chunks, or a kept list that cannot be read): the job's other chunks are left to the lifecycle rule");
                break;
            }
        }
    }
    Ok(deleted)
}

/// Purges finished jobs' blobs, now or when their retention has passed.
#[derive(Clone)]
pub struct Purger {
    store: Arc<dyn BlobStore>,
    retention: Duration,
    /// Wall time: when a marker is due (the simulation's clock in tests).
    clock: Clock,
    /// When markers of the older form (`purge/{job}`) were last renamed (Unix seconds; 0: never).
    legacy_at: Arc<std::sync::atomic::AtomicU64>,
    /// Without a retention: markers may be due (a purge at once failed, or a controller died between
    /// a marker and its purge), and the tick looks until a look finds nothing due (once at start).
    retrying: Arc<std::sync::atomic::AtomicBool>,
    /// Finished jobs whose purge could not be recorded (their open marker kept by the finish): the
    /// tick records it, then removes the open marker itself.
    unrecorded: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

impl Purger {
    pub fn new(store: Arc<dyn BlobStore>, retention: Duration) -> Purger {
        Purger::with_clock(store, retention, Clock::System)
    }

    /// A purger that reads wall time from `clock`.
    pub fn with_clock(store: Arc<dyn BlobStore>, retention: Duration, clock: Clock) -> Purger {
        Purger { store, retention, clock, legacy_at: Arc::default(), retrying: Arc::new(std::sync::atomic::AtomicBool::new(true)), unrecorded: Arc::default() }
    }

    fn now_unix(&self) -> u64 {
        u64::try_from(self.clock.now_unix()).unwrap_or(0)
    }

    /// Job `job` finished (its report is written): its purge is recorded first, as a marker due after
    /// the retention (now, without one), and `recorded` hears whether it was; only then may the job's
    /// open marker go, so that a purge is never forgotten (a marker write that failed, or a
    /// controller that died between a report and its purge, left the job's blobs for good: found by
    /// the simulation). Without a retention the blobs are then deleted at once, and the marker with
    /// them; a purge that fails is tried again from its marker (`now`: seconds since the epoch).
    pub async fn finished(&self, job: &str, now: u64, recorded: tokio::sync::oneshot::Sender<bool>) -> Result<()> {
        let due = now.saturating_add(self.retention.as_secs());
        let body = serde_json::json!({ "job": job, "due_unix": due }).to_string();
        if crate::undo::is(crate::undo::Fix::PurgeRecorded) {
            // As before: the open marker goes at once, a purge at once is not marked, a marker write
            // that fails is not tried again.
            let _ = recorded.send(true);
            if self.retention.is_zero() {
                purge_job(&self.store, job).await?;
            } else {
                self.store.put(&marker_key(job, due), Bytes::from(body), "application/json").await?;
            }
            return Ok(());
        }
        let marked = self.store.put(&marker_key(job, due), Bytes::from(body), "application/json").await;
        let _ = recorded.send(marked.is_ok());
        if marked.is_err() {
            fleet_io::lock(&self.unrecorded).insert(job.to_string());
            self.retrying.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        marked?;
        if !self.retention.is_zero() {
            tracing::info!(job, due_unix = due, "the finished job's blobs will be purged after the retention");
            return Ok(());
        }
        match purge_job(&self.store, job).await {
            Ok(n) => {
                self.store.delete(&marker_key(job, due)).await?;
                tracing::info!(job, deleted = n, "purged the finished job's chunk and result blobs");
            }
            Err(e) => {
                self.retrying.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(job, error = %e, "could not purge the finished job's blobs; tried again from its marker");
            }
        }
        Ok(())
    }

    /// Purges the jobs whose marker is due at `now` (seconds since the epoch) and removes their
    /// markers; returns the jobs purged. Markers are listed in due order a page at a time, and the
    /// look ends at the first one not yet due: no marker's body is read. A marker whose name holds no
    /// valid job id is set aside under [`SET_ASIDE_PREFIX`] for a look by hand, so none stands in the
    /// way of the markers behind it. Markers of the older form are renamed first (once).
    pub async fn due(&self, now: u64) -> Result<Vec<String>> {
        let last = self.legacy_at.load(std::sync::atomic::Ordering::Relaxed);
        if last == 0 || now >= last + LEGACY_EVERY {
            self.rename_legacy().await?;
            self.legacy_at.store(now.max(1), std::sync::atomic::Ordering::Relaxed);
        }
        let mut done = Vec::new();
        loop {
            let keys = self.store.list(DUE_PREFIX, PAGE).await?;
            let page = keys.len();
            for key in keys {
                let Some((due, job)) = parse_marker(&key) else {
                    self.set_aside(&key, "unreadable").await?;
                    continue;
                };
                if due > now {
                    return Ok(done);
                }
                if fleet_domain::layout::check_job_id(job).is_err() {
                    self.set_aside(&key, "names an invalid job id").await?;
                    continue;
                }
                let n = purge_job(&self.store, job).await?;
                self.store.delete(&key).await?;
                tracing::info!(job, deleted = n, "purged a finished job's chunk and result blobs (retention passed)");
                done.push(job.to_string());
            }
            // Every key of a full page was due (and is gone): the next page.
            if page < PAGE {
                return Ok(done);
            }
        }
    }

    /// Renames the markers of the older form (`purge/{job}`, the due time in the body) to the current
    /// one; an unreadable one is set aside.
    async fn rename_legacy(&self) -> Result<()> {
        for key in self.store.list(PURGE_PREFIX, MAX_MARKERS).await? {
            let body = match self.store.get_capped(&key, 4096).await {
                Ok(Some(body)) => body,
                // Renamed (or purged) by another controller since the listing.
                Ok(None) => continue,
                Err(e) if e.is_retryable() => return Err(e),
                Err(_) => {
                    self.set_aside(&key, "unreadable").await?;
                    continue;
                }
            };
            let due = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v["due_unix"].as_u64());
            let job = key.trim_start_matches(PURGE_PREFIX);
            match due {
                Some(due) if fleet_domain::layout::check_job_id(job).is_ok() => {
                    self.store.put(&marker_key(job, due), body, "application/json").await?;
                    self.store.delete(&key).await?;
                }
                Some(_) => self.set_aside(&key, "names an invalid job id").await?,
                None => self.set_aside(&key, "unreadable").await?,
            }
        }
        Ok(())
    }

    /// Moves a marker that cannot be acted on out of the way (its body kept, when it has one).
    async fn set_aside(&self, key: &str, why: &str) -> Result<()> {
        let aside = format!("{SET_ASIDE_PREFIX}{}", key.trim_start_matches(DUE_PREFIX).trim_start_matches(PURGE_PREFIX).replace('/', "-"));
        if let Ok(Some(body)) = self.store.get_capped(key, 64 << 10).await {
            self.store.put(&aside, body, "application/octet-stream").await?;
        } else {
            self.store.put(&aside, Bytes::new(), "application/octet-stream").await?;
        }
        self.store.delete(key).await?;
        tracing::warn!(%key, %aside, why, "purge marker set aside for a look by hand");
        Ok(())
    }

    /// Purges each job that `finished` names, until every sender is gone; with a retention (or a purge
    /// at once to try again), looks for due markers every `tick`.
    pub async fn run(self, mut finished: mpsc::UnboundedReceiver<ToPurge>, tick: Duration) {
        let mut timer = tokio::time::interval(tick);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                job = finished.recv() => match job {
                    Some((job, recorded)) => self.finished_logged(&job, recorded).await,
                    None => return,
                },
                _ = timer.tick(), if !self.retention.is_zero() || self.retrying.load(std::sync::atomic::Ordering::Relaxed) => {
                    self.record_again().await;
                    match self.due(self.now_unix()).await {
                        Ok(purged) if purged.is_empty() && fleet_io::lock(&self.unrecorded).is_empty() => self.retrying.store(false, std::sync::atomic::Ordering::Relaxed),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "could not purge the jobs whose retention passed; next tick"),
                    }
                }
            }
        }
    }

    /// Records the purges that could not be recorded when their jobs finished, and removes those
    /// jobs' open markers (their finish kept them); a job that fails again waits for the next tick.
    async fn record_again(&self) {
        let jobs: Vec<String> = fleet_io::lock(&self.unrecorded).iter().cloned().collect();
        for job in jobs {
            let (recorded, heard) = tokio::sync::oneshot::channel();
            let _ = self.finished(&job, self.now_unix(), recorded).await;
            if heard.await == Ok(true) {
                fleet_io::lock(&self.unrecorded).remove(&job);
                if let Err(e) = self.store.delete(&fleet_domain::layout::open_key(&job)).await {
                    tracing::warn!(job, error = %e, "could not remove the finished job's open marker; the next scan removes it");
                }
            }
        }
    }

    async fn finished_logged(&self, job: &str, recorded: tokio::sync::oneshot::Sender<bool>) {
        if let Err(e) = self.finished(job, self.now_unix(), recorded).await {
            tracing::warn!(job, error = %e, "could not record or start the finished job's purge; its open marker stays for the next look");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet_domain::layout::{accounts_key, checkpoint_key, chunk_key, manifest_key, report_key, result_key};
    use fleet_io::call::Op;
    use fleet_io::memory::{Hook, Hooked, MemoryStore, Put};

    /// Where a test hears nothing of a purge's record.
    fn recorded() -> tokio::sync::oneshot::Sender<bool> {
        tokio::sync::oneshot::channel().0
    }

    /// The next `fail_puts` writes fail (S3 answering 503).
    struct FailingPuts {
        fail_puts: std::sync::atomic::AtomicU32,
    }

    #[async_trait::async_trait]
    impl Hook for FailingPuts {
        async fn put_if(&self, inner: &dyn BlobStore, put: Put<'_>) -> Result<Option<String>> {
            let fail = self.fail_puts.fetch_update(std::sync::atomic::Ordering::SeqCst, std::sync::atomic::Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
            if fail {
                return Err(fleet_io::Error::Service {
                    service: fleet_io::error::Service::S3,
                    operation: "PutObject",
                    detail: "SlowDown".into(),
                    retryable: true,
                    source: None,
                });
            }
            put.to(inner).await
        }
    }

    /// A finish hears that its job's purge is recorded only once its marker is written: a marker
    /// write that fails keeps the job's open marker (the finish's own trace of the purge), and the
    /// purger's tick records it again, purges the blobs and removes the open marker.
    #[tokio::test]
    async fn a_purge_not_recorded_keeps_the_open_marker_until_the_tick_records_it() {
        let inner = MemoryStore::new();
        let store: Arc<dyn BlobStore> = inner.clone();
        let job = "unrecorded";
        job_blobs(store.as_ref(), job, 2).await;
        store.put(&fleet_domain::layout::open_key(job), Bytes::new(), "application/octet-stream").await.unwrap();
        let p = Purger::new(store.clone(), Duration::ZERO);
        // S3 refuses the marker's write.
        let failing = Hooked::new(inner.clone(), FailingPuts { fail_puts: 1.into() });
        let p_failing = Purger { store: failing, ..p.clone() };
        let (tx, heard) = tokio::sync::oneshot::channel();
        assert!(p_failing.finished(job, 1_800_000_000, tx).await.is_err());
        assert_eq!(heard.await, Ok(false), "a purge whose marker was not written is not recorded");
        assert_eq!(inner.list(&format!("jobs/{job}/chunks/"), 10).await.unwrap().len(), 2, "nothing purged yet");
        // The tick records it, purges the blobs and removes the open marker the finish kept.
        p_failing.record_again().await;
        for part in ["chunks/", "results/"] {
            assert!(inner.list(&format!("jobs/{job}/{part}"), 10).await.unwrap().is_empty(), "blobs purged");
        }
        assert!(inner.list("open/", 10).await.unwrap().is_empty(), "open marker removed once the purge is recorded");
        assert!(inner.list(DUE_PREFIX, 10).await.unwrap().is_empty(), "its marker gone with its purge");
    }

    /// A partial job's failed chunks (its `kept.json`) and its tariff stay for a retry; the rest go.
    /// A kept list that cannot be read keeps every chunk; a job without one keeps none.
    #[tokio::test]
    async fn the_failed_chunks_a_kept_list_names_stay_through_the_purge() {
        let store: Arc<dyn BlobStore> = MemoryStore::new();
        let tariff = |job: &str| fleet_domain::layout::tariff_key(job);
        let chunks = |job: String| {
            let store = store.clone();
            async move { store.list(&format!("jobs/{job}/chunks/"), 10).await.unwrap() }
        };
        for (job, kept) in [("partial", Some(&br#"{"v":1,"job_id":"partial","chunks":[1,3]}"#[..])), ("garbled", Some(&b"{not json"[..])), ("whole", None)] {
            job_blobs(store.as_ref(), job, 4).await;
            store.put(&tariff(job), Bytes::from_static(b"{}"), "application/json").await.unwrap();
            if let Some(k) = kept {
                store.put(&kept_key(job), Bytes::copy_from_slice(k), "application/json").await.unwrap();
            }
            purge_job(&store, job).await.unwrap();
            assert!(store.list(&format!("jobs/{job}/results/"), 10).await.unwrap().is_empty(), "{job}: results purged");
        }
        assert_eq!(chunks("partial".into()).await, [chunk_key("partial", 1), chunk_key("partial", 3)], "the failed chunks stay");
        assert!(store.get(&tariff("partial")).await.unwrap().is_some(), "and the tariff they are billed with");
        assert_eq!(chunks("garbled".into()).await.len(), 4, "an unreadable list keeps every chunk");
        assert!(chunks("whole".into()).await.is_empty(), "no list: all go");
        assert!(store.get(&tariff("whole")).await.unwrap().is_some(), "the tariff stays (its metadata: the job's files, for `initiator jobs`)");
    }

    async fn job_blobs(store: &dyn BlobStore, job: &str, chunks: u32) {
        for c in 0..chunks {
            store.put(&chunk_key(job, c), Bytes::from_static(b"c"), "application/zstd").await.unwrap();
            store.put(&result_key(job, c), Bytes::from_static(b"r"), "application/zstd").await.unwrap();
        }
        for k in [manifest_key(job), checkpoint_key(job), report_key(job), accounts_key(job)] {
            store.put(&k, Bytes::from_static(b"{}"), "application/json").await.unwrap();
        }
        // Checkpoint parts, also where a release before `checkpoints/` wrote them.
        for prefix in [checkpoint_parts_prefix(job), legacy_checkpoint_parts_prefix(job)] {
            store.put(&format!("{prefix}p.csv.zst"), Bytes::from_static(b"p"), "application/zstd").await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_finished_job_loses_its_transactions_and_keeps_its_report() {
        let store = MemoryStore::new();
        let (job, other) = ("0190a000-0000-7000-8000-000000000001", "0190a000-0000-7000-8000-000000000002");
        job_blobs(store.as_ref(), job, 1500).await;
        job_blobs(store.as_ref(), other, 3).await;
        Purger::new(store.clone(), Duration::ZERO).finished(job, Clock::System.now_unix() as u64, recorded()).await.unwrap();
        assert!(store.list(&format!("jobs/{job}/chunks/"), 10).await.unwrap().is_empty());
        assert!(store.list(&format!("jobs/{job}/results/"), 10).await.unwrap().is_empty());
        for prefix in [checkpoint_parts_prefix(job), legacy_checkpoint_parts_prefix(job)] {
            assert!(store.list(&prefix, 10).await.unwrap().is_empty(), "{prefix}");
        }
        assert_eq!(store.list(&checkpoint_parts_prefix(other), 10).await.unwrap().len(), 1, "another job's parts stay");
        for k in [manifest_key(job), checkpoint_key(job), report_key(job), accounts_key(job)] {
            assert!(store.get(&k).await.unwrap().is_some(), "{k} kept");
        }
        assert_eq!(store.list(&format!("jobs/{other}/chunks/"), 10).await.unwrap().len(), 3, "another job's blobs stay");
        assert!(
            store.list(PURGE_PREFIX, 10).await.unwrap().is_empty() && store.list(DUE_PREFIX, 10).await.unwrap().is_empty(),
            "no marker without a retention"
        );
    }

    #[tokio::test]
    async fn with_a_retention_a_marker_waits_until_it_is_due() {
        let store = MemoryStore::new();
        let job = "0190a000-0000-7000-8000-000000000003";
        job_blobs(store.as_ref(), job, 4).await;
        let p = Purger::new(store.clone(), Duration::from_secs(86_400));
        let t0 = 1_800_000_000;
        p.finished(job, t0, recorded()).await.unwrap();
        assert_eq!(store.list(DUE_PREFIX, 10).await.unwrap(), vec![format!("purge-due/{:011}/{job}", t0 + 86_400)]);
        assert!(p.due(t0 + 86_399).await.unwrap().is_empty(), "not yet due");
        assert_eq!(store.list(&format!("jobs/{job}/chunks/"), 10).await.unwrap().len(), 4, "nothing deleted before it is due");
        assert_eq!(p.due(t0 + 86_400).await.unwrap(), vec![job.to_string()]);
        assert!(store.list(&format!("jobs/{job}/"), 100).await.unwrap().iter().all(|k| !k.contains("/chunks/") && !k.contains("/results/")));
        assert!(store.list(DUE_PREFIX, 10).await.unwrap().is_empty(), "the marker is removed");
        assert!(store.get(&report_key(job)).await.unwrap().is_some());
    }

    /// More unreadable markers than one listing page ahead of a due one: the due job is purged all
    /// the same, and the unreadable markers are set aside (kept) instead of read again every tick.
    #[tokio::test]
    async fn unreadable_markers_never_stall_the_ones_behind_them() {
        let store = MemoryStore::new();
        for i in 0..1200 {
            store.put(&format!("{PURGE_PREFIX}0-bad-{i:04}"), Bytes::from_static(b"not json"), "application/json").await.unwrap();
        }
        store.put(&format!("{PURGE_PREFIX}0-bad-../../x"), Bytes::from_static(br#"{"due_unix":1}"#), "application/json").await.unwrap();
        let job = "0190a000-0000-7000-8000-000000000009";
        job_blobs(store.as_ref(), job, 2).await;
        let p = Purger::new(store.clone(), Duration::from_secs(60));
        p.finished(job, 1_800_000_000, recorded()).await.unwrap();
        assert_eq!(p.due(1_800_000_060).await.unwrap(), vec![job.to_string()], "the due job behind 1,201 bad markers");
        assert!(store.list(&format!("jobs/{job}/chunks/"), 10).await.unwrap().is_empty());
        assert!(store.list(PURGE_PREFIX, 10).await.unwrap().is_empty() && store.list(DUE_PREFIX, 10).await.unwrap().is_empty(), "no marker left in the way");
        assert_eq!(store.list(SET_ASIDE_PREFIX, 10_000).await.unwrap().len(), 1201, "set aside, not lost");
        assert_eq!(store.get(&format!("{SET_ASIDE_PREFIX}0-bad-0007")).await.unwrap().as_deref(), Some(&b"not json"[..]));
    }

    /// Markers are named by due time: a look reads no marker's body and stops at the first not due; a
    /// marker of the older form is renamed and purged when due.
    #[tokio::test]
    async fn markers_are_looked_at_in_due_order_without_reading_them() {
        let store = MemoryStore::new();
        let jobs: Vec<String> = (0..5).map(|i| format!("0190a000-0000-7000-8000-00000000010{i}")).collect();
        for j in &jobs {
            job_blobs(store.as_ref(), j, 1).await;
        }
        let p = Purger::new(store.clone(), Duration::from_secs(100));
        for (i, j) in jobs.iter().enumerate().take(4) {
            p.finished(j, 1_800_000_000 + 10 * i as u64, recorded()).await.unwrap();
        }
        // The older form, due at the same time as the second job.
        store
            .put(&format!("{PURGE_PREFIX}{}", jobs[4]), Bytes::from(format!(r#"{{"job":"{}","due_unix":1800000110}}"#, jobs[4])), "application/json")
            .await
            .unwrap();
        let gets = |s: &MemoryStore| s.calls().snapshot().calls(Op::S3GetObject);
        assert_eq!(p.due(1_800_000_105).await.unwrap(), vec![jobs[0].clone()]);
        let before = gets(&store);
        assert_eq!(p.due(1_800_000_115).await.unwrap(), vec![jobs[1].clone(), jobs[4].clone()]);
        assert!(p.due(1_800_000_115).await.unwrap().is_empty());
        assert_eq!(gets(&store), before + 2, "no marker read: one GET per job purged, its kept list");
        assert_eq!(p.due(1_800_001_000).await.unwrap(), vec![jobs[2].clone(), jobs[3].clone()]);
        assert!(store.list(PURGE_PREFIX, 10).await.unwrap().is_empty() && store.list(DUE_PREFIX, 10).await.unwrap().is_empty());
    }
}
