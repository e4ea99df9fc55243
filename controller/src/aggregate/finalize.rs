//! Finishing a job: when a sealed job has every chunk accounted for (or it is abandoned), its report
//! and accounts are written to the warehouse, its checkpoint is marked finished without rows, its
//! parts and `open/{job}` marker are removed, and its messages are handed back for deletion.
//! The steps and their order are the core's (`controller_core::finish::Finish`, a state machine that
//! takes each step's answer); this file performs them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fleet_domain::layout::{accounts_key, checkpoint_parts_prefix, kept_key, manifest_key, report_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{Kept as KeptChunks, Manifest, WIRE_VERSION};
use fleet_domain::report::{self, AccountRows as _};
use fleet_domain::requests::{Billed, Op, RequestCounts};
use fleet_engine::Kept;
use fleet_io::blob::BlobStore;
use fleet_io::call::counted;
use fleet_io::error::{Error, Result};

use super::books::Books;
use super::delete_calls;
use super::job::{hand_over, Job, Phase};
use super::limits::MAX_OPEN_JOBS;
use controller_core::decision::Commit;
use controller_core::finish::{Answer, Effect, Finish};

impl Books {
    /// Writes the report of a job in memory (complete, or abandoned when it says so) and forgets it;
    /// returns its messages for deletion. The order of its steps and when each is taken is the core's
    /// (`controller_core::finish`); this performs each and answers. The job stays in its slot until it
    /// is finished or handed over: a step that fails leaves it there as it stands, to be tried again.
    pub(super) async fn finish(&self, job_id: &str, loaded: &mut Option<Job>) -> Result<Vec<Kept>> {
        // A job whose claims failed for a lasting reason waits out its back-off before it is tried
        // again (nothing is renewed or read meanwhile).
        if let Some(job) = loaded.as_ref() {
            if matches!(job.phase(), Phase::Ending(_)) && job.tally().duplicates().is_none() && self.claims_backoff.waiting(job_id) {
                return Ok(Vec::new());
            }
        }
        let mut finish = Finish::default();
        let mut answer = Answer::Start;
        // The report as written (its rows let go), for the line that says the job finished.
        let mut written = None;
        loop {
            let job = loaded.as_mut().expect("the job is in memory");
            answer = match job.finish_step(&mut finish, answer) {
                // Every call made for the job up to its report is in the report, counted as the store
                // counts it (every attempt); what the report's own writes and what follows them make
                // is not (see docs/requests.md).
                Effect::Renew => {
                    let (renewed, calls) = counted(self.leases.renew(job_id, job.lease())).await;
                    job.count(&calls);
                    let renewed = renewed?;
                    if !renewed {
                        tracing::warn!(job = %job_id, "lease lost before the report; the new owner writes it");
                    }
                    Answer::Renewed(renewed)
                }
                Effect::MarkOpen => {
                    let (put, calls) = counted(self.mark_open(job_id)).await;
                    job.count(&calls);
                    put?;
                    Answer::Done
                }
                Effect::ReadManifest => match self.read_manifest(job).await {
                    Ok(found) => Answer::Manifest(found),
                    Err(e) => refused(job_id, e)?,
                },
                Effect::Commit(commit) => {
                    let had_parts = job.tally().parts() > 0;
                    let done = match commit {
                        Commit::Ending(_) => {
                            // The deletes its last messages take: SQS's calls, shared by the jobs of a
                            // batch, attributed to it by rule, in the checkpoint that commits its ending
                            // (docs/requests.md).
                            let mut deletes = RequestCounts::default();
                            deletes.add(Billed::call(Op::SqsDeleteMessageBatch), delete_calls(job.unsaved().iter()));
                            let (committed, calls) = counted(self.commit(job, commit, &deletes)).await;
                            job.count(&calls);
                            committed
                        }
                        Commit::Final => {
                            let dropped = self.commit(job, commit, &RequestCounts::default()).await;
                            if dropped.is_ok() && had_parts {
                                self.delete_parts(job_id).await;
                            }
                            dropped
                        }
                        other => unreachable!("a finish does not commit {other:?}"),
                    };
                    match done {
                        Ok(()) => Answer::Done,
                        Err(e) => refused(job_id, e)?,
                    }
                }
                Effect::Claim(manifest) => {
                    let (claimed, calls) = counted(self.claim(job, &manifest)).await;
                    job.count(&calls);
                    // Never a quarantine: its ending is committed and some claims may be written;
                    // a claim that cannot be made now (a segment or chunk unreadable, a store error)
                    // leaves the job as it stands, to be tried again, the reason logged.
                    claimed.map_err(|e| {
                        let e = match e {
                            Error::Corrupt(detail) => {
                                Error::Service { service: fleet_io::error::Service::S3, operation: "claims", detail, retryable: false, source: None }
                            }
                            e => e,
                        };
                        if e.is_retryable() {
                            tracing::warn!(job = %job_id, error = %e, "its transactions could not be claimed now; the finish is tried again");
                        } else {
                            let wait = self.claims_backoff.failed(job_id);
                            tracing::error!(job = %job_id, error = %e, retry_in_s = wait.as_secs(), "its transactions cannot be claimed; the finish is tried again after a back-off");
                        }
                        e
                    })?;
                    self.claims_backoff.cleared(job_id);
                    Answer::Done
                }
                Effect::Report(manifest) => match self.report(job, &manifest).await {
                    Ok(r) => {
                        written = Some(r);
                        Answer::Done
                    }
                    Err(e) => refused(job_id, e)?,
                },
                Effect::HandOver => {
                    hand_over(loaded);
                    return Ok(Vec::new());
                }
                Effect::Quarantine(why) => {
                    let why = why.unwrap_or_else(|| Error::Corrupt("its manifest cannot be read".into()));
                    let done = self.quarantine_finishing(job_id, job, &why).await?;
                    *loaded = None;
                    return Ok(done);
                }
                Effect::NoManifest => {
                    return Err(Error::NotFound { service: fleet_io::error::Service::S3, what: format!("the manifest of job {job_id} does not exist") })
                }
                Effect::Finished(status) => {
                    if let Some(r) = &written {
                        self.finished(job, r);
                    }
                    let job = loaded.take().expect("the job is in memory");
                    if let Err(e) = self.close_finished(job_id).await {
                        tracing::warn!(job = %job_id, error = %e, "could not remove the open-job marker; the next start removes it");
                    }
                    let _ = self.leases.release(job_id, job.lease()).await;
                    self.remember_finished(job_id, status);
                    return Ok(job.done());
                }
            };
        }
    }

