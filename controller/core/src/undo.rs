//! Switches that undo the controller's fixes one at a time, for the simulation's mutation harness
//! (`fleet-sim --mutations`): a check counts only if undoing the fix it guards makes it fail. Each
//! [`Fix`] names one fix of an exactness, liveness or ownership bug, and the code it guards asks
//! [`is`] before doing the fixed thing.
//!
//! The switches exist only under `cfg(fleet_undo)`, which no feature and no build of this
//! package can turn on: the harness's own package, `controller-core-undoable` (`sim/core/`),
//! compiles this same source with that cfg set by its build script, and only the harness's build of
//! the controller (`controller-undoable`, for `fleet-sim`) links it. In every build of the
//! `controller` package (its binary included, whatever `cargo build` selects) `is` is `false` at
//! compile time, the fixes' names are not compiled in and `CONTROLLER_UNDO` is never read. In the harness's build a switch is set per
//! thread, for the seed run on that thread (each seed runs on one thread, under a current-thread
//! runtime), or for the whole process by `CONTROLLER_UNDO=<name>` (the unit tests' run,
//! `deploy/mutations.sh`).

/// A fix that the harness can undo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fix {
    /// A checkpoint that fails to read is read again before the job is quarantined (issue 42).
    QuarantineSecondRead,
    /// A dormant job's idle time is read from the checkpoint it is loaded with, not the scan's (issue 42).
    NewsFromCheckpoint,
    /// A conditional write whose answer was lost is read back to see it was ours (issue 42).
    LostAnswerReadBack,
    /// A checkpoint write whose outcome was unknown is remembered: a later write that finds it in
    /// place writes again on its ETag, instead of concluding another controller owns the job (issue 58, found by the simulation).
    EarlierWriteReadBack,
    /// Open jobs are scanned at every expiry tick while a dormant one names no partition (issue 58, found by the simulation).
    UnpartitionedLookedAtEachTick,
    /// A dormant job whose lease a batch finds busy stays dormant (issue 58, found by the simulation).
    BusyStaysDormant,
    /// A seal is checked against the manifest (issue 43).
    SealAgainstManifest,
    /// A result's row count is checked against its chunk's record (issue 43).
    CountAgainstRecord,
    /// A message for a job without records waits a bounded number of receives, then is quarantined (issue 43).
    UnrecordedQuarantined,
    /// A payload's decoding is capped by its chunk's recorded figures, not the global cap (issue 43).
    DecodeCapFromRecord,
    /// Held messages go back to their queue at once on a stop or when a partition is given up (issue 43).
    HandBackHeld,
    /// A dead-lettered work item is forwarded to its job's partition (issue 43).
    ForwardDeadLetters,
    /// A partition given up checkpoints its jobs and gives their leases back (issue 43).
    LetGoOfPartitionJobs,
    /// A partition asked for is handed over only once its owner has stopped reading it (issue 43).
    HandOverWhenStopped,
    /// A live owner's partition is never taken as free (issue 43).
    LiveOwnerNotFree,
    /// Expired members leave the ownership table (their partitions are freed) (issue 43).
    DropExpiredMembers,
    /// A controller that could not renew its membership in time stops reading (issue 43).
    StaleStopsReading,
    /// A gained partition's listeners look again after a visibility timeout and a hold (issue 43).
    HeirWakes,
    /// A failed scan of the open jobs is tried again at the next tick, not an abandon time later (issue 43, found by the simulation).
    ScanRetried,
    /// A gained partition's quiet jobs are found at the next expiry tick (issue 43, found by the simulation).
    RescanOnGain,
    /// A finish tried again does not write the report a second time (issue 43, found by the simulation).
    ReportOnce,
    /// Messages of another queue that a batch completes are completed on their own queue (issue 43, found by the simulation).
    OwnQueueCompletes,
    /// The partitions a round says to stop are all stopped at once, not one per round (issue 43, found by the simulation).
    StopAtOnce,
    /// A finished job's purge is recorded (its marker written) before its open marker goes, and one that fails is tried again (issue 43, found by the simulation).
    PurgeRecorded,
    /// A dormant job of a partition this controller does not read is left to the partition's owner (issue 43, found by the simulation).
    OwnersLoadDormant,
    /// A dormant job whose checkpoint names no partition (the release before partitions wrote it)
    /// takes its partition from its manifest (issue 43, found by the simulation).
    PartitionFromManifest,
    /// The partition of a job waiting in memory is looked at every minute, its listeners parked or
    /// not (issue 43, found by the simulation).
    WaitingLooks,
    /// A failed balancing round is tried again a twelfth of a lease later, not an interval later
    /// (issue 43, found by the simulation).
    RoundRetriedSoon,
    /// A message read from a partition other than its job's recorded one is forwarded there, never
    /// loaded or leased where it was read (issue 58).
    StraysForwarded,
    /// A result whose decoding could take more than the whole decode budget is refused, not decoded
    /// alone past it (issue 58).
    RefuseOverBudget,
    /// A job is finished `complete` only when processed + failed transactions equal the accepted
    /// (issue 58).
    CompleteOnlyWhenCounted,
    /// A message counts only when signed by a role that may send it (issue 58).
    RolesChecked,
    /// A result counts only with its chunk's token, which only its work item brought (issue 58).
    ChunkTokenChecked,
    /// A message of a partition this controller no longer reads is handed back, never applied
    /// (issue 58, seeds 7000529 and 7002198).
    AppliedOnlyWhereRead,
    /// Lease and membership expiry is judged by the reader's monotonic clock since it saw the value
    /// change, never by comparing the writer's wall clock with its own (issue 58).
    OneClock,
    /// The stall look announces a queue whose messages wait with nobody taking them (issue 58, found by the simulation).
    StallLookAnnounces,
    /// A lease or membership is judged by the longer of the reader's lease and the writer's declared one (issue 58, a misconfigured controller).
    DeclaredLeases,
    /// Only what changes a job is its news: a late duplicate neither restarts its stall or abandon
    /// time nor moves its checkpoint's time (issue 58, found by the simulation).
    DuplicatesNotNews,
    /// A job's rows whose ids another job billed first are taken out of its totals (issue 60).
    ClaimsChecked,
    /// A job's own claims, found by a finish tried again (a crash between claiming and the report),
    /// are its own, not duplicates of itself (issue 60).
    OwnClaims,
    /// A partial job's failed chunks keep their blobs through the purge, for a retry (issue 60).
    FailedChunksKept,
}

