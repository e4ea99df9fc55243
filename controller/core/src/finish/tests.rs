//! A finish's effects in order, driven by hand: each answer is what a driver would find, each commit
//! written by the test as the driver writes it (planned, then taken by the job).

use std::sync::Arc;
use std::time::Instant;

use fleet_domain::billing::AccountTotals;
use fleet_domain::model::{AccountsPayload, ChunkOutcome, ChunkResult, JobStatus, Manifest, ResultMessage};
use fleet_domain::requests::RequestCounts;
use rust_decimal::Decimal;

use super::{Answer, Effect, Finish};
use crate::decision::Commit;
use crate::expiry::Ending;
use crate::item::{Ready, Source};
use crate::job::{placeholder_manifest, Job, Phase, Unsaved};

const WALL: &str = "2026-12-07T00:00:00Z";

type Answered = Answer<&'static str>;

fn ready(msg: ResultMessage) -> Ready<String> {
    Ready::of(msg)
}

/// A job with chunk 0 of `total` in (two transactions), sealed when `sealed`, loaded from a
/// checkpoint (`resumed`: its marker is there) or new.
fn job(total: u32, sealed: bool, resumed: bool) -> Job<String> {
    let mut j = Job::new("j", Instant::now(), WALL.into(), Unsaved::new(Arc::default()));
    let a = AccountTotals { account_id: "a".into(), currency: "EUR".into(), count: 2, gross: Decimal::new(200, 2), fees: Decimal::ZERO };
    let chunk = ChunkResult {
        v: 1,
        job_id: "j".into(),
        chunk: 0,
        transactions: 2,
        outcome: ChunkOutcome::Processed { payload: AccountsPayload::Inline { accounts: vec![a] } },
        requests: RequestCounts::default(),
    };
    let mut items = vec![(ready(ResultMessage::Chunk(chunk)), (Source::Results, "m0".to_string()))];
    if sealed {
        items.push((ready(ResultMessage::Sealed { v: 1, job_id: "j".into(), total_chunks: total }), (Source::Results, "m1".to_string())));
    }
    j.apply_batch(items, Instant::now()).unwrap();
    if resumed {
        j.writes_mut().marked();
    }
    j
}

fn manifest(chunks: &[u64]) -> Arc<Manifest> {
    let mut m = placeholder_manifest("j", chunks.len() as u32, chunks.iter().sum());
    m.created_at = "2026-11-26T00:00:00Z".into();
    m.chunk_transactions = chunks.to_vec();
    Arc::new(m)
}

/// Writes the checkpoint that commits `commit`, as the driver does.
fn write(j: &mut Job<String>, commit: Commit) {
    let save = j.plan(commit, &RequestCounts::default(), || WALL.into(), || "part".into()).unwrap();
    j.saved(save, "\"etag\"".into(), Instant::now());
}

