//! The initiator's commands as flows over the library: submit (and follow), status, report, local,
//! abandon, generate, provision, the dead-letter commands, completions and the man page. Every
//! command checks what it can locally (files, flags, tariff, job id) before it contacts anything,
//! then checks the AWS settings (region, credentials) and reaches the stack within
//! [`REACH_WITHIN`] before its real calls. Exit codes: [`crate::Exit`].
//!
//! Why one file of ~480 lines: each command is a short flow over the library (`submit`, `retry`,
//! `follow`, `jobs`, `ops`, ...), and they share the same few steps (reach the stack, follow a job,
//! print a report, map its status to an exit code); the logic lives in those modules, not here.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use fleet_domain::billing::Tariff;
use fleet_io::call::CallPolicy;
use fleet_io::config::{Aws, FleetArgs};
use fleet_io::provision::QueueSettings;

use crate::cli::{Cli, Command, DlqCommand, RedriveFrom, RedriveMethod, SubmitArgs, WarehouseCommand};
use crate::interrupt::{OnInterrupt, Submission};
use crate::submit::{Clients, SubmitOptions};
use crate::Exit;
use crate::{follow, job_exit_code, CliError};

/// How long an interactive command gives the stack to answer its first call before it says it cannot
/// be reached (later calls have the full `--call-deadline`).
pub const REACH_WITHIN: Duration = Duration::from_secs(2);

/// The AWS settings, checked (region, credentials), with every call bounded by the fleet's policy.
async fn aws(fleet: &FleetArgs) -> Result<Aws, CliError> {
    let aws = Aws::load().await;
    aws.check_identity(REACH_WITHIN).await?;
    Ok(aws.with_policy(fleet.call_policy()))
}

/// The bound on a command's first call, retries included: an unreachable endpoint is said at once,
/// not after the call deadline's retries.
fn quick() -> CallPolicy {
    CallPolicy { attempt_timeout: REACH_WITHIN, deadline: REACH_WITHIN, ..CallPolicy::default() }
}

/// The bucket, reached quickly first.
async fn store(aws: &Aws, fleet: &FleetArgs) -> Result<std::sync::Arc<fleet_io::blob::S3Store>, CliError> {
    aws.clone().with_policy(quick()).store(&fleet.bucket).check().await?;
    Ok(aws.store(&fleet.bucket))
}