    /// The manifest its seal was checked against (see `records`), else read (none: none was written).
    async fn read_manifest(&self, job: &mut Job) -> Result<Option<Arc<Manifest>>> {
        if let Some(m) = self.records.manifest(job.id()) {
            return Ok(Some(m));
        }
        let (found, calls) = counted(self.store.get_capped(&manifest_key(job.id()), MAX_MANIFEST_BYTES)).await;
        job.count(&calls);
        match found? {
            Some(b) => Ok(Some(Arc::new(serde_json::from_slice(&b)?))),
            None => Ok(None),
        }
    }

    /// Writes the report of the job's committed ending with `manifest`, and its accounts and warehouse
    /// tables: once, `accounts.csv` first, then `report.json`, which says the pair is whole. A finish
    /// tried again (a write failed, the owner changed) finds the report there and writes neither again:
    /// its first `finished_at` stands. Returns the report without its rows.
    async fn report(&self, job: &mut Job, manifest: &Manifest) -> Result<report::Report<()>> {
        let store = self.store.as_ref();
        let job_id = job.id().to_string();
        // What was made for it outside its lock since its last checkpoint (the timer's renewals).
        job.take_carried();
        let Phase::Ending(decision) = job.phase() else { unreachable!("a report is written of a committed ending") };
        let mut requests = manifest.requests.clone();
        requests.merge(job.tally().requests());
        let mut r = report::build_borrowed(manifest, job.tally().totals(), decision.failed.clone(), &requests);
        r.requests.set_cost(&self.prices, &requests, manifest.submitted);
        r.status = decision.status;
        r.note = decision.note.clone();
        // The time the ending was committed, whoever writes it (a takeover writes the same).
        r.finished_at = decision.at.clone();
        // The rows another job billed first: rejected here, with that job (see `claims`).
        if let Some(dups) = job.tally().duplicates() {
            r.transactions.duplicates = dups.len() as u64;
            r.rejected.extend(dups.iter().cloned());
            r.rejected.sort_by(|a, b| (a.file.as_bytes(), a.line).cmp(&(b.file.as_bytes(), b.line)));
        }
        let counted = r.transactions.processed.checked_add(r.transactions.failed).and_then(|n| n.checked_add(r.transactions.duplicates));
        if counted != Some(r.transactions.accepted) {
            tracing::error!(job = %job_id, accepted = r.transactions.accepted, processed = r.transactions.processed, failed = r.transactions.failed,
                "accepted != processed + failed: the results disagree with the manifest");
        }
        if crate::undo::is(crate::undo::Fix::ReportOnce) || store.head(&report_key(&job_id)).await?.is_none() {
            // The failed chunks whose blobs the purge keeps for `initiator retry`: said before the
            // report, which lets the purge begin (a finish tried again writes the same).
            if !r.failed_chunks.is_empty() {
                let kept = KeptChunks { v: WIRE_VERSION, job_id: job_id.clone(), chunks: r.failed_chunks.iter().map(|f| f.chunk).collect() };
                store.put(&kept_key(&job_id), Bytes::from(serde_json::to_vec(&kept)?), "application/json").await?;
            }
            if r.accounts.len() <= IN_MEMORY_ACCOUNTS {
                store.put(&accounts_key(&job_id), Bytes::from(report::accounts_csv(&r)), "text/csv").await?;
                write_tables(store, &r).await?;
                let json = Bytes::from(report::to_json(&r)?);
                let cond = if crate::undo::is(crate::undo::Fix::ReportOnce) { fleet_io::blob::Cond::Any } else { fleet_io::blob::Cond::Absent };
                store.put_if(&report_key(&job_id), json, "application/json", &Default::default(), &cond).await?;
            } else {
                put_through_file(store, &accounts_key(&job_id), "text/csv", |w| report::write_accounts_csv(&r, w)).await?;
                write_tables(store, &r).await?;
                put_through_file(store, &report_key(&job_id), "application/json", |w| report::write_json(&r, w).map_err(std::io::Error::from)).await?;
            }
        }
        // Written: the rows borrowed from the job's totals are let go before the job is changed.
        Ok(r.map_accounts(|_| ()))
    }

