//! The initiator: turns transaction CSV files into a job (validated, de-duplicated, split into
//! zstd-compressed chunk blobs on S3 referenced by small work items on SQS), then follows the job to
//! its report. The `initiator` binary is a thin CLI over this library.

pub mod cli;
pub mod commands;
pub mod follow;
pub mod grouping;
pub mod local;
pub mod ops;
pub mod submit;

use std::process::ExitCode;

/// What went wrong, and which exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Usage or input error; nothing was enqueued. Exit 1.
    #[error("{0}")]
    Input(String),
    /// The stack could not be used (unreachable, missing queue or bucket). Exit 3.
    #[error(transparent)]
    Infra(#[from] fleet_io::Error),
    /// A document read from the stack (a checkpoint, a report) failed its checks. Exit 3.
    #[error(transparent)]
    Corrupt(#[from] fleet_domain::Error),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Input(_) => ExitCode::from(1),
            CliError::Infra(_) | CliError::Corrupt(_) => ExitCode::from(3),
        }
    }
}

/// Exit code of a finished job: 0 complete, 2 partial or abandoned.
pub fn job_exit_code(status: fleet_domain::model::JobStatus) -> ExitCode {
    match status {
        fleet_domain::model::JobStatus::Complete => ExitCode::SUCCESS,
        _ => ExitCode::from(2),
    }
}
