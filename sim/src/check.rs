//! The invariants a run must keep, checked once it has settled: every job that the fleet heard of
//! ends exactly once (every report written for it says the same), `complete` only with totals equal
//! to the oracle, `partial` naming exactly the chunks that truly failed, nothing quarantined (no run
//! makes a job's state unreadable), never abandoned with a result missing (every billed chunk's result
//! arrives long before `--abandon-after`), no transaction counted twice, and every message deleted
//! (or dead-lettered and then applied): all queues empty. On a FIFO work queue, a job's chunks of one
//! account partition were first billed in the order they were sent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use fleet_domain::layout::{checkpoint_key, chunk_key, kept_key, manifest_key, open_key, quarantined_checkpoint_key, report_key, tariff_key, CHECKPOINTS_PREFIX};
use fleet_domain::model::{AccountsPayload, ChunkOutcome, JobStatus, ResultMessage};
use fleet_domain::report::Report;
use fleet_io::blob::BlobStore;
use fleet_io::memory::MemoryStore;
use fleet_io::queue::Queue;
use rust_decimal::Decimal;

use crate::fleet::{Ending, Fate, Groups, JobPlan, Row, FORGED, MALLORY, ROGUE_ABANDON};
use crate::{Setup, World, MAX_RECEIVES, VISIBILITY};

/// Whether the fleet hears of the job at all (a message of it reaches a results or dead-letter queue).
fn known(job: &JobPlan) -> bool {
    job.chunks.iter().any(|c| c.fate != Fate::Lost) || matches!(job.ending, Ending::Sealed | Ending::Abandoned)
}

async fn report(store: &MemoryStore, job: &str) -> Option<Report> {
    let body = store.get(&report_key(job)).await.ok()??;
    serde_json::from_slice(&body).ok()
}

async fn queues_empty(queues: &[Arc<dyn Queue>]) -> bool {
    for q in queues {
        match q.depth().await {
            Ok(d) if d.visible + d.in_flight + d.delayed == 0 => {}
            _ => return false,
        }
    }
    true
}

/// Every job the fleet knows has a report, every queue is empty, and no purge is still due.
pub async fn settled(jobs: &[Arc<JobPlan>], store: &MemoryStore, queues: &[Arc<dyn Queue>], _setup: &Setup) -> bool {
    for j in jobs.iter().filter(|j| known(j)) {
        if !matches!(store.head(&report_key(&j.id)).await, Ok(Some(_))) {
            return false;
        }
    }
    // Every purge done, and recorded: an open marker kept by a finish whose purge was not recorded
    // goes at a later scan (within an abandon time).
    let keys = store.keys();
    if keys.iter().any(|k| k.starts_with("purge")) || jobs.iter().any(|j| keys.contains(&open_key(&j.id)) && keys.contains(&report_key(&j.id))) {
        return false;
    }
    queues_empty(queues).await
}

fn rows_of(r: &Report) -> Result<BTreeMap<(String, String), Row>, String> {
    let mut out = BTreeMap::new();
    for a in &r.accounts {
        let gross: Decimal = a.gross.parse().map_err(|e| format!("gross {:?}: {e}", a.gross))?;
        let fees: Decimal = a.fees.parse().map_err(|e| format!("fees {:?}: {e}", a.fees))?;
        if out.insert((a.account_id.clone(), a.currency.clone()), (a.count, gross, fees)).is_some() {
            return Err(format!("account {} {} listed twice", a.account_id, a.currency));
        }
    }
    Ok(out)
}

/// The first three rows where `rows` and `oracle` differ, as `what` (reported, billed) says.
fn differences(rows: &BTreeMap<(String, String), Row>, oracle: &BTreeMap<(String, String), Row>, what: &str) -> String {
    let diff: Vec<String> = oracle
        .iter()
        .filter(|(k, o)| rows.get(*k) != Some(o))
        .map(|(k, o)| format!("{k:?}: {what} {:?}, oracle {o:?}", rows.get(k)))
        .chain(rows.keys().filter(|k| !oracle.contains_key(*k)).map(|k| format!("{k:?}: {what}, not in the oracle")))
        .take(3)
        .collect();
    diff.join("; ")
}