#[cfg(fleet_undo)]
impl Fix {
    pub const ALL: [Fix; 41] = [
        Fix::QuarantineSecondRead,
        Fix::NewsFromCheckpoint,
        Fix::LostAnswerReadBack,
        Fix::EarlierWriteReadBack,
        Fix::UnpartitionedLookedAtEachTick,
        Fix::BusyStaysDormant,
        Fix::SealAgainstManifest,
        Fix::CountAgainstRecord,
        Fix::UnrecordedQuarantined,
        Fix::DecodeCapFromRecord,
        Fix::HandBackHeld,
        Fix::ForwardDeadLetters,
        Fix::LetGoOfPartitionJobs,
        Fix::HandOverWhenStopped,
        Fix::LiveOwnerNotFree,
        Fix::DropExpiredMembers,
        Fix::StaleStopsReading,
        Fix::HeirWakes,
        Fix::ScanRetried,
        Fix::RescanOnGain,
        Fix::ReportOnce,
        Fix::OwnQueueCompletes,
        Fix::StopAtOnce,
        Fix::PurgeRecorded,
        Fix::OwnersLoadDormant,
        Fix::PartitionFromManifest,
        Fix::WaitingLooks,
        Fix::RoundRetriedSoon,
        Fix::StraysForwarded,
        Fix::RefuseOverBudget,
        Fix::CompleteOnlyWhenCounted,
        Fix::RolesChecked,
        Fix::ChunkTokenChecked,
        Fix::AppliedOnlyWhereRead,
        Fix::OneClock,
        Fix::StallLookAnnounces,
        Fix::DeclaredLeases,
        Fix::DuplicatesNotNews,
        Fix::ClaimsChecked,
        Fix::OwnClaims,
        Fix::FailedChunksKept,
    ];

