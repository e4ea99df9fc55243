//! `initiator`: the CLI. Parses arguments, sets up tracing and clients, calls the library.
//! Exit codes: 0 job complete; 1 usage or input error (nothing enqueued); 2 job finished partial;
//! 3 infrastructure error.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fleet_domain::billing::Tariff;
use fleet_io::config::{Aws, FleetArgs, LogArgs};
use initiator::submit::{Clients, SubmitOptions};
use initiator::{follow, job_exit_code, CliError};

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
    /// Print a finished job's report (exit 0 complete, 2 partial or abandoned).
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
        /// Take the accounts in turn instead of at random: every account appears once there are at
        /// least as many rows as accounts.
        #[arg(long)]
        every_account: bool,
    },
}

#[derive(Subcommand)]
enum DlqCommand {
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
        /// Most messages moved per place.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RedriveFrom {
    WorkDlq,
    ResultsDlq,
    Quarantine,
    All,
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
    fleet_io::telemetry::init(cli.log.log_json, "warn");
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
        Command::Generate { rows, accounts, seed, every_account } => {
            let mut out = std::io::stdout().lock();
            fleet_domain::generate::write_csv(&mut out, rows, accounts, seed, every_account).map_err(|e| CliError::Input(format!("writing stdout: {e}")))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { job, json } => {
            let aws = Aws::load().await.with_policy(fleet.call_policy());
            let p = follow::progress(aws.store(&fleet.bucket).as_ref(), &job).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&p).map_err(fleet_io::Error::from)?);
            } else {
                println!("{p}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { job, json } => {
            let aws = Aws::load().await.with_policy(fleet.call_policy());
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
        Command::Abandon { job, reason, no_wait, json } => {
            let aws = Aws::load().await.with_policy(fleet.call_policy());
            let store = aws.store(&fleet.bucket);
            // Refuses an unknown job (a typo must not create an empty abandoned job).
            let p = follow::progress(store.as_ref(), &job).await?;
            if p.status.is_finished() {
                eprintln!("job {job} already finished ({:?}); nothing abandoned", p.status);
                let r = follow::report(store.as_ref(), &job).await?;
                print_report(&r, json)?;
                return Ok(job_exit_code(r.status));
            }
            let results = aws.queue(&fleet.results_queue).await?;
            let bus = fleet.trigger_bus();
            initiator::ops::abandon(results.as_ref(), bus.as_deref(), &job, &reason).await?;
            if no_wait {
                eprintln!("job {job}: abandon requested");
                return Ok(ExitCode::SUCCESS);
            }
            let r = follow::wait(store.as_ref(), &job, 0, Duration::from_secs(600), false).await?;
            print_report(&r, json)?;
            Ok(job_exit_code(r.status))
        }
        Command::Dlq { command } => dlq(command, &fleet).await,
    }
}

async fn dlq(command: DlqCommand, fleet: &FleetArgs) -> Result<ExitCode, CliError> {
    use fleet_io::queue::Queue;
    let aws = Aws::load().await.with_policy(fleet.call_policy());
    let store = aws.store(&fleet.bucket);
    let work_dlq = aws.queue(&fleet.work_dlq()).await?;
    let results_dlq = aws.queue(&fleet.results_dlq()).await?;
    let dlqs: [&dyn Queue; 2] = [work_dlq.as_ref(), results_dlq.as_ref()];
    match command {
        DlqCommand::List { limit, json } => {
            let entries = initiator::ops::list(&dlqs, store.as_ref(), limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&entries).map_err(fleet_io::Error::from)?);
            } else {
                println!("{:<22} {:<40} {:>8} {:<38} {:>6}  reason", "place", "id", "receives", "job", "chunk");
                for e in &entries {
                    let job = e.job_id.as_deref().unwrap_or("-");
                    let chunk = e.chunk.map_or("-".to_string(), |c| c.to_string());
                    println!("{:<22} {:<40} {:>8} {:<38} {:>6}  {}", e.place, e.id, e.receive_count, job, chunk, e.reason.as_deref().unwrap_or("-"));
                }
                eprintln!("{} entries", entries.len());
            }
        }
        DlqCommand::Show { id } => {
            let e = initiator::ops::show(&dlqs, store.as_ref(), &id).await?;
            println!("{}", serde_json::to_string_pretty(&e).map_err(fleet_io::Error::from)?);
        }
        DlqCommand::Redrive { from, limit } => {
            let work = aws.queue(&fleet.work_queue).await?;
            let results = aws.queue(&fleet.results_queue).await?;
            let all = from == RedriveFrom::All;
            if all || from == RedriveFrom::WorkDlq {
                let n = initiator::ops::redrive_queue(work_dlq.as_ref(), work.as_ref(), limit).await?;
                eprintln!("{n} messages moved from {} to {}", work_dlq.name(), work.name());
            }
            if all || from == RedriveFrom::ResultsDlq {
                let n = initiator::ops::redrive_queue(results_dlq.as_ref(), results.as_ref(), limit).await?;
                eprintln!("{n} messages moved from {} to {}", results_dlq.name(), results.name());
            }
            if all || from == RedriveFrom::Quarantine {
                // Quarantined from a queue: back to the queue whose consumer reads it (a dead letter
                // goes to its source queue).
                let targets: [(&str, &dyn Queue); 4] = [
                    (work.name(), work.as_ref()),
                    (work_dlq.name(), work.as_ref()),
                    (results.name(), results.as_ref()),
                    (results_dlq.name(), results.as_ref()),
                ];
                let n = initiator::ops::redrive_quarantine(store.as_ref(), &targets, limit).await?;
                eprintln!("{n} quarantined messages sent back");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn load_tariff(path: Option<&PathBuf>) -> Result<Tariff, CliError> {
    match path {
        Some(p) => Tariff::load(p).map_err(|e| CliError::Input(format!("tariff {e}"))),
        None => Ok(Tariff::default()),
    }
}

fn print_report(r: &fleet_domain::report::Report, json: bool) -> Result<(), CliError> {
    if json {
        println!("{}", serde_json::to_string_pretty(r).map_err(fleet_io::Error::from)?);
    } else {
        println!("{}", fleet_domain::report::summary(r));
    }
    Ok(())
}

async fn submit(args: SubmitArgs, fleet: &FleetArgs) -> Result<ExitCode, CliError> {
    let tariff = load_tariff(args.tariff.as_ref())?;
    let show = std::io::stderr().is_terminal();
    let aws = Aws::load().await.with_policy(fleet.call_policy());
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