    /// Deletes a finished job's checkpoint parts (also what a fenced, stale owner may have left there).
    async fn delete_parts(&self, job_id: &str) {
        match self.store.list(&checkpoint_parts_prefix(job_id), MAX_OPEN_JOBS).await {
            Ok(keys) => {
                for key in keys {
                    if let Err(e) = self.store.delete(&key).await {
                        tracing::warn!(job = %job_id, %key, error = %e, "could not delete a checkpoint part of a finished job");
                    }
                }
            }
            Err(e) => tracing::warn!(job = %job_id, error = %e, "could not list the checkpoint parts of a finished job"),
        }
    }

    /// Says the job finished, with its report's figures and its latency since it was submitted.
    fn finished(&self, job: &Job, r: &report::Report<()>) {
        let submitted = time::OffsetDateTime::parse(&r.created_at, &time::format_description::well_known::Rfc3339).ok();
        let latency = submitted
            .and_then(|t| u64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok())
            .map(|ms| Duration::from_millis(self.clock.now_ms().saturating_sub(ms)));
        crate::events::JobFinished {
            job: job.id(),
            status: r.status,
            processed: r.transactions.processed,
            failed: r.transactions.failed,
            duplicates: r.transactions.duplicates,
            requests: r.requests.total,
            latency,
            total_chunks: job.tally().total_chunks(),
            failed_chunks: &r.failed_chunks,
            note: r.note.as_deref(),
        }
        .emit();
    }
}