/// Runs one command; the exit code says how the job (if any) ended.
pub async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let fleet = cli.fleet;
    match cli.command {
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "initiator", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Command::Man { command, out_dir } => {
            man(&command, out_dir.as_deref())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Wait { job, timeout_secs, json } => {
            follow::checked(&job)?;
            let aws = aws(&fleet).await?;
            let store = store(&aws, &fleet).await?;
            // An unknown job is said at once (exit 1), not waited for.
            let p = follow::progress(store.as_ref(), &job).await?;
            let show = std::io::stderr().is_terminal();
            let wait = follow::wait(store.as_ref(), &job, p.total_chunks.unwrap_or(0), Duration::from_secs(timeout_secs), show);
            let Some(r) = until_interrupted(wait).await? else {
                eprintln!("interrupted: job {job} goes on; `initiator wait {job}` follows it again");
                return Ok(Exit::Interrupted.into());
            };
            print_report(&r, json)?;
            Ok(job_exit_code(r.status))
        }
        Command::Jobs { days, limit, json } => {
            let aws = aws(&fleet).await?;
            let store = store(&aws, &fleet).await?;
            let l = crate::jobs::list(store.as_ref(), time::OffsetDateTime::now_utc().date(), days, limit as usize).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&l).map_err(fleet_io::Error::from)?);
            } else {
                println!("{l}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Generate { rows, accounts, seed, every_account } => {
            let mut out = std::io::stdout().lock();
            fleet_domain::generate::write_csv(&mut out, rows, accounts, seed, every_account).map_err(|e| CliError::Input(format!("writing stdout: {e}")))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { job, json } => {
            follow::checked(&job)?;
            let aws = aws(&fleet).await?;
            let p = follow::progress(store(&aws, &fleet).await?.as_ref(), &job).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&p).map_err(fleet_io::Error::from)?);
            } else {
                println!("{p}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { job, json } => {
            follow::checked(&job)?;
            let aws = aws(&fleet).await?;
            let r = follow::report(store(&aws, &fleet).await?.as_ref(), &job).await?;
            print_report(&r, json)?;
            Ok(job_exit_code(r.status))
        }
        Command::Local { files, tariff, json } => {
            let tariff = load_tariff(tariff.as_ref())?;
            let start = std::time::Instant::now();
            let r = tokio::task::spawn_blocking(move || crate::local::bill(&files, &tariff))
                .await
                .map_err(|e| CliError::Input(format!("billing task failed: {e}")))??;
            let secs = start.elapsed().as_secs_f64();
            print_report(&r, json)?;
            eprintln!("billed {} transactions in {secs:.3} s in one process", r.transactions.processed);
            Ok(ExitCode::SUCCESS)
        }
        Command::Submit(args) => {
            // Everything local first: nothing is contacted for a submission that cannot go.
            let tariff = load_tariff(args.tariff.as_ref())?;
            submit(args, tariff, &fleet).await
        }
        Command::Retry { job, give_up, wait_timeout_secs, json } => {
            let aws = aws(&fleet).await?;
            let store = store(&aws, &fleet).await?;
            if give_up {
                let chunks = crate::retry::give_up(store.as_ref(), &job).await?;
                eprintln!("job {job}: failed chunks {chunks:?} given up: their blobs are deleted, their rows not billed");
                return Ok(ExitCode::SUCCESS);
            }
            let dir = tempfile::tempdir().map_err(|e| CliError::Input(format!("a temporary directory: {e}")))?;
            let p = crate::retry::prepare(store.as_ref(), &job, dir.path()).await?;
            for u in &p.unreadable {
                eprintln!("job {job}: {u}");
            }
            if p.files.is_empty() {
                return Err(CliError::Input(format!("job {job}: none of its kept chunks can be read; nothing submitted")));
            }
            eprintln!("job {job}: billing its failed chunks {:?} again, as a new job that completes it", p.chunks);
            // Its rows reported under the chunk files' own names (`JOB-chunk-NNNNNN.csv`), not a
            // temporary directory's: read from there.
            std::env::set_current_dir(dir.path()).map_err(|e| CliError::Input(format!("{}: {e}", dir.path().display())))?;
            let files = p.files.iter().map(|f| f.file_name().map(PathBuf::from).unwrap_or_else(|| f.clone())).collect();
            let unreadable = p.unreadable.len();
            let args = SubmitArgs {
                files,
                stdin_name: "stdin".into(),
                stdin_size: None,
                chunk_size: None,
                chunk_bytes: 4 << 20,
                wait: true,
                json,
                strict: false,
                priority: 0,
                deadline_secs: None,
                group_by: None,
                groups: 16,
                tariff: None,
                wait_timeout_secs,
                upload_concurrency: 16,
                completes: Some(job.clone()),
            };
            // Billed with the job's own tariff, as read from the bucket.
            let code = submit(args, p.tariff, &fleet).await?;
            if unreadable > 0 && code == ExitCode::SUCCESS {
                eprintln!("job {job}: {unreadable} kept chunk(s) could not be billed (above): exit 2");
                return Ok(job_exit_code(fleet_domain::model::JobStatus::Partial));
            }
            Ok(code)
        }
        Command::Abandon { job, reason, no_wait, json } => {
            follow::checked(&job)?;
            let aws = aws(&fleet).await?;
            let store = store(&aws, &fleet).await?;
            // Refuses an unknown job (a typo must not create an empty abandoned job).
            let p = follow::progress(store.as_ref(), &job).await?;
            if p.status.is_finished() {
                eprintln!("job {job} already finished ({:?}); nothing abandoned", p.status);
                let r = follow::report(store.as_ref(), &job).await?;
                print_report(&r, json)?;
                return Ok(job_exit_code(r.status));
            }
            let (results, _) = aws.results_queues(&fleet, quick()).await?;
            let bus = fleet.trigger_bus();
            // The job's own partition, when its manifest is written (a job keeps its partition when
            // the count changes).
            let partition = match fleet_io::blob::BlobStore::get(store.as_ref(), &fleet_domain::layout::manifest_key(&job)).await? {
                Some(body) => serde_json::from_slice::<fleet_domain::model::Manifest>(&body).ok().map(|m| m.partition),
                None => None,
            };
            // Signed with this process's key: an operator's (a submitter's counts too).
            crate::ops::abandon(&results, bus.as_deref(), &job, &reason, partition, fleet.signing_key.as_ref()).await?;
            if no_wait {
                eprintln!("job {job}: abandon requested");
                if json {
                    println!("{}", serde_json::json!({ "job_id": job, "abandon_requested": true }));
                }
                return Ok(ExitCode::SUCCESS);
            }
            let r = follow::wait(store.as_ref(), &job, 0, Duration::from_secs(600), false).await?;
            print_report(&r, json)?;
            Ok(job_exit_code(r.status))
        }
        Command::Dlq { command } => dlq(command, &fleet).await,
        Command::Warehouse { command: WarehouseCommand::Backfill { concurrency, json } } => {
            let aws = aws(&fleet).await?;
            let store = store(&aws, &fleet).await?;
            let done = crate::warehouse::backfill(store.as_ref(), usize::from(concurrency), true).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&done).map_err(fleet_io::Error::from)?);
            } else {
                println!("{done}");
            }
            Ok(if done.unreadable.is_empty() { ExitCode::SUCCESS } else { Exit::Input.into() })
        }
        Command::Provision { max_receive_count, visibility_timeout, json } => {
            if max_receive_count == 0 {
                return Err(CliError::Input("--max-receive-count must be at least 1".into()));
            }
            let aws = aws(&fleet).await?;
            // Reached quickly (a missing bucket answers too: it is what this creates).
            match aws.clone().with_policy(quick()).store(&fleet.bucket).check().await {
                Ok(()) | Err(fleet_io::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            let settings = QueueSettings { max_receive_count, visibility_timeout: Duration::from_secs(visibility_timeout) };
            fleet_io::provision::ensure_fleet(&aws, &fleet, settings).await?;
            let shards: Vec<(String, String)> = fleet.work_shard_names().into_iter().chain(fleet.results_partition_names()).collect();
            let all: Vec<String> = shards.iter().map(|(q, dlq)| format!("{q} (dead letters: {dlq})")).collect();
            eprintln!("provisioned: queues {}, bucket {} with its lifecycle rules", all.join(", "), fleet.bucket);
            if json {
                let queues: Vec<serde_json::Value> = shards.iter().map(|(q, dlq)| serde_json::json!({ "name": q, "dead_letter": dlq })).collect();
                let v = serde_json::json!({
                    "queues": queues,
                    "bucket": fleet.bucket,
                    "max_receive_count": max_receive_count,
                    "visibility_timeout_secs": visibility_timeout,
                });
                println!("{v}");
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn dlq(command: DlqCommand, fleet: &FleetArgs) -> Result<ExitCode, CliError> {
    use fleet_io::queue::Queue;
    let aws = aws(fleet).await?;
    // Each shard of the work queue with its own dead-letter queue (one pair unless --work-shards).
    let shards = aws.work_shards(fleet, quick()).await?;
    let store = aws.store(&fleet.bucket);
    // Each partition of the results queue with its own dead-letter queue (one pair unless
    // --results-partitions).
    let parts = aws.open_results_partitions(fleet, quick()).await?;
    let dlqs: Vec<&dyn Queue> = shards.iter().chain(&parts).map(|(_, d)| d.as_ref() as &dyn Queue).collect();
    match command {
        DlqCommand::List { limit, json } => {
            let entries = crate::ops::list(&dlqs, store.as_ref(), limit).await?;
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
            let e = crate::ops::show(&dlqs, store.as_ref(), &id).await?;
            println!("{}", serde_json::to_string_pretty(&e).map_err(fleet_io::Error::from)?);
        }
        DlqCommand::Redrive { from, limit, method, json } => {
            let all = from == RedriveFrom::All;
            let mut moved = serde_json::Map::new();
            let mut methods = serde_json::Map::new();
            // Every shard's dead letters go back to that shard (a FIFO group stays where it was), every
            // partition's to that partition (its jobs' owner reads it).
            let pairs = shards
                .iter()
                .map(|(work, dlq)| ("work_dlq", all || from == RedriveFrom::WorkDlq, dlq, work))
                .chain(parts.iter().map(|(results, dlq)| ("results_dlq", all || from == RedriveFrom::ResultsDlq, dlq, results)));
            for (place, wanted, dlq, target) in pairs {
                if !wanted {
                    continue;
                }
                let how = crate::ops::redrive_method(method, dlq.name(), limit)?;
                let n = match how {
                    RedriveMethod::MoveTask => crate::ops::move_back(dlq, target, Duration::from_secs(600)).await?,
                    _ => crate::ops::redrive_queue(dlq.as_ref(), target.as_ref(), limit.unwrap_or(crate::ops::REDRIVE_LIMIT)).await?,
                };
                let how = if how == RedriveMethod::MoveTask { "move-task" } else { "copy" };
                eprintln!("{n} messages moved from {} to {} ({how})", dlq.name(), target.name());
                let so_far = moved.get(place).and_then(serde_json::Value::as_u64).unwrap_or(0);
                moved.insert(place.into(), (so_far + n as u64).into());
                methods.insert(place.into(), how.into());
            }
            let limit = limit.unwrap_or(crate::ops::REDRIVE_LIMIT);
            if all || from == RedriveFrom::Quarantine {
                // Quarantined from a queue: back to the queue whose consumer reads it (a dead letter
                // goes to its source queue).
                let mut targets: Vec<(&str, &dyn Queue)> = Vec::new();
                for (work, dlq) in &shards {
                    targets.push((work.name(), work.as_ref()));
                    targets.push((dlq.name(), work.as_ref()));
                }
                for (results, dlq) in &parts {
                    targets.push((results.name(), results.as_ref()));
                    targets.push((dlq.name(), results.as_ref()));
                }
                let n = crate::ops::redrive_quarantine(store.as_ref(), &targets, limit).await?;
                eprintln!("{n} quarantined messages sent back");
                moved.insert("quarantine".into(), n.into());
            }
            if json {
                if !methods.is_empty() {
                    moved.insert("method".into(), serde_json::Value::Object(methods));
                }
                println!("{}", serde_json::Value::Object(moved));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `f`'s outcome, or `None` when the user interrupts it (Ctrl-C, SIGINT) first; `f` is dropped then.
/// The handler is installed before `f` starts, so an early Ctrl-C is not the default (a kill).
async fn until_interrupted<T>(f: impl std::future::Future<Output = Result<T, CliError>>) -> Result<Option<T>, CliError> {
    #[cfg(unix)]
    let mut interrupt =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(|e| CliError::Input(format!("Ctrl-C handler: {e}")))?;
    #[cfg(unix)]
    let interrupted = interrupt.recv();
    #[cfg(not(unix))]
    let interrupted = tokio::signal::ctrl_c();
    tokio::select! {
        r = f => r.map(Some),
        _ = interrupted => Ok(None),
    }
}

/// The man pages: the initiator's, or one command's, on stdout; or all of them into `out_dir`.
fn man(command: &[String], out_dir: Option<&std::path::Path>) -> Result<(), CliError> {
    let root = <Cli as clap::CommandFactory>::command();
    let write = |e: std::io::Error, what: &str| CliError::Input(format!("writing {what}: {e}"));
    if let Some(dir) = out_dir {
        let mut pages = Vec::new();
        man_pages(root, "initiator", &mut pages);
        std::fs::create_dir_all(dir).map_err(|e| write(e, &dir.display().to_string()))?;
        for (name, cmd) in &pages {
            let path = dir.join(format!("{name}.1"));
            let mut out = std::fs::File::create(&path).map_err(|e| write(e, &path.display().to_string()))?;
            clap_mangen::Man::new(cmd.clone()).render(&mut out).map_err(|e| write(e, &path.display().to_string()))?;
        }
        eprintln!("{} man pages written to {}", pages.len(), dir.display());
        return Ok(());
    }
    let mut cmd = root;
    let mut name = "initiator".to_string();
    for word in command {
        let Some(sub) = cmd.find_subcommand(word).cloned() else {
            return Err(CliError::Input(format!("no command `{word}` in `{}`", name.replace('-', " "))));
        };
        name = format!("{name}-{word}");
        cmd = sub.name(leaked(&name));
    }
    clap_mangen::Man::new(cmd).render(&mut std::io::stdout()).map_err(|e| write(e, "stdout"))
}

/// A page's name for clap, which keeps `'static` names: a few short strings, once per run.
fn leaked(name: &str) -> &'static str {
    Box::leak(name.to_string().into_boxed_str())
}

/// Every page of `cmd` and its commands, each named `initiator-sub-subsub`.
fn man_pages(cmd: clap::Command, name: &str, pages: &mut Vec<(String, clap::Command)>) {
    let cmd = cmd.name(leaked(name));
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            man_pages(sub.clone(), &format!("{name}-{}", sub.get_name()), pages);
        }
    }
    pages.push((name.to_string(), cmd));
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

async fn submit(args: SubmitArgs, tariff: Tariff, fleet: &FleetArgs) -> Result<ExitCode, CliError> {
    // Everything local first: nothing is contacted for a submission that cannot go.
    let grouping = crate::grouping::Grouping::new(args.group_by, args.groups);
    let stdin = crate::submit::Stdin { name: args.stdin_name.clone(), size: args.stdin_size };
    let inputs = crate::submit::preflight(&args.files, &stdin, args.chunk_size, grouping, &fleet.work_queue)?;
    let chunk_size = args.chunk_size.unwrap_or_else(|| crate::submit::auto_chunk_size(&inputs));
    let show = std::io::stderr().is_terminal();
    let aws = aws(fleet).await?;
    // The work queue, or its shards as one queue (work items spread over them).
    let (work, _) = aws.work_queues(fleet, quick()).await?;
    let store = aws.store(&fleet.bucket);
    store.check().await?;
    // The results queue, or its partitions as one queue (each job's seal goes to its own).
    let (results, _) = aws.results_queues(fleet, quick()).await?;
    let clients = Clients { work, results, store: store.clone(), triggers: fleet.trigger_bus(), signing_key: fleet.signing_key.clone() };
    // The job's id is chosen here, so that a Ctrl-C can abandon it; and the submission's phase is
    // shared, so that a Ctrl-C once the seal's send has begun leaves the job to finish instead.
    let job_id = fleet_domain::layout::new_job_id();
    let submission = Submission::default();
    let opts = SubmitOptions {
        job_id: Some(job_id.clone()),
        submission: submission.clone(),
        chunk_size,
        chunk_bytes: args.chunk_bytes,
        strict: args.strict,
        tariff,
        upload_concurrency: args.upload_concurrency,
        progress: show,
        priority: args.priority,
        deadline: args.deadline_secs.map(|s| std::time::SystemTime::now() + std::time::Duration::from_secs(s)),
        grouping,
        stdin,
        completes: args.completes.clone(),
        ..SubmitOptions::new(args.files)
    };
    let Some(s) = until_interrupted(crate::submit::submit_inputs(opts, inputs, &clients)).await? else {
        // Once the seal's send has begun the job is whole and finishes on its own: no `Abandon`, a line
        // that says so and how to follow it, exit 130 all the same.
        if let OnInterrupt::GoesOn { line } = submission.on_interrupt(&job_id) {
            eprintln!("{line}");
            return Ok(Exit::Interrupted.into());
        }
        // Before it, whatever was enqueued is billed and reported as `abandoned`: the job does not
        // wait, unsealed, for --abandon-after.
        let reason = "submission interrupted (Ctrl-C)";
        match crate::ops::abandon(&clients.results, clients.triggers.as_deref(), &job_id, reason, None, clients.signing_key.as_ref()).await {
            Ok(()) => {
                eprintln!(
                    "interrupted: job {job_id} abandoned; the controller finishes it as `abandoned` with what was billed (`initiator wait {job_id}`); \
                 rerun the same command to bill the rest: rows already billed are not billed again"
                )
            }
            Err(e) => eprintln!("interrupted: abandoning job {job_id} failed ({e}): run `initiator abandon {job_id}`"),
        }
        return Ok(Exit::Interrupted.into());
    };
    eprintln!(
        "job {}: {} rows read, {} accepted, {} rejected; {} chunks of up to {chunk_size} transactions enqueued",
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
    let wait = follow::wait(store.as_ref(), &s.job_id, s.total_chunks, Duration::from_secs(args.wait_timeout_secs), show);
    let Some(r) = until_interrupted(wait).await? else {
        eprintln!("interrupted: job {} goes on; `initiator wait {}` follows it again", s.job_id, s.job_id);
        return Ok(Exit::Interrupted.into());
    };
    print_report(&r, args.json)?;
    Ok(job_exit_code(r.status))
}