/// The invariants; each broken one is a line.
pub async fn invariants(jobs: &[Arc<JobPlan>], store: &MemoryStore, queues: &[Arc<dyn Queue>], world: &World, _setup: &Setup) -> Vec<String> {
    let mut v = Vec::new();
    let written = fleet_io::lock(&world.reports).clone();
    // The reports of a job and its twin, with the chunks each bills.
    let mut pairs: BTreeMap<String, (BTreeSet<u32>, Report)> = BTreeMap::new();
    for job in jobs {
        let id = &job.id;
        let Some(r) = report(store, id).await else {
            if known(job) {
                v.push(format!("job {id}: no report"));
            }
            continue;
        };
        if !known(job) {
            v.push(format!("job {id}: a report for a job the fleet never heard of"));
        }
        // Ends exactly once: every report written says the same.
        let versions: BTreeSet<String> = written
            .iter()
            .filter(|(_, k, _, _)| *k == report_key(id))
            .filter_map(|(_, _, b, _)| serde_json::from_slice::<Report>(b).ok())
            .map(|x| format!("{:?} {:?} {:?}", x.status, x.accounts, x.failed_chunks))
            .collect();
        if versions.len() > 1 {
            let writers: Vec<usize> = written.iter().filter(|(_, k, _, _)| *k == report_key(id)).map(|(c, _, _, _)| *c).collect();
            v.push(format!("job {id}: {} different reports written (by controllers {writers:?})", versions.len()));
        }
        // Written once: a second write (even of the same report) is a second finish.
        let writes = written.iter().filter(|(_, k, _, _)| *k == report_key(id)).count();
        if writes > 1 {
            v.push(format!("job {id}: its report was written {writes} times"));
        }
        let truly_failed = job.truly_failed();
        let lost: BTreeSet<u32> = (0..job.chunks.len() as u32).filter(|&c| job.chunks[c as usize].fate == Fate::Lost).collect();
        let reported_failed: BTreeSet<u32> = r.failed_chunks.iter().map(|f| f.chunk).collect();
        let (expected_status, expected_failed) = match job.ending {
            // A manifest that says more were accepted than its chunks hold is never `complete`.
            Ending::Sealed if truly_failed.is_empty() && !job.lying_manifest => (JobStatus::Complete, truly_failed.clone()),
            Ending::Sealed => (JobStatus::Partial, truly_failed.clone()),
            // Without a manifest nobody knows of the chunks that never reported.
            Ending::DiedBeforeManifest => (JobStatus::Abandoned, truly_failed.difference(&lost).copied().collect()),
            Ending::DiedAfterManifest => (JobStatus::Abandoned, truly_failed.clone()),
            // Abandoned on request: what had no result by then is failed too (at least the truly
            // failed chunks).
            Ending::Abandoned if reported_failed.is_superset(&truly_failed) => (JobStatus::Abandoned, reported_failed.clone()),
            Ending::Abandoned => (JobStatus::Abandoned, truly_failed.clone()),
        };
        if r.status != expected_status {
            v.push(format!("job {id} ({}, {:?}): status {:?}, expected {expected_status:?} (note: {:?})", job.shape, job.ending, r.status, r.note));
        }
        if reported_failed != expected_failed {
            v.push(format!("job {id}: failed chunks {reported_failed:?}, truly failed {expected_failed:?}"));
        }
        let billed: BTreeSet<u32> = (0..job.chunks.len() as u32).filter(|c| !expected_failed.contains(c) && !truly_failed.contains(c)).collect();
        // A job and its twin are billed together: each id once over the two (checked below).
        if job.twin_of.is_some() || jobs.iter().any(|t| t.twin_of.is_some_and(|o| jobs[o].id == *id)) {
            pairs.insert(id.clone(), (billed, r));
            continue;
        }
        let oracle = job.oracle(billed.into_iter());
        match rows_of(&r) {
            Ok(rows) if rows == oracle => {}
            Ok(rows) => {
                v.push(format!(
                    "job {id}: totals differ from the oracle ({} rows vs {}): {}",
                    rows.len(),
                    oracle.len(),
                    differences(&rows, &oracle, "reported")
                ));
            }
            Err(e) => v.push(format!("job {id}: unreadable report rows: {e}")),
        }
        let counted: u64 = r.accounts.iter().map(|a| a.count).sum();
        if r.transactions.processed != counted {
            v.push(format!("job {id}: processed {} but the accounts count {counted}", r.transactions.processed));
        }
    }
    for twin in jobs.iter().filter(|j| j.twin_of.is_some()) {
        let original = &jobs[twin.twin_of.expect("a twin")];
        // One of the two never reported (never heard of: it billed nothing): the other bills its own.
        let (b1, b2) = match (pairs.get(&original.id), pairs.get(&twin.id)) {
            (Some(a), Some(b)) => (a, b),
            (Some((billed, r)), None) | (None, Some((billed, r))) => {
                let own = jobs.iter().find(|j| j.id == r.job_id).expect("a planned job");
                if rows_of(r).ok().as_ref() != Some(&own.oracle(billed.iter().copied())) {
                    v.push(format!("job {}: totals differ from the oracle (its twin never reported)", r.job_id));
                }
                continue;
            }
            (None, None) => continue,
        };
        let ((b1, r1), (b2, r2)) = (b1, b2);
        for (r, other) in [(r1, &twin.id), (r2, &original.id)] {
            // Each duplicate of one is the other's (no other job carries their ids).
            let by: BTreeSet<&str> =
                r.rejected.iter().filter_map(|x| x.reason.strip_prefix("txn_id: already billed by job ")).filter_map(|s| s.split(' ').next()).collect();
            if by.iter().any(|j| *j != other.as_str()) {
                v.push(format!("job {}: duplicates of {by:?}, only {other} carries its ids", r.job_id));
            }
            let t = &r.transactions;
            let counted: u64 = r.accounts.iter().map(|a| a.count).sum();
            if t.processed != counted || t.duplicates as usize != r.rejected.iter().filter(|x| x.reason.starts_with("txn_id: already billed by job")).count() {
                v.push(format!("job {}: processed {} against its accounts' {counted}, or its duplicates not each listed ({:?})", r.job_id, t.processed, t));
            }
        }
        // Chunk for chunk the same rows: a chunk either bills is billed once.
        let oracle = original.oracle(b1.union(b2).copied());
        let mut sum: BTreeMap<(String, String), Row> = BTreeMap::new();
        for r in [r1, r2] {
            match rows_of(r) {
                Ok(rows) => {
                    for (k, (n, g, f)) in rows {
                        let e = sum.entry(k).or_insert((0, Decimal::ZERO, Decimal::ZERO));
                        (e.0, e.1, e.2) = (e.0 + n, e.1 + g, e.2 + f);
                    }
                }
                Err(e) => v.push(format!("job {}: unreadable report rows: {e}", r.job_id)),
            }
        }
        if sum != oracle {
            let diff = differences(&sum, &oracle, "billed");
            v.push(format!(
                "jobs {} and {} (the same rows twice): billed together differ from each row once ({} and {} duplicates): {}",
                original.id, twin.id, r1.transactions.duplicates, r2.transactions.duplicates, diff
            ));
        }
    }
    // Nothing left behind once every job has ended and every purge is done: under a finished job's
    // prefixes only its manifest, tariff and checkpoint (and, quarantined, the checkpoint it could not
    // read), and its failed chunks for a retry (their blobs, `kept.json` naming exactly them);
    // no other chunk or result blob, no checkpoint part, no open marker.
    let keys = store.keys();
    for job in jobs.iter().filter(|j| known(j)) {
        let prefixes = [format!("jobs/{}/", job.id), format!("{CHECKPOINTS_PREFIX}{}/", job.id)];
        let mut kept = vec![manifest_key(&job.id), checkpoint_key(&job.id), quarantined_checkpoint_key(&job.id), tariff_key(&job.id)];
        let failed: Vec<u32> = match report(store, &job.id).await {
            Some(r) if r.status != JobStatus::Quarantined => r.failed_chunks.iter().map(|f| f.chunk).collect(),
            _ => Vec::new(),
        };
        if !failed.is_empty() {
            let named = match store.get(&kept_key(&job.id)).await {
                Ok(Some(b)) => serde_json::from_slice::<fleet_domain::model::Kept>(&b).map(|k| k.chunks).map_err(|e| e.to_string()),
                other => Err(format!("{other:?}")),
            };
            if named.as_ref() != Ok(&failed) {
                v.push(format!("job {}: kept.json names {named:?}, its report's failed chunks are {failed:?}", job.id));
            }
            for &c in &failed {
                if !keys.contains(&chunk_key(&job.id, c)) {
                    v.push(format!("job {}: failed chunk {c}'s blob not kept for a retry", job.id));
                }
            }
            kept.extend(failed.iter().map(|&c| chunk_key(&job.id, c)));
            kept.push(kept_key(&job.id));
        }
        let ours = |k: &String| prefixes.iter().any(|p| k.starts_with(p.as_str()));
        let left: Vec<&String> = keys.iter().filter(|k| (ours(k) && !kept.contains(k)) || **k == open_key(&job.id)).take(3).collect();
        if !left.is_empty() {
            v.push(format!("job {}: left behind after its end and purge: {left:?}", job.id));
        }
    }
    for q in queues {
        if let Ok(d) = q.depth().await {
            if d.visible + d.in_flight + d.delayed > 0 {
                v.push(format!("queue {} not empty at the end: {d:?}", q.name()));
            }
        }
    }
    // Only what the hostile sender forged is quarantined (refused against its job's records): a
    // result that declares more rows than its chunk has, or names a chunk the job does not have.
    let mut wrongly = Vec::new();
    for key in store.keys().into_iter().filter(|k| k.starts_with("quarantine/") || (k.starts_with(CHECKPOINTS_PREFIX) && k.ends_with("/quarantined.json.zst")))
    {
        let forged = match fleet_io::quarantine::read(store, &key).await {
            Ok(Some(q)) => match serde_json::from_str::<ResultMessage>(&q.body) {
                Ok(m) if m.job_id().ends_with(FORGED) => true,
                // Refused by role: a rogue processor's abandon or seal, a rogue submitter's (or an
                // unsigned) result billing its own account.
                Ok(ResultMessage::Abandon { reason, .. }) if reason == ROGUE_ABANDON => true,
                Ok(ResultMessage::Sealed { .. }) if q.auth.as_deref().is_some_and(|a| a.starts_with("v1.processor.")) => true,
                Ok(ResultMessage::Chunk(c)) if matches!(&c.outcome, ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts } } if accounts.iter().any(|a| a.account_id == MALLORY)) => {
                    true
                }
                Ok(ResultMessage::Chunk(c)) => jobs.iter().find(|j| j.id == c.job_id).is_some_and(|j| {
                    let beyond = c.chunk as usize >= j.chunks.len();
                    beyond || c.transactions != j.chunks[c.chunk as usize].rows.len() as u64
                }),
                Ok(ResultMessage::Sealed { job_id, total_chunks, .. }) => {
                    jobs.iter().find(|j| j.id == job_id).is_some_and(|j| total_chunks as usize != j.chunks.len())
                }
                _ => false,
            },
            _ => false,
        };
        if !forged {
            wrongly.push(key);
        }
    }
    // A job nobody submitted leaves nothing but its quarantined messages: no lease, checkpoint,
    // open marker or report.
    let left: Vec<String> = store.keys().into_iter().filter(|k| k.contains(FORGED) && !k.starts_with("quarantine/")).collect();
    if !left.is_empty() {
        v.push(format!("a job nobody submitted left state behind: {left:?}"));
    }
    if !wrongly.is_empty() {
        v.push(format!("quarantined without an unreadable state or a forgery: {wrongly:?}"));
    }
    v
}

