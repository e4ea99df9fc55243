//! A take's effects in order, driven by hand with the answers a store and a lease would give.

use std::time::{Duration, Instant};

use fleet_domain::model::JobStatus;

use super::{Answer, Effect, Take};
use crate::expiry::Dormant;

type A = Answer<String>;

/// Drives a take to its end, answering each effect as `answer` says; returns the effects, named.
fn drive(dormant: Option<Dormant>, mut answer: impl FnMut(&Effect<String>, u32) -> A) -> Vec<String> {
    let mut t = Take::new("j", dormant);
    let mut seen = Vec::new();
    let mut next = Answer::Start;
    let mut loads = 0;
    loop {
        let effect = t.next(next, || "changed on every read".to_string());
        if matches!(effect, Effect::Load) {
            loads += 1;
        }
        seen.push(match &effect {
            Effect::Acquire => "acquire".to_string(),
            Effect::Load => "load".into(),
            Effect::Quarantine(e, etag) => format!("quarantine {e} {etag}"),
            Effect::Release => "release".into(),
            Effect::KeepDormant(d) => format!("dormant not before {:?}", d.not_before.map(|t| t.duration_since(d.since).as_secs())),
            Effect::Remember(s) => format!("remember {s:?}"),
            Effect::Taken(t) => format!("taken {t:?}"),
        });
        if matches!(effect, Effect::Taken(_)) {
            return seen;
        }
        next = answer(&effect, loads);
    }
}

fn dormant() -> Dormant {
    Dormant { since: Instant::now(), sealed: true, partition: Some(1), not_before: None }
}

#[test]
fn a_job_loaded_is_open_and_a_finished_one_is_remembered_before_its_lease_goes_back() {
    let loaded = drive(Some(dormant()), |e, _| match e {
        Effect::Acquire => Answer::Ours,
        _ => Answer::Loaded,
    });
    assert_eq!(loaded, ["acquire", "load", "taken Open"], "taken out of the dormant set for good");
    let finished = drive(Some(dormant()), |e, _| match e {
        Effect::Acquire => Answer::Ours,
        Effect::Load => Answer::Finished(JobStatus::Complete),
        _ => Answer::Done,
    });
    assert_eq!(finished, ["acquire", "load", "remember Complete", "release", "taken AlreadyFinished"]);
}

#[test]
fn a_busy_lease_keeps_the_job_dormant_until_it_may_have_run_out() {
    let d = dormant();
    let at = d.since + Duration::from_secs(10);
    let seen = drive(Some(d), |e, _| match e {
        Effect::Acquire => Answer::Busy { after: Duration::from_secs(5), ttl: Duration::from_secs(60), at },
        _ => Answer::Done,
    });
    assert_eq!(seen, ["acquire", "dormant not before Some(40)", "taken Busy(5s)"], "half the lease's time, the longer");
    let seen = drive(None, |e, _| match e {
        Effect::Acquire => Answer::Busy { after: Duration::from_secs(90), ttl: Duration::from_secs(60), at },
        _ => Answer::Done,
    });
    assert_eq!(seen, ["acquire", "taken Busy(90s)"], "a job that was not dormant is not made so");
}

#[test]
fn a_store_error_gives_the_lease_back_and_keeps_the_job_dormant_as_it_was() {
    let seen = drive(Some(dormant()), |e, _| match e {
        Effect::Acquire => Answer::Failed("timeout".into()),
        _ => Answer::Done,
    });
    assert_eq!(seen, ["acquire", "dormant not before None", "taken Failed(\"timeout\")"], "no lease to give back");
    let seen = drive(Some(dormant()), |e, _| match e {
        Effect::Acquire => Answer::Ours,
        Effect::Load => Answer::Failed("timeout".into()),
        _ => Answer::Done,
    });
    assert_eq!(seen, ["acquire", "load", "release", "dormant not before None", "taken Failed(\"timeout\")"]);
}

#[test]
fn only_the_same_document_failing_twice_is_quarantined() {
    // The same ETag twice: unreadable for good; the quarantine ends the take, the lease held by it.
    let seen = drive(Some(dormant()), |e, _| match e {
        Effect::Acquire => Answer::Ours,
        Effect::Load => Answer::Unreadable("corrupt".into(), "e1".into()),
        _ => Answer::Done,
    });
    assert_eq!(seen, ["acquire", "load", "load", "quarantine corrupt e1", "taken AlreadyFinished"]);
    // A new document each time (it changed under the read): read again, three reads at most.
    let seen = drive(None, |e, loads| match e {
        Effect::Acquire => Answer::Ours,
        Effect::Load => Answer::Unreadable("corrupt".into(), format!("e{loads}")),
        _ => Answer::Done,
    });
    assert_eq!(seen, ["acquire", "load", "load", "load", "release", "taken Failed(\"changed on every read\")"]);
    // Read again and loaded.
    let seen = drive(None, |e, loads| match (e, loads) {
        (Effect::Acquire, _) => Answer::Ours,
        (Effect::Load, 1) => Answer::Unreadable("corrupt".into(), "e1".into()),
        _ => Answer::Loaded,
    });
    assert_eq!(seen, ["acquire", "load", "load", "taken Open"]);
    // A quarantine that fails ends the take with its error, nothing given back.
    let seen = drive(Some(dormant()), |e, _| match e {
        Effect::Acquire => Answer::Ours,
        Effect::Load => Answer::Unreadable("corrupt".into(), "e1".into()),
        _ => Answer::Failed("timeout".into()),
    });
    assert_eq!(seen.last().map(String::as_str), Some("taken Failed(\"timeout\")"));
    assert!(!seen.iter().any(|s| s == "release" || s.starts_with("dormant")));
}