    /// Its name on the command line (`fleet-sim --undo NAME`).
    pub fn name(self) -> &'static str {
        match self {
            Fix::QuarantineSecondRead => "quarantine-second-read",
            Fix::NewsFromCheckpoint => "news-from-checkpoint",
            Fix::LostAnswerReadBack => "lost-answer-read-back",
            Fix::EarlierWriteReadBack => "earlier-write-read-back",
            Fix::UnpartitionedLookedAtEachTick => "unpartitioned-looked-at-each-tick",
            Fix::BusyStaysDormant => "busy-stays-dormant",
            Fix::SealAgainstManifest => "seal-against-manifest",
            Fix::CountAgainstRecord => "count-against-record",
            Fix::UnrecordedQuarantined => "unrecorded-quarantined",
            Fix::DecodeCapFromRecord => "decode-cap-from-record",
            Fix::HandBackHeld => "hand-back-held",
            Fix::ForwardDeadLetters => "forward-dead-letters",
            Fix::LetGoOfPartitionJobs => "let-go-of-partition-jobs",
            Fix::HandOverWhenStopped => "hand-over-when-stopped",
            Fix::LiveOwnerNotFree => "live-owner-not-free",
            Fix::DropExpiredMembers => "drop-expired-members",
            Fix::StaleStopsReading => "stale-stops-reading",
            Fix::HeirWakes => "heir-wakes",
            Fix::ScanRetried => "scan-retried",
            Fix::RescanOnGain => "rescan-on-gain",
            Fix::ReportOnce => "report-once",
            Fix::OwnQueueCompletes => "own-queue-completes",
            Fix::StopAtOnce => "stop-at-once",
            Fix::PurgeRecorded => "purge-recorded",
            Fix::OwnersLoadDormant => "owners-load-dormant",
            Fix::PartitionFromManifest => "partition-from-manifest",
            Fix::WaitingLooks => "waiting-looks",
            Fix::RoundRetriedSoon => "round-retried-soon",
            Fix::StraysForwarded => "strays-forwarded",
            Fix::RefuseOverBudget => "refuse-over-budget",
            Fix::CompleteOnlyWhenCounted => "complete-only-when-counted",
            Fix::RolesChecked => "roles-checked",
            Fix::ChunkTokenChecked => "chunk-token-checked",
            Fix::AppliedOnlyWhereRead => "applied-only-where-read",
            Fix::OneClock => "one-clock",
            Fix::StallLookAnnounces => "stall-look-announces",
            Fix::DeclaredLeases => "declared-leases",
            Fix::DuplicatesNotNews => "duplicates-not-news",
            Fix::ClaimsChecked => "claims-checked",
            Fix::OwnClaims => "own-claims",
            Fix::FailedChunksKept => "failed-chunks-kept",
        }
    }

    /// What the fix does, in a phrase.
    pub fn describe(self) -> &'static str {
        match self {
            Fix::QuarantineSecondRead => "an unreadable checkpoint read again before quarantine",
            Fix::NewsFromCheckpoint => "a loaded job's news taken from its checkpoint",
            Fix::LostAnswerReadBack => "a lost answer of a conditional write read back",
            Fix::EarlierWriteReadBack => "a checkpoint write of unknown outcome found in place by the next",
            Fix::UnpartitionedLookedAtEachTick => "open jobs scanned each tick while a dormant one names no partition",
            Fix::BusyStaysDormant => "a dormant job whose lease a batch finds busy stays dormant",
            Fix::SealAgainstManifest => "a seal checked against the manifest",
            Fix::CountAgainstRecord => "a result's count checked against its chunk's record",
            Fix::UnrecordedQuarantined => "a message without records quarantined after a bounded wait",
            Fix::DecodeCapFromRecord => "decoding capped by the chunk's record",
            Fix::HandBackHeld => "held messages handed back at once on a stop or a partition given up",
            Fix::ForwardDeadLetters => "dead-lettered work items forwarded to their partition",
            Fix::LetGoOfPartitionJobs => "a partition given up lets go of its jobs (checkpoint, leases back)",
            Fix::HandOverWhenStopped => "a partition handed over only once no longer read",
            Fix::LiveOwnerNotFree => "a live owner's partition never taken as free",
            Fix::DropExpiredMembers => "expired members dropped (their partitions freed)",
            Fix::StaleStopsReading => "a controller whose membership went stale stops reading",
            Fix::HeirWakes => "an heir's listeners look again after a visibility timeout",
            Fix::ScanRetried => "a failed open-jobs scan tried again at the next tick",
            Fix::RescanOnGain => "a gained partition's quiet jobs found at the next tick",
            Fix::ReportOnce => "a finish tried again leaves the report written once",
            Fix::OwnQueueCompletes => "messages of another queue completed on their own queue",
            Fix::StopAtOnce => "partitions to stop all stopped at once",
            Fix::PurgeRecorded => "a finished job's purge recorded before its open marker goes",
            Fix::OwnersLoadDormant => "a dormant job loaded only by its partition's reader",
            Fix::PartitionFromManifest => "a dormant job without a partition takes its manifest's",
            Fix::WaitingLooks => "a waiting job's partition looked at every minute",
            Fix::RoundRetriedSoon => "a failed balancing round tried again within a twelfth of a lease",
            Fix::StraysForwarded => "a message on another partition than its job's forwarded there, never leased",
            Fix::RefuseOverBudget => "a result that could decode past the whole budget refused",
            Fix::CompleteOnlyWhenCounted => "complete only when processed + failed = accepted",
            Fix::RolesChecked => "a message counts only when signed by a role that may send it",
            Fix::ChunkTokenChecked => "a result counts only with its chunk's token",
            Fix::AppliedOnlyWhereRead => "a message of a partition no longer read handed back, never applied",
            Fix::OneClock => "lease and membership expiry judged on the reader's own clock",
            Fix::StallLookAnnounces => "the stall look announces messages nobody takes",
            Fix::DeclaredLeases => "leases and memberships judged by the writer's declared lease when longer",
            Fix::DuplicatesNotNews => "a late duplicate is not a job's news",
            Fix::ClaimsChecked => "a row another job billed first is not billed again",
            Fix::OwnClaims => "a job's own claims found again are its own",
            Fix::FailedChunksKept => "a partial job's failed chunks kept through the purge, for a retry",

        }
    }
}