/// On a FIFO work queue with `--group-by account`: each job's chunks of one partition were first
/// handled in chunk order (the order the initiator sent them in).
pub fn group_order(jobs: &[Arc<JobPlan>], world: &World) -> Vec<String> {
    let handled = fleet_io::lock(&world.handled).clone();
    let mut v = Vec::new();
    for job in jobs.iter().filter(|j| matches!(j.groups, Some(Groups::Accounts(_)))) {
        let mut seen: BTreeMap<&str, u32> = BTreeMap::new();
        for (_, c) in handled.iter().filter(|(j, _)| *j == job.id) {
            let Some(group) = job.chunks[*c as usize].group.as_deref() else { continue };
            if let Some(before) = seen.insert(group, *c) {
                if before > *c {
                    v.push(format!("job {}: group {group} billed chunk {c} after chunk {before}", job.id));
                }
            }
        }
    }
    v
}

/// In a calm run (no fault, no hostile sender) nothing reaches a results dead-letter queue: no
/// controller receives from one; the work items that truly fail reach the work queue's, and each
/// is received from there once (forwarded to its partition, never handed back to try its luck).
pub fn calm(world: &World) -> Vec<String> {
    let ids = fleet_io::lock(&world.dead_letter_ids).clone();
    fleet_io::lock(&world.dead_letters)
        .iter()
        .filter_map(|(q, n)| {
            let distinct = ids.iter().filter(|(dq, _)| dq == q).count();
            if q.starts_with("billing-results") && *n > 0 {
                Some(format!("calm run: {n} messages received from dead-letter queue {q}"))
            } else if *n > distinct {
                Some(format!("calm run: {distinct} dead letters received {n} times from {q}"))
            } else {
                None
            }
        })
        .collect()
}

