//! The job's transitions alone: no store, no queue, no clock but the instants given; a message's
//! handle is its id.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;
use crate::expiry::Ending;
use crate::item::Ready;
use fleet_domain::billing::AccountTotals;
use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, Manifest, ResultMessage};
use fleet_domain::requests::{Billed, Op};
use rust_decimal::Decimal;

/// A wall time, the same for every event (the tests compare checkpoint times they set themselves).
const WALL: &str = "2026-12-07T00:00:00Z";

/// The wall time, as a checkpoint plan asks for it.
fn wall() -> String {
    WALL.into()
}

/// A new checkpoint part's name.
fn part() -> String {
    "part".into()
}

fn job() -> Job<String> {
    Job::new("j", Instant::now(), WALL.into(), Unsaved::new(Arc::default()))
}

fn ready(msg: ResultMessage) -> Ready<String> {
    Ready::of(msg)
}

fn chunk(c: u32, n: u64) -> Ready<String> {
    let a = AccountTotals { account_id: "a".into(), currency: "EUR".into(), count: n, gross: Decimal::new(100 * n as i64, 2), fees: Decimal::ZERO };
    ready(ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: "j".into(),
        chunk: c,
        transactions: n,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![a] } },
        requests: RequestCounts::default(),
    }))
}

fn failed(c: u32) -> Ready<String> {
    ready(ResultMessage::Chunk(ChunkResult {
        v: 1,
        job_id: "j".into(),
        chunk: c,
        transactions: 99,
        outcome: ChunkOutcome::Failed { reason: "bad".into() },
        requests: RequestCounts::default(),
    }))
}

fn seal(total: u32) -> Ready<String> {
    ready(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: total })
}

fn manifest(chunks: &[u64]) -> Manifest {
    let mut m = placeholder_manifest("j", chunks.len() as u32, chunks.iter().sum());
    m.created_at = "2026-11-26T00:00:00Z".into();
    m.chunk_transactions = chunks.to_vec();
    m
}

/// Commits `commit` as if its checkpoint was written.
fn commit(j: &mut Job<String>, commit: Commit) {
    let save = j.plan(commit, &RequestCounts::default(), wall, part).unwrap();
    j.saved(save, "\"etag\"".into(), Instant::now());
}

#[test]
fn a_chunk_counts_once_a_real_result_replaces_a_failure_and_the_seal_bounds_the_job() {
    let mut j = job();
    j.apply(chunk(0, 2)).unwrap();
    j.apply(chunk(0, 2)).unwrap();
    j.apply(failed(1)).unwrap();
    assert!(!j.tally().all_in(), "not sealed");
    j.apply(seal(2)).unwrap();
    assert!(j.tally().all_in());
    assert_eq!(j.failed().len(), 1);
    j.apply(chunk(1, 3)).unwrap();
    assert_eq!((j.failed().len(), j.tally().processed()), (0, 5), "the real result replaced the failure");
    j.apply(chunk(7, 50)).unwrap();
    assert_eq!(j.tally().processed(), 5, "beyond the sealed size: ignored");
    let d = j.decide_now(&manifest(&[2, 3]));
    assert_eq!((d.status, d.note.as_deref()), (JobStatus::Complete, None));
}

#[test]
fn a_job_with_a_failure_finishes_only_once_settled_and_its_ending_is_kept() {
    let mut j = job();
    for r in [chunk(0, 1), failed(1), seal(2)] {
        j.apply(r).unwrap();
    }
    let settle = Duration::from_secs(120);
    let t0 = j.news();
    assert_ne!(j.next(t0 + Duration::from_secs(119), t0, settle, Asker::Timer), Next::Finish);
    assert_eq!(j.next(t0 + settle, t0, settle, Asker::Timer), Next::Finish);
    assert_ne!(j.next(t0 + settle, t0 + Duration::from_secs(60), settle, Asker::Timer), Next::Finish, "no idle time from before the floor");
    let d = j.decide_now(&manifest(&[1, 4]));
    assert_eq!(d.status, JobStatus::Partial);
    assert_eq!(d.failed[0].transactions, 4, "the manifest's count, not the 99 the result declared");
    let mut a = job();
    a.apply(chunk(0, 1)).unwrap();
    a.ask_to_end(Ending::Abandon("first".into()));
    a.ask_to_end(Ending::Abandon("second".into()));
    assert_eq!(a.next(a.news(), a.news(), settle, Asker::Timer), Next::Finish, "an abandon asked for: finished at once");
    let d = a.decide_now(&manifest(&[1, 2, 3]));
    assert_eq!(d.status, JobStatus::Abandoned);
    assert_eq!(d.failed.iter().map(|f| (f.chunk, f.transactions)).collect::<Vec<_>>(), [(1, 2), (2, 3)]);
    assert_eq!(d.note.as_deref(), Some("abandoned: first"), "the first reason asked for is kept");
}

