//! The command line: what each `initiator` command and flag means (clap derive, env fallbacks, doc
//! comments as help). The flows behind the commands are in `commands`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use fleet_io::config::{FleetArgs, LogArgs};

/// Billing fleet initiator: submit transaction files as a job and read jobs back.
#[derive(Parser)]
#[command(
    version,
    after_help = "Exit codes: 0 complete (or done); 1 usage or input error; 2 job partial, abandoned or quarantined; 3 infrastructure (unreachable, credentials, missing queue or bucket); 4 --wait timed out (the job goes on); 130 interrupted (Ctrl-C: a submission is abandoned unless its seal was sent, a wait leaves the job going on)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub fleet: FleetArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

#[derive(Subcommand)]
pub enum Command {
    /// Validate FILEs, store them as chunks and enqueue one job.
    Submit(SubmitArgs),
    /// Show a job's progress.
    Status {
        job: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Follow a job until it finishes, with its progress, then print its summary: the same exit codes
    /// as `submit --wait` (to come back to a job after `--wait` gave up, a Ctrl-C, or from another
    /// terminal).
    Wait {
        job: String,
        /// Give up after this many seconds (exit 4; the job goes on).
        #[arg(long, default_value_t = 3600)]
        timeout_secs: u64,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// List the open jobs (those a controller has begun) and those finished in the last days
    /// (the warehouse's jobs table), newest first.
    Jobs {
        /// Days of finished jobs, today (UTC) included.
        #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u16).range(0..=366))]
        days: u16,
        /// Most jobs listed of each kind.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1000))]
        limit: u64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Bill a finished job's failed chunks again (their blobs are kept 30 days), as a new job that
    /// completes it, with its tariff; follows it to its report. Rows already billed are not billed
    /// again, whatever is run twice.
    Retry {
        job: String,
        /// Delete the job's kept failed chunks instead, their rows left unbilled (the operator's
        /// identity: the submitting role deletes nothing).
        #[arg(long)]
        give_up: bool,
        /// Give up waiting after this many seconds (exit 4; the job goes on).
        #[arg(long, default_value_t = 3600)]
        wait_timeout_secs: u64,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Finish a job that will never seal (its submission died) now, as `abandoned`, with what was
    /// processed; waits for the report unless --no-wait.
    Abandon {
        job: String,
        /// Why (recorded in the report).
        #[arg(long, default_value = "abandoned by an operator")]
        reason: String,
        /// Return once the request is queued instead of waiting for the report.
        #[arg(long)]
        no_wait: bool,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// The dead-letter queues (work, results) and the quarantine of unreadable messages.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// The warehouse's Parquet tables (`tables/v2/accounts`, `tables/v2/jobs`).
    Warehouse {
        #[command(subcommand)]
        command: WarehouseCommand,
    },
    /// Print a finished job's report (exit 0 complete, 2 partial or abandoned).
    Report {
        job: String,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Bill FILEs in this process, without queues or storage (a dry run; the benchmark's baseline).
    Local {
        /// CSV files; `-` reads one from standard input.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Tariff JSON file overriding the default.
        #[arg(long)]
        tariff: Option<PathBuf>,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Create the fleet's queues (each with its dead-letter queue and redrive) and its bucket (with the
    /// lifecycle rules that expire finished jobs' blobs), idempotently: on AWS with an operator's or a
    /// setup job's identity (sqs:CreateQueue, SetQueueAttributes, GetQueueAttributes; s3:CreateBucket,
    /// PutLifecycleConfiguration), which the services' own policies do not grant.
    Provision {
        /// Receives of one message before SQS moves it to the dead-letter queue.
        #[arg(long, env = "FLEET_MAX_RECEIVE_COUNT", default_value_t = 5)]
        max_receive_count: u32,
        /// Seconds a received message stays hidden from other consumers.
        #[arg(long, env = "FLEET_VISIBILITY_TIMEOUT", default_value_t = 30)]
        visibility_timeout: u64,
        /// Print what was provisioned as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script (e.g. `initiator completions bash > /etc/bash_completion.d/initiator`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff) on stdout (e.g. `initiator man > initiator.1; man ./initiator.1`), of
    /// the initiator or of one command (`initiator man submit`, `initiator man dlq redrive`); or write
    /// every page into a directory (`--out-dir`: initiator.1, initiator-submit.1, ...).
    Man {
        /// The command whose page to print.
        command: Vec<String>,
        /// Write every page into this directory instead.
        #[arg(long, conflicts_with = "command")]
        out_dir: Option<PathBuf>,
    },
    /// Write a deterministic sample CSV to stdout.
    Generate {
        /// Number of transactions.
        #[arg(long, default_value_t = 100_000)]
        rows: u64,
        /// Number of distinct accounts.
        #[arg(long, default_value_t = 1000)]
        accounts: u64,
        /// Random seed; the same seed gives the same file.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Take the accounts in turn instead of at random: every account appears once there are at
        /// least as many rows as accounts.
        #[arg(long)]
        every_account: bool,
    },
}

#[derive(Subcommand)]
pub enum DlqCommand {
    /// List what is in both dead-letter queues and the quarantine (messages are looked at, not taken).
    List {
        /// Most entries per place.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Show one entry in full: an SQS message id, or a quarantine key (`quarantine/...`).
    Show { id: String },
    /// Send entries back to be processed again: work dead letters to the work queue, results dead
    /// letters to the results queue, quarantined messages to the queue that reads them.
    Redrive {
        /// Which place to redrive.
        #[arg(long, value_enum, default_value = "all")]
        from: RedriveFrom,
        /// Most messages moved per place (copy only) [default: 1000].
        #[arg(long)]
        limit: Option<usize>,
        /// How a dead-letter queue is moved back: `move-task` (SQS's StartMessageMoveTask: SQS moves
        /// every message back to the queue it came from and the command follows the task to its end),
        /// `copy` (received, sent back with a de-duplication id of its own, deleted; what FIFO queues
        /// and `--limit` need), or `auto`: a move task for a standard queue without `--limit`, else copy.
        #[arg(long, value_enum, default_value = "auto")]
        method: RedriveMethod,
        /// Print the counts moved per place (and each dead-letter queue's method) as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum WarehouseCommand {
    /// Write the tables' objects of jobs finished before the tables existed, from their reports
    /// (`warehouse/{job}/report.json`): each job's object created only if absent, under the day of
    /// its ending, so a rerun (or a job the controller filed meanwhile) writes nothing twice. Safe to
    /// interrupt: a rerun skips what is there. Reads each report whole: `--concurrency` reports of a
    /// million accounts take about 200 MB each.
    Backfill {
        /// Reports read and written at once.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
        concurrency: u16,
        /// Print the counts (written, present, unreadable) as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum RedriveMethod {
    Auto,
    MoveTask,
    Copy,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RedriveFrom {
    WorkDlq,
    ResultsDlq,
    Quarantine,
    All,
}

#[derive(clap::Args)]
pub struct SubmitArgs {
    /// CSV files (header row with txn_id, account_id, amount, currency, timestamp); one job for all.
    /// `-` reads one from standard input (e.g. `zcat day.csv.gz | initiator submit - --stdin-name day.csv`).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The name standard input's rows are reported under (rejected rows' file, the report's files).
    #[arg(long, default_value = "stdin")]
    pub stdin_name: String,
    /// Size of standard input in bytes, when known (as `pv -s`): the progress bar's total, and the
    /// job's size the chunk size is chosen from [default: the file's, when standard input is a file;
    /// otherwise unknown, and the largest chunks are used].
    #[arg(long)]
    pub stdin_size: Option<u64>,
    /// Most transactions per chunk [default: chosen per job, about 16 chunks of 5,000 to 50,000
    /// transactions, from the files' sizes].
    #[arg(long, env = "INITIATOR_CHUNK_SIZE")]
    pub chunk_size: Option<u64>,
    /// Most uncompressed bytes per chunk.
    #[arg(long, env = "INITIATOR_CHUNK_BYTES", default_value_t = 4 << 20)]
    pub chunk_bytes: usize,
    /// Follow the job until the controller has finished it, then print the summary.
    #[arg(long)]
    pub wait: bool,
    /// Print JSON on stdout (the final report with --wait; the submission otherwise).
    #[arg(long)]
    pub json: bool,
    /// Refuse the whole submission if any row is rejected.
    #[arg(long)]
    pub strict: bool,
    /// Processing priority of this job's work items (higher first where processors are throttled).
    #[arg(long, env = "INITIATOR_PRIORITY", default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i32,
    /// Deadline, seconds from now: work items that expire in a processor's buffer after it are
    /// dead-lettered with reason `expired` (the job reports them as failed chunks).
    #[arg(long, env = "INITIATOR_DEADLINE_SECS")]
    pub deadline_secs: Option<u64>,
    /// Keep each account's transactions in order: accounts are hashed into --groups partitions, each
    /// chunked on its own and sent as one FIFO message group (needs a FIFO work queue, e.g.
    /// --work-queue billing-work.fifo). Processors bill a group's chunks one at a time, in file order.
    #[arg(long, value_enum, env = "INITIATOR_GROUP_BY")]
    pub group_by: Option<crate::grouping::GroupBy>,
    /// Number of partitions (message groups) for --group-by: the most chunks processed in parallel.
    #[arg(long, env = "INITIATOR_GROUPS", default_value_t = 16, requires = "group_by", value_parser = clap::value_parser!(u32).range(1..))]
    pub groups: u32,
    /// Tariff JSON file overriding the default (0.30 + 2.9%, refunds free).
    #[arg(long)]
    pub tariff: Option<PathBuf>,
    /// Give up waiting after this many seconds (exit 4; the job goes on).
    #[arg(long, default_value_t = 3600)]
    pub wait_timeout_secs: u64,
    /// Concurrent chunk uploads.
    #[arg(long, default_value_t = 16)]
    pub upload_concurrency: usize,
    /// The finished job this one completes (set by `retry`, not a flag).
    #[arg(skip)]
    pub completes: Option<String>,
}