/// How long after its job's last message (or the end of the last fault, whichever is later) a
/// report may be written, beyond what the job's kind waits by design: two leases (a takeover: the
/// dead owner's membership, then its job's lease, each free a lease after the heir first saw it
/// unchanged), two visibility timeouts (a message in a dead controller's hands, then a hand-back), a
/// long poll, the checkpoint interval and a minute of slack for the listeners' idle back-off and S3
/// calls.
pub fn lateness_bound(setup: &Setup) -> Duration {
    setup.lease() * 2
        + setup.results_visibility.max(VISIBILITY) * 2
        + Duration::from_secs(setup.settings.listener.receive_wait_secs)
        + controller::FLUSH_INTERVAL
        + Duration::from_secs(60)
}

/// Every report within [`lateness_bound`] of its job's last message (and of the last fault), plus
/// what its kind waits by design: the settle time when a chunk failed, the stall time when a work
/// item was lost, the abandon time when the job never sealed, the dead-lettering of a poison chunk.
/// Returns the largest lateness seen (seconds beyond the job's own wait) and the broken bounds.
pub fn lateness(jobs: &[Arc<JobPlan>], world: &World, setup: &Setup) -> (f64, Vec<String>) {
    let written = fleet_io::lock(&world.reports).clone();
    let last_sent = fleet_io::lock(&world.last_sent).clone();
    let faults_end = *fleet_io::lock(&world.faults_end);
    let work_held_until = fleet_io::lock(&world.work_held_until).clone();
    let bound = lateness_bound(setup);
    let (mut worst, mut v) = (0.0f64, Vec::new());
    for job in jobs {
        let Some(at) = written.iter().filter(|(_, k, _, _)| *k == report_key(&job.id)).map(|(_, _, _, t)| *t).min() else { continue };
        let fates: Vec<Fate> = job.chunks.iter().map(|c| c.fate).collect();
        let mut wait = Duration::ZERO;
        if fates.iter().any(|f| matches!(f, Fate::Failed | Fate::Poison)) {
            wait += Duration::from_secs(setup.settings.settle_secs);
        }
        if fates.contains(&Fate::Poison) {
            // Received MAX_RECEIVES times, a visibility timeout and a processing apart, then moved.
            wait += (VISIBILITY + Duration::from_secs(8)) * (MAX_RECEIVES + 1);
        }
        if fates.contains(&Fate::Lost) && job.ending == Ending::Sealed {
            // Quiet for the stall time, then the queues seen empty in turn at two expiry ticks.
            let tick = Duration::from_secs(setup.settings.abandon_after / 10).clamp(Duration::from_millis(200), Duration::from_secs(60));
            wait += Duration::from_secs(setup.settings.stall_after) + tick * 2;
        }
        if matches!(job.ending, Ending::DiedAfterManifest | Ending::DiedBeforeManifest) {
            wait += Duration::from_secs(setup.settings.abandon_after) + Duration::from_secs(setup.settings.abandon_after / 10).min(Duration::from_secs(60));
        }
        if setup.agent_down && fleet_io::lock(&world.unheard_dead_letters).contains(&job.id) {
            // With the scaling agent down, nobody announces a dead letter SQS moved, and no
            // controller waits for a job it never heard of: the dead-letter queue's listener finds
            // it at its safety poll (degraded, as docs/scaling.md says; with the agent up it is
            // announced at its next look).
            wait += Duration::from_secs(setup.settings.listener.park_poll_secs);
        }
        let mut from = last_sent.get(&job.id).copied().unwrap_or_default().max(faults_end);
        if fates.contains(&Fate::Lost) && job.ending == Ending::Sealed {
            // The stall rule waits for every queue to be seen empty since the job's last news, and
            // the work queue is every job's: a processor stalled with another job's work item (or a
            // copy of this one's) in hand holds it non-empty until it sends (seed 342656978: a job's
            // stall waited for another job's straggler, 354 s after the faults ended). Only a hold
            // that ended before the report can have delayed it.
            from = from.max(work_held_until.iter().copied().filter(|end| *end <= at).max().unwrap_or_default());
        }
        let late = at.saturating_sub(from + wait);
        worst = worst.max(late.as_secs_f64());
        if late > bound {
            v.push(format!(
                "job {}: report {:.0} s after its last message or fault and its own wait of {:.0} s (bound {:.0} s)",
                job.id,
                (at.saturating_sub(from)).as_secs_f64(),
                wait.as_secs_f64(),
                bound.as_secs_f64()
            ));
        }
    }
    (worst, v)
}