/// Deciding changes nothing; a planned checkpoint changes nothing until it is written; a committed
/// ending is the only one the job ever reports, takes no more results, and its end drops the rows.
#[test]
fn an_ending_is_the_job_s_only_once_a_checkpoint_commits_it() {
    let mut j = job();
    for r in [chunk(0, 2), failed(1), seal(2)] {
        j.apply(r).unwrap();
    }
    let d = j.decide_now(&manifest(&[2, 5]));
    assert!(j.is_open(), "deciding is not committing");
    // The write failed: the plan is dropped, the job is as it was (no flag to roll back).
    let lost = j.plan(Commit::Ending(d.clone()), &RequestCounts::default(), wall, part).unwrap();
    drop(lost);
    assert_eq!((j.is_open(), j.failed().len()), (true, 1));
    j.apply(chunk(1, 5)).unwrap();
    assert_eq!(j.failed().len(), 0, "still open: the real result replaced the failure");
    // Decided again and written: the ending is committed.
    let d = j.decide_now(&manifest(&[2, 5]));
    assert_eq!(d.status, JobStatus::Complete);
    // Calls counted before the plan are in its document; the write's own, counted once made, wait
    // for the next (and are the job's uncommitted calls until then).
    let mut calls = RequestCounts::default();
    calls.add(Billed::call(Op::S3GetObject), 3);
    j.count(&calls);
    assert_eq!(j.writes().uncommitted().calls(Op::S3GetObject), 3);
    let save = j.plan(Commit::Ending(d.clone()), &RequestCounts::default(), wall, part).unwrap();
    j.saved(save, "\"e1\"".into(), Instant::now());
    assert_eq!(j.phase(), &Phase::Ending(d.clone()));
    assert_eq!(j.tally().requests().calls(Op::S3GetObject), 3, "counted calls are in the checkpoint");
    assert_eq!(j.writes().uncommitted().total(), 0, "and committed with it");
    j.count(&[(Billed::call(Op::S3PutObject), 1)].into_iter().collect());
    assert_eq!(
        (j.tally().requests().calls(Op::S3PutObject), j.writes().uncommitted().calls(Op::S3PutObject)),
        (1, 1),
        "the write's own: in memory, for the next"
    );
    // Nothing more is taken, and a decision asked again is the committed one.
    assert!(j.apply_batch(vec![(failed(0), (Source::Results, "late".to_string()))], Instant::now()).is_ok());
    assert_eq!((j.failed().len(), j.unsaved().len()), (0, 1), "a late failure is not applied, only kept for the finish");
    assert_eq!(j.decide_now(&manifest(&[9, 9])), d);
    assert_eq!(j.next(j.news(), j.news(), Duration::from_secs(120), Asker::Timer), Next::Finish);
    commit(&mut j, Commit::Final);
    assert_eq!(j.phase(), &Phase::Finished(JobStatus::Complete));
    assert_eq!(j.done().len(), 1);
}

/// A job quarantined (committed) whose report could not be written stays in memory: it asks to
/// be finished again (the report written), never to be saved (no checkpoint follows an end).
#[test]
fn a_quarantined_job_left_in_memory_asks_only_to_be_finished() {
    let mut j = job();
    j.apply_batch(vec![(chunk(0, 1), (Source::Results, "1".to_string()))], Instant::now()).unwrap();
    commit(&mut j, Commit::Quarantined);
    assert_eq!(j.phase(), &Phase::Finished(JobStatus::Quarantined));
    let t = Instant::now();
    assert_eq!(j.next(t, t, Duration::from_secs(120), Asker::Timer), Next::Finish, "its report is left to write");
    assert_eq!(j.next(t, t, Duration::from_secs(120), Asker::Batch), Next::Finish);
}