#[cfg(fleet_undo)]
thread_local! {
    static UNDONE: std::cell::Cell<Option<Fix>> = const { std::cell::Cell::new(None) };
}

/// The fix `CONTROLLER_UNDO` names (by [`Fix::name`]), for the unit tests' run of the harness.
#[cfg(fleet_undo)]
fn from_env() -> Option<Fix> {
    static ENV: std::sync::OnceLock<Option<Fix>> = std::sync::OnceLock::new();
    *ENV.get_or_init(|| std::env::var("CONTROLLER_UNDO").ok().and_then(|n| Fix::ALL.into_iter().find(|f| f.name() == n)))
}

/// Whether `fix` is undone (on this thread, or in the whole process by `CONTROLLER_UNDO`).
#[inline]
pub fn is(fix: Fix) -> bool {
    #[cfg(fleet_undo)]
    {
        UNDONE.with(|u| u.get()).or_else(from_env) == Some(fix)
    }
    #[cfg(not(fleet_undo))]
    {
        let _ = fix;
        false
    }
}

/// Undoes `fix` (or none) on this thread.
#[cfg(fleet_undo)]
pub fn set(fix: Option<Fix>) {
    UNDONE.with(|u| u.set(fix));
}

#[cfg(all(test, not(fleet_undo)))]
mod tests {
    use super::*;

    /// The `controller` package's build (a user's) has no switch: `CONTROLLER_UNDO` is not read.
    #[test]
    fn a_users_build_ignores_controller_undo() {
        std::env::set_var("CONTROLLER_UNDO", "report-once");
        assert!(!is(Fix::ReportOnce));
        assert!(!is(Fix::QuarantineSecondRead));
    }
}