/// What a finish's step found when it failed: fenced (another controller owns the job now) and
/// unreadable (the manifest cannot be read: it never will be) are answers; anything else leaves the
/// job as it stands, to be tried again.
fn refused(job_id: &str, e: Error) -> Result<Answer<Error>> {
    match e {
        Error::Conflict(why) => {
            tracing::warn!(job = %job_id, %why, "fenced while finishing: another controller owns the job now");
            Ok(Answer::Fenced)
        }
        e @ Error::Corrupt(_) => Ok(Answer::Unreadable(e)),
        e => Err(e),
    }
}

/// Writes the job's rows to the warehouse tables (see `fleet_warehouse`): each object created only if
/// absent, under the day of the committed ending, so that a finish tried again, or two controllers
/// finishing the job, leave one object per table. Written before `report.json`, which says the job's
/// warehouse objects are whole: a finish cut short between them is completed by the next one.
async fn write_tables<A: report::AccountRows>(store: &dyn BlobStore, r: &report::Report<A>) -> Result<()> {
    let started = std::time::Instant::now();
    let encode =
        || fleet_warehouse::keys(r).and_then(|keys| keys.into_iter().map(|(t, key)| Ok((key, t.encode(r)?))).collect::<fleet_warehouse::Result<Vec<_>>>());
    // A large job's encoding (a second or two for a million accounts) leaves this runtime thread to
    // the other tasks (a current-thread runtime, the simulation's, has no other to leave it to).
    let encoded = if r.accounts.len() > IN_MEMORY_ACCOUNTS && fleet_io::multi_thread() { tokio::task::block_in_place(encode) } else { encode() };
    let encode_ms = started.elapsed().as_millis() as u64;
    let objects = match encoded {
        Ok(o) => o,
        // Our own report's values (money at its currency's places, our clock's times): never expected. The
        // report is still written (it, not the tables, is the job's answer); the error names the job
        // and the value, for whoever writes its rows from the report.
        Err(e) => {
            tracing::error!(job = %r.job_id, error = %e, "the job's warehouse rows cannot be encoded; its report is written without them");
            return Ok(());
        }
    };
    let bytes: Vec<usize> = objects.iter().map(|(_, b)| b.len()).collect();
    for (key, body) in objects {
        let created = store.put_if(&key, Bytes::from(body), fleet_warehouse::MEDIA_TYPE, &Default::default(), &fleet_io::blob::Cond::Absent).await?;
        if created.is_none() {
            tracing::debug!(job = %r.job_id, %key, "the table's object was there already (a finish tried again)");
        }
    }
    tracing::info!(job = %r.job_id, accounts = r.accounts.len(), accounts_bytes = bytes[0], jobs_bytes = bytes[1], encode_ms, "warehouse tables written");
    Ok(())
}

/// Up to this many accounts, a report and its accounts.csv are made in memory; a larger job's go
/// through a temporary file each (`report.json` of a million accounts is about 135 MB).
const IN_MEMORY_ACCOUNTS: usize = 20_000;

/// Writes an object through a temporary file (in `TMPDIR`), streamed to the store from there: the
/// object is never whole in memory.
async fn put_through_file(
    store: &dyn BlobStore,
    key: &str,
    content_type: &str,
    write: impl FnOnce(&mut std::io::BufWriter<&std::fs::File>) -> std::io::Result<()>,
) -> Result<()> {
    use std::io::Write as _;
    let tmp = tempfile::NamedTempFile::new().map_err(|e| Error::local_file(&std::env::temp_dir(), format!("creating a temporary file: {e}")))?;
    {
        let mut w = std::io::BufWriter::with_capacity(1 << 16, tmp.as_file());
        write(&mut w).and_then(|()| w.flush()).map_err(|e| Error::local_file(tmp.path(), e))?;
    }
    store.put_file(key, tmp.path(), content_type).await
}