#[test]
fn a_batch_saves_once_enough_is_unsaved_the_timer_whatever_is() {
    let mut j = job();
    let t0 = Instant::now();
    let settle = Duration::from_secs(120);
    assert_eq!(j.next(t0, t0, settle, Asker::Timer), Next::Wait, "nothing unsaved");
    j.apply_batch(vec![(chunk(0, 1), (Source::Results, "1".to_string()))], t0).unwrap();
    assert_eq!(j.next(t0, t0, settle, Asker::Timer), Next::Save);
    assert_eq!(j.next(j.saved, t0, settle, Asker::Batch), Next::Wait, "one message, just saved");
    assert_eq!(j.next(j.saved + FLUSH_INTERVAL, t0, settle, Asker::Batch), Next::Save);
    commit(&mut j, Commit::Progress);
    assert!(j.is_open());
}

/// Handing a job over gives back exactly the messages applied since its last checkpoint (for the
/// new owner), dropping it gives them back with their queues (to hold), and the aggregator's count
/// of unsaved messages follows both.
#[test]
fn a_job_handed_over_or_dropped_gives_back_exactly_its_unsaved_messages() {
    let kept = |id: &str| id.to_string();
    let count = Arc::new(AtomicUsize::new(0));
    let mut a: Job<String> = Job::new("a", Instant::now(), WALL.into(), Unsaved::new(count.clone()));
    a.unsaved.extend(vec![(Source::Results, kept("1")), (Source::ResultsDeadLetter, kept("2"))]);
    let mut b: Job<String> = Job::new("b", Instant::now(), WALL.into(), Unsaved::new(count.clone()));
    b.unsaved.extend(vec![(Source::WorkDeadLetter, kept("3"))]);
    assert_eq!(count.load(Ordering::Relaxed), 3);
    let handed: Vec<String> = a.hand_over();
    assert_eq!(handed, ["1", "2"]);
    assert_eq!(count.load(Ordering::Relaxed), 1);
    let dropped: Vec<(Source, String)> = b.drop_unsaved();
    assert_eq!(dropped, [(Source::WorkDeadLetter, "3".to_string())]);
    assert_eq!(count.load(Ordering::Relaxed), 0);
}

/// Only what changes a job is its news: a duplicate, a second seal or an abandon asked again
/// restarts neither its stall nor its abandon time, and a checkpoint that only covers them keeps
/// the checkpoint's time (which other controllers date the job's news by); a first result, the
/// seal and an ending move both.
#[test]
fn a_duplicate_is_not_news() {
    let mut n = 0;
    let mut kept = || {
        n += 1;
        (Source::Results, n.to_string())
    };
    let mut j = job();
    let t0 = Instant::now();
    let (t1, t2, t3) = (t0 + Duration::from_secs(10), t0 + Duration::from_secs(20), t0 + Duration::from_secs(30));
    j.apply_batch(vec![(chunk(0, 2), kept()), (seal(2), kept())], t1).unwrap();
    assert_eq!(j.news(), t1, "a first result and the seal are news");
    commit(&mut j, Commit::Progress);
    j.tally.cp.updated_at = "2026-11-26T00:00:00Z".into();
    j.apply_batch(vec![(chunk(0, 2), kept()), (seal(2), kept()), (seal(3), kept())], t2).unwrap();
    assert_eq!(j.news(), t1, "a duplicate, the seal again and a conflicting seal are not news");
    commit(&mut j, Commit::Progress);
    assert_eq!(j.tally.cp.updated_at, "2026-11-26T00:00:00Z", "a checkpoint covering only duplicates keeps its time");
    j.apply_batch(vec![(failed(1), kept())], t3).unwrap();
    assert_eq!(j.news(), t3, "a chunk's first failure is news");
    commit(&mut j, Commit::Progress);
    assert_ne!(j.tally.cp.updated_at, "2026-11-26T00:00:00Z", "a checkpoint with news has a new time");
}

impl<H> Job<H> {
    /// Decides at the tests' wall time.
    fn decide_now(&self, manifest: &Manifest) -> Decision {
        self.decide(manifest, WALL)
    }
}
