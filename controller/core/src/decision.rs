//! How a job ends and what a checkpoint commits: the values a job's transitions and its checkpoint
//! plan (`save`) share (a leaf, so that neither imports the other's file).

use fleet_domain::model::{FailedChunk, JobStatus};

/// How a job ends: its status, the chunks it ends with as failed, its note.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub status: JobStatus,
    pub failed: Vec<FailedChunk>,
    pub note: Option<String>,
    /// When it was decided (RFC 3339, the aggregator's clock): committed with it, so that every
    /// writer of the job's report and warehouse rows dates them alike.
    pub at: String,
}

/// What a checkpoint written commits (see `Job::plan`).
#[derive(Debug)]
pub enum Commit {
    /// The job's progress (its phase unchanged).
    Progress,
    /// Its ending (to `Phase::Ending`).
    Ending(Decision),
    /// Its end, the last checkpoint: the report is written, the rows go (to `Phase::Finished`).
    Final,
    /// Quarantined, its rows kept: its manifest cannot be read (to `Phase::Finished`).
    Quarantined,
}