/// No job finished before its time: one that never sealed not before the abandon time has passed
/// since the fleet last sent a message of it, one that stalled not before the stall time, one with a
/// failed chunk not before the settle time (less the controllers' clock skew, read through checkpoint times, and a second of their
/// precision). A controller that judged a job's quiet from a stale view (a scan's, before the job had
/// news on another controller) finished it early, with results still to come.
pub fn early(jobs: &[Arc<JobPlan>], world: &World, setup: &Setup) -> Vec<String> {
    let written = fleet_io::lock(&world.reports).clone();
    let last_sent = fleet_io::lock(&world.last_sent).clone();
    let margin = Duration::from_secs(setup.settings.lease_secs) / 5 + Duration::from_secs(2);
    let mut v = Vec::new();
    for job in jobs {
        let Some(at) = written.iter().filter(|(_, k, _, _)| *k == report_key(&job.id)).map(|(_, _, _, t)| *t).min() else { continue };
        let Some(sent) = last_sent.get(&job.id).copied() else { continue };
        let quiet = match job.ending {
            Ending::DiedAfterManifest | Ending::DiedBeforeManifest => setup.settings.abandon_after,
            Ending::Sealed if job.chunks.iter().any(|c| c.fate == Fate::Lost) => setup.settings.stall_after,
            // A failure stands once nothing came for the settle time.
            Ending::Sealed if job.chunks.iter().any(|c| matches!(c.fate, Fate::Failed | Fate::Poison)) => setup.settings.settle_secs,
            _ => continue,
        };
        let due = sent + Duration::from_secs(quiet);
        if at + margin < due {
            v.push(format!(
                "job {} ({:?}): finished {:.0} s after its last message, {:.0} s before its quiet time of {quiet} s had passed",
                job.id,
                job.ending,
                at.saturating_sub(sent).as_secs_f64(),
                due.saturating_sub(at).as_secs_f64()
            ));
        }
    }
    v
}
