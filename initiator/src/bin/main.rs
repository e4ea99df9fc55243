//! `initiator`: the CLI. Parses arguments, sets up tracing and clients, calls the library.
//! Exit codes: 0 job complete; 1 usage or input error (nothing enqueued); 2 job finished partial;
//! 3 infrastructure error.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use initiator::submit::{Clients, SubmitOptions};
use initiator::{follow, job_exit_code, CliError};
use shared::billing::Tariff;
use shared::config::{Aws, FleetArgs, LogArgs};

/// Billing fleet initiator: submit transaction files as a job and read jobs back.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Validate FILEs, store them as chunks and enqueue one job.
    Submit(SubmitArgs),
    /// Show a job's progress.
    Status {
        job: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a finished job's report (exit 0 complete, 2 partial).
    Report {
        job: String,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Bill FILEs in this process, without queues or storage (a dry run; the benchmark's baseline).
    Local {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Tariff JSON file overriding the default.
        #[arg(long)]
        tariff: Option<PathBuf>,
        /// Print the report JSON instead of the summary.
        #[arg(long)]
        json: bool,
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
    },
}

#[derive(clap::Args)]
struct SubmitArgs {
    /// CSV files (header row with txn_id, account_id, amount, currency, timestamp); one job for all.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Most transactions per chunk.
    #[arg(long, env = "INITIATOR_CHUNK_SIZE", default_value_t = 5000)]
    chunk_size: u64,
    /// Most uncompressed bytes per chunk.
    #[arg(long, env = "INITIATOR_CHUNK_BYTES", default_value_t = 4 << 20)]
    chunk_bytes: usize,
    /// Follow the job until the controller has finished it, then print the summary.
    #[arg(long)]
    wait: bool,
    /// Print JSON on stdout (the final report with --wait; the submission otherwise).
    #[arg(long)]
    json: bool,
    /// Refuse the whole submission if any row is rejected.
    #[arg(long)]
    strict: bool,
    /// Processing priority of this job's work items (higher first where processors are throttled).
    #[arg(long, env = "INITIATOR_PRIORITY", default_value_t = 0, allow_negative_numbers = true)]
    priority: i32,
    /// Deadline, seconds from now: work items that expire in a processor's buffer after it are
    /// dead-lettered with reason `expired` (the job reports them as failed chunks).
    #[arg(long, env = "INITIATOR_DEADLINE_SECS")]
    deadline_secs: Option<u64>,
    /// Keep each account's transactions in order: accounts are hashed into --groups partitions, each
    /// chunked on its own and sent as one FIFO message group (needs a FIFO work queue, e.g.
    /// --work-queue billing-work.fifo). Processors bill a group's chunks one at a time, in file order.
    #[arg(long, value_enum, env = "INITIATOR_GROUP_BY")]
    group_by: Option<initiator::grouping::GroupBy>,
    /// Number of partitions (message groups) for --group-by: the most chunks processed in parallel.
    #[arg(long, env = "INITIATOR_GROUPS", default_value_t = 16, requires = "group_by", value_parser = clap::value_parser!(u32).range(1..))]
    groups: u32,
    /// Tariff JSON file overriding the default (0.30 + 2.9%, refunds free).
    #[arg(long)]
    tariff: Option<PathBuf>,
    /// Give up waiting after this many seconds.
    #[arg(long, default_value_t = 3600)]
    wait_timeout_secs: u64,
    /// Concurrent chunk uploads.
    #[arg(long, default_value_t = 16)]
    upload_concurrency: usize,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    shared::telemetry::init(cli.log.log_json, "warn");
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let fleet = cli.fleet;
    match cli.command {
        Command::Generate { rows, accounts, seed } => {
            let mut out = std::io::stdout().lock();
            shared::generate::write_csv(&mut out, rows, accounts, seed).map_err(|e| CliError::Input(format!("writing stdout: {e}")))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { job, json } => {
            let aws = Aws::load().await;
            let p = follow::progress(aws.store(&fleet.bucket).as_ref(), &job).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&p).map_err(shared::Error::from)?);
            } else {
                println!("{p}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { job, json } => {
            let aws = Aws::load().await;
            let r = follow::report(aws.store(&fleet.bucket).as_ref(), &job).await?;
            print_report(&r, json)?;
            Ok(job_exit_code(r.status))
        }
        Command::Local { files, tariff, json } => {
            let tariff = load_tariff(tariff.as_ref())?;
            let start = std::time::Instant::now();
            let r = tokio::task::spawn_blocking(move || initiator::local::bill(&files, &tariff))
                .await
                .map_err(|e| CliError::Input(format!("billing task failed: {e}")))??;
            let secs = start.elapsed().as_secs_f64();
            print_report(&r, json)?;
            eprintln!("billed {} transactions in {secs:.3} s in one process", r.transactions.processed);
            Ok(ExitCode::SUCCESS)
        }
        Command::Submit(args) => submit(args, &fleet).await,
    }
}

fn load_tariff(path: Option<&PathBuf>) -> Result<Tariff, CliError> {
    match path {
        Some(p) => Tariff::load(p).map_err(|e| CliError::Input(format!("tariff {e}"))),
        None => Ok(Tariff::default()),
    }
}

fn print_report(r: &shared::report::Report, json: bool) -> Result<(), CliError> {
    if json {
        println!("{}", serde_json::to_string_pretty(r).map_err(shared::Error::from)?);
    } else {
        println!("{}", shared::report::summary(r));
    }
    Ok(())
}

async fn submit(args: SubmitArgs, fleet: &FleetArgs) -> Result<ExitCode, CliError> {
    let tariff = load_tariff(args.tariff.as_ref())?;
    let show = std::io::stderr().is_terminal();
    let aws = Aws::load().await;
    let work = aws.queue(&fleet.work_queue).await?;
    let store = aws.store(&fleet.bucket);
    store.check().await?;
    let results = aws.queue(&fleet.results_queue).await?;
    let clients = Clients { work, results, store: store.clone(), triggers: fleet.trigger_bus() };
    let opts = SubmitOptions {
        chunk_size: args.chunk_size,
        chunk_bytes: args.chunk_bytes,
        strict: args.strict,
        tariff,
        upload_concurrency: args.upload_concurrency,
        progress: show,
        priority: args.priority,
        deadline: args.deadline_secs.map(|s| std::time::SystemTime::now() + std::time::Duration::from_secs(s)),
        grouping: initiator::grouping::Grouping::new(args.group_by, args.groups),
        ..SubmitOptions::new(args.files)
    };
    let s = initiator::submit::submit(opts, &clients).await?;
    eprintln!(
        "job {}: {} rows read, {} accepted, {} rejected; {} chunks enqueued",
        s.job_id, s.counts.submitted, s.counts.accepted, s.counts.rejected, s.total_chunks
    );
    if !args.wait {
        if args.json {
            let v = serde_json::json!({
                "job_id": s.job_id, "chunks": s.total_chunks, "submitted": s.counts.submitted,
                "accepted": s.counts.accepted, "rejected": s.counts.rejected,
            });
            println!("{v}");
        } else {
            println!("{}", s.job_id);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let r = follow::wait(store.as_ref(), &s.job_id, s.total_chunks, Duration::from_secs(args.wait_timeout_secs), show).await?;
    print_report(&r, args.json)?;
    Ok(job_exit_code(r.status))
}