/// Drives a finish to its end, answering each effect as `answer` says (a commit is written when
/// answered `Done`); returns the effects in order, named.
fn drive(j: &mut Job<String>, mut answer: impl FnMut(&Effect<&'static str>) -> Answered) -> Vec<String> {
    let mut f = Finish::default();
    let mut seen = Vec::new();
    let mut next = Answer::Start;
    loop {
        let effect = f.next(j, next, || WALL.into());
        seen.push(match &effect {
            Effect::Renew => "renew".to_string(),
            Effect::MarkOpen => "mark".into(),
            Effect::ReadManifest => "manifest".into(),
            Effect::Commit(Commit::Ending(d)) => format!("commit ending {:?}", d.status),
            Effect::Commit(c) => format!("commit {c:?}"),
            Effect::Claim(_) => "claim".into(),
            Effect::Report(_) => "report".into(),
            Effect::HandOver => "hand over".into(),
            Effect::Quarantine(why) => format!("quarantine {why:?}"),
            Effect::NoManifest => "no manifest".into(),
            Effect::Finished(s) => format!("finished {s:?}"),
        });
        next = answer(&effect);
        match effect {
            Effect::Commit(c) if matches!(next, Answer::Done) => write(j, c),
            // What the driver settles once it has claimed (here: no duplicate).
            Effect::Claim(_) if matches!(next, Answer::Done) => j.settle_claims(&[], Vec::new()).unwrap(),
            Effect::HandOver | Effect::Quarantine(_) | Effect::NoManifest | Effect::Finished(_) => return seen,
            _ => {}
        }
    }
}

/// The answers of a store that holds `manifest` and does all it is asked.
fn fine(manifest: Option<Arc<Manifest>>) -> impl FnMut(&Effect<&'static str>) -> Answered {
    move |e| match e {
        Effect::Renew => Answer::Renewed(true),
        Effect::ReadManifest => Answer::Manifest(manifest.clone()),
        _ => Answer::Done,
    }
}

#[test]
fn a_complete_job_commits_its_ending_then_its_report_then_drops_its_rows() {
    let mut j = job(1, true, true);
    let seen = drive(&mut j, fine(Some(manifest(&[2]))));
    assert_eq!(seen, ["renew", "manifest", "commit ending Complete", "claim", "report", "commit Final", "finished Complete"]);
    assert_eq!(j.phase(), &Phase::Finished(JobStatus::Complete));
}

#[test]
fn a_job_never_checkpointed_is_marked_open_before_anything_is_written() {
    let mut j = job(1, true, false);
    let seen = drive(&mut j, fine(Some(manifest(&[2]))));
    assert_eq!(seen[..3], ["renew", "mark", "manifest"]);
    assert!(!j.writes().needs_marker(), "marked once the marker was written");
    let mut unanswered = job(1, true, false);
    let mut f = Finish::default();
    assert!(matches!(f.next::<_, &str>(&mut unanswered, Answer::Start, || WALL.into()), Effect::Renew));
    assert!(matches!(f.next::<_, &str>(&mut unanswered, Answer::Renewed(true), || WALL.into()), Effect::MarkOpen));
    assert!(unanswered.writes().needs_marker(), "not marked before the write's answer");
}

#[test]
fn a_lost_lease_or_a_fenced_write_hands_the_job_over_and_changes_nothing() {
    let mut j = job(1, true, true);
    let seen = drive(&mut j, |e| match e {
        Effect::Renew => Answer::Renewed(false),
        _ => Answer::Done,
    });
    assert_eq!(seen, ["renew", "hand over"]);
    let seen = drive(&mut j, |e| match e {
        Effect::Renew => Answer::Renewed(true),
        Effect::ReadManifest => Answer::Manifest(Some(manifest(&[2]))),
        _ => Answer::Fenced,
    });
    assert_eq!(seen, ["renew", "manifest", "commit ending Complete", "hand over"]);
    assert!(j.is_open(), "the ending was not committed: the job is as it was");
}

#[test]
fn an_ending_committed_before_is_reported_without_deciding_again() {
    let mut j = job(3, true, true);
    let first = drive(&mut j, |e| match e {
        Effect::Renew => Answer::Renewed(true),
        Effect::ReadManifest => Answer::Manifest(Some(manifest(&[2, 1, 1]))),
        Effect::Report(_) => Answer::Unreadable("a report write failed"),
        _ => Answer::Done,
    });
    assert_eq!(first.last().map(String::as_str), Some("quarantine Some(\"a report write failed\")"));
    let mut j = job(3, true, true);
    j.ask_to_end(Ending::Stalled("quiet".into()));
    let m = manifest(&[2, 1, 1]);
    let decision = j.decide(&m, WALL);
    write(&mut j, Commit::Ending(decision));
    let seen = drive(&mut j, fine(Some(m)));
    assert_eq!(seen, ["renew", "manifest", "claim", "report", "commit Final", "finished Partial"], "the committed decision, not a new one");
}

#[test]
fn without_a_manifest_only_an_abandoned_job_ends() {
    let mut j = job(1, false, true);
    assert_eq!(drive(&mut j, fine(None)), ["renew", "manifest", "no manifest"]);
    j.ask_to_end(Ending::Abandon("no seal".into()));
    assert_eq!(drive(&mut j, fine(None)), ["renew", "manifest", "commit ending Abandoned", "claim", "report", "commit Final", "finished Abandoned"]);
}

#[test]
fn an_unreadable_manifest_or_a_quarantined_job_is_quarantined() {
    let mut j = job(1, true, true);
    let seen = drive(&mut j, |e| match e {
        Effect::Renew => Answer::Renewed(true),
        Effect::ReadManifest => Answer::Unreadable("invalid JSON"),
        _ => Answer::Done,
    });
    assert_eq!(seen, ["renew", "manifest", "quarantine Some(\"invalid JSON\")"]);
    write(&mut j, Commit::Quarantined);
    assert_eq!(drive(&mut j, fine(None)), ["renew", "quarantine None"], "only its report is left");
}

#[test]
fn a_committed_ending_whose_claims_are_settled_is_reported_without_claiming_again() {
    let mut j = job(1, true, true);
    let decision = j.decide(&manifest(&[2]), WALL);
    write(&mut j, Commit::Ending(decision));
    let a = AccountTotals { account_id: "a".into(), currency: "EUR".into(), count: 1, gross: Decimal::new(100, 2), fees: Decimal::ZERO };
    j.settle_claims(&[a], Vec::new()).unwrap();
    assert_eq!(j.tally().totals().changed_accounts(), 1, "the totals taken out are written with the next checkpoint");
    let seen = drive(&mut j, fine(Some(manifest(&[2]))));
    assert_eq!(seen, ["renew", "manifest", "report", "commit Final", "finished Complete"]);
}
