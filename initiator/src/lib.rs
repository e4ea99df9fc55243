//! The initiator: turns transaction CSV files into a job (validated, de-duplicated, split into
//! zstd-compressed chunk blobs on S3 referenced by small work items on SQS), then follows the job to
//! its report. The `initiator` binary is a thin CLI over this library.

pub mod cli;
pub mod commands;
pub mod follow;
pub mod grouping;
pub mod interrupt;
pub mod jobs;
pub mod local;
pub mod ops;
pub mod retry;
pub mod submit;
pub mod warehouse;

use std::process::ExitCode;
use std::time::Duration;

/// The exit codes, one meaning each (documented in the README's *Exit codes* and `initiator --help`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// The command did what it was asked; a job it waited for or read ended `complete`.
    Complete = 0,
    /// Usage or input: a bad flag, a missing or unreadable file, a bad row under `--strict`, a bad
    /// tariff, an unknown job. Found before anything is sent, unless the message says otherwise.
    Input = 1,
    /// The job ended `partial`, `abandoned` or `quarantined`.
    Unfinished = 2,
    /// Infrastructure: SQS, S3 or RabbitMQ unreachable or refusing, missing credentials or region, a
    /// missing queue or bucket, a document that failed its checks.
    Infra = 3,
    /// `--wait` gave up before the job finished (it goes on; follow it with `initiator wait`).
    WaitTimedOut = 4,
    /// Interrupted (Ctrl-C): a submission's job was abandoned if its seal's send had not begun, and
    /// goes on otherwise (see [`interrupt`]); a waited-for job goes on (128 + SIGINT, as a shell
    /// reports it).
    Interrupted = 130,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        ExitCode::from(e as u8)
    }
}

/// What went wrong, and which exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Usage or input error. Exit 1.
    #[error("{0}")]
    Input(String),
    /// The stack could not be used (unreachable, missing queue or bucket). Exit 3.
    #[error("{}", infra_line(.0))]
    Infra(#[from] fleet_io::Error),
    /// A document read from the stack (a checkpoint, a report) failed its checks. Exit 3.
    #[error(transparent)]
    Corrupt(#[from] fleet_domain::Error),
    /// `--wait` gave up; the job goes on. Exit 4.
    #[error("job {job_id} not finished after {} s; it goes on: follow it with `initiator wait {job_id}` (is a controller running?)", .after.as_secs())]
    WaitTimedOut { job_id: String, after: Duration },
    /// A submission failed after some of its work items were enqueued: says how many and what became
    /// of the job. Exit code of the cause.
    #[error("{cause}; job {job_id} had {enqueued} work item(s) enqueued before this, {fate}")]
    Enqueued { job_id: String, enqueued: u64, fate: String, cause: Box<CliError> },
}

/// An infrastructure error as one line that says what to do about it.
fn infra_line(e: &fleet_io::Error) -> String {
    match e {
        fleet_io::Error::Unreachable { .. } | fleet_io::Error::Timeout { .. } => {
            format!("{e}: is the stack running? Set AWS_ENDPOINT_URL to where it answers (LocalStack: http://localhost:4566), or unset it for AWS")
        }
        e => e.to_string(),
    }
}

impl CliError {
    pub fn exit(&self) -> Exit {
        match self {
            CliError::Input(_) => Exit::Input,
            CliError::Infra(_) | CliError::Corrupt(_) => Exit::Infra,
            CliError::WaitTimedOut { .. } => Exit::WaitTimedOut,
            CliError::Enqueued { cause, .. } => cause.exit(),
        }
    }

    pub fn exit_code(&self) -> ExitCode {
        self.exit().into()
    }
}

/// Exit code of a finished job: 0 complete, 2 partial or abandoned.
pub fn job_exit_code(status: fleet_domain::model::JobStatus) -> ExitCode {
    match status {
        fleet_domain::model::JobStatus::Complete => Exit::Complete.into(),
        _ => Exit::Unfinished.into(),
    }
}
