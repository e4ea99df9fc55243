//! Container tests on the real Docker Engine: the fleet as a user runs it, through `deploy/compose.sh`
//! and `deploy/docker-compose.yml` (LocalStack, RabbitMQ, processor, controller and scaling agent each a
//! container, the initiator a one-off container), with images built by `deploy/images.sh` from nothing.
//!
//! Run by `deploy/test.sh` (README's test command, and so CI). A custom harness (libtest-mimic): the
//! scenarios run one at a time (one fleet on two cores) and the images they built from nothing are
//! removed at the end (`FLEET_TEST_KEEP_IMAGES=1` keeps them). Every scenario has its own compose
//! project and free host ports, and ends with `down` leaving nothing of the project behind. Where no
//! Docker Engine answers, every scenario fails and says so: none passes without running. The fleet
//! image is made of the binaries this test build made (`FLEET_BINARIES`), so the suite compiles them
//! once, in the test build's profile; a user's `compose.sh up` builds them with `--release`.

use std::collections::HashMap;
use std::io::Read;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::Value;

// Under tests/compose/: not a test target of its own.
#[path = "compose/alert_metrics.rs"]
mod alert_metrics;

/// Images of these tests, apart from a user's (`billing-fleet/...`).
const PREFIX: &str = "billing-fleet-test";
const MILLION: u64 = 1_000_000;

fn repo() -> PathBuf {
    // deploy/e2e -> the repository root.
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).unwrap().to_path_buf()
}

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let trials = vec![
        trial("images_from_nothing_compose_up_submit_errors_and_down", images_from_nothing),
        // These six share one fleet, in this order (the broker's stop last).
        shared("million_transactions_through_compose_match_initiator_local", million_matches_local),
        shared("processor_container_killed_mid_job_totals_exact", processor_killed_mid_job),
        shared("compose_stop_processor_drains_and_loses_nothing", stop_processor_drains),
        shared("controller_container_restarted_mid_job_totals_exact", controller_restarted_mid_job),
        shared("two_controller_replicas_rolling_restart_mid_job_totals_exact", controllers_rolling_restart),
        shared("rabbitmq_container_stopped_mid_job_job_completes", rabbitmq_stopped_mid_job),
        trial("agent_scales_processor_containers_up_and_back_totals_exact", agent_scales_containers),
        // Without Docker: the alert rules' metric names as the agent scenario reads them.
        Trial::test(NO_DOCKER_TRIAL, || std::panic::catch_unwind(rules_metric_names).map_err(|p| Failed::from(panic_text(&*p)))),
    ];
    let ran_any = trials.iter().filter(|t| t.name() != NO_DOCKER_TRIAL).any(|t| args.filter.as_deref().is_none_or(|f| t.name().contains(f))) && !args.list;
    let conclusion = libtest_mimic::run(&args, trials);
    // A shared fleet the last of its scenarios did not bring down (a filter left that one out).
    drop(SHARED.lock().unwrap_or_else(|e| e.into_inner()).take());
    if ran_any && std::env::var_os("FLEET_TEST_KEEP_IMAGES").is_none() && docker_ok().is_ok() {
        let out = sh(Command::new(repo().join("deploy/images.sh")).arg("--remove").env("FLEET_IMAGE_PREFIX", PREFIX));
        if !out.status.success() {
            eprintln!("removing the test images failed: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    conclusion.exit_code()
}

/// The one trial that needs no Docker Engine (and builds no image).
const NO_DOCKER_TRIAL: &str = "compose::rules::alert_rules_metric_names_extracted";

/// The alert rules of deploy/prometheus/alerts.yml and the metric names each selects.
fn alert_rules() -> Vec<(String, std::collections::BTreeSet<String>)> {
    let rules = std::fs::read_to_string(repo().join("deploy/prometheus/alerts.yml")).expect("deploy/prometheus/alerts.yml");
    alert_metrics::alert_metric_names(&rules)
}

/// The extractor on known shapes, and on the rules: every alert selects some metric, and the ones
/// [`Fleet::metrics_name_every_alerts_metric`] looks for are these.
fn rules_metric_names() {
    alert_metrics::self_check();
    let rules = alert_rules();
    assert!(rules.len() >= 10, "alerts.yml: {rules:?}");
    let all: std::collections::BTreeSet<&str> = rules.iter().flat_map(|(_, n)| n.iter().map(String::as_str)).collect();
    for name in ["fleet_build_info", "listener_received_total", "controller_jobs_finished_total", "agent_oldest_age_seconds", "listener_breaker_open"] {
        assert!(all.contains(name), "{name} not found in the rules: {all:?}");
    }
    println!("alerts.yml selects: {}", all.iter().copied().collect::<Vec<_>>().join(" "));
}

/// Metric names of alerts.yml that a running fleet's scrape need not show, each with why: none of them
/// is a misspelling the compose test would otherwise catch.
const MAY_BE_ABSENT: &[(&str, &str)] = &[
    // Made by Prometheus for every target, not served by any.
    ("up", "Prometheus's own per target"),
    // Per queue: made at a controller's first quarantined message (controller/tests/metrics.rs sees it).
    ("controller_messages_quarantined_total", "appears at the first quarantined message"),
    // Left out while nothing waits (never -1); scaling-agent/src/tests.rs sees it with work waiting.
    ("agent_oldest_age_seconds", "absent while no work item waits"),
];

fn trial(name: &'static str, f: impl FnOnce() + Send + 'static) -> Trial {
    Trial::test(format!("compose::{name}"), move || {
        docker_ok().map_err(Failed::from)?;
        std::panic::catch_unwind(AssertUnwindSafe(f)).map_err(|p| Failed::from(panic_text(&*p)))
    })
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// The fleet the fault scenarios share: one `up` (three processor containers, the agent deciding only)
/// instead of one each. Each scenario checks what it needs of it first (processor count, one
/// controller); one that fails brings the fleet down (its logs printed) and the next starts another.
static SHARED: Mutex<Option<Fleet>> = Mutex::new(None);

fn shared(name: &'static str, f: fn(&mut Fleet)) -> Trial {
    trial(name, move || {
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        let fleet = slot.get_or_insert_with(|| Fleet::up_with("shared", 3, AGENT_DECIDES_ONLY));
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(fleet)));
        match result {
            Ok(()) if fleet.down => *slot = None,
            Ok(()) => {}
            Err(p) => {
                if let Some(mut fleet) = slot.take() {
                    fleet.abandon();
                }
                std::panic::resume_unwind(p);
            }
        }
    })
}

fn docker_ok() -> Result<(), String> {
    match Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "no Docker Engine answers (`docker info`: {}): the container tests need one (CI has one); nothing was run",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("cannot run `docker` ({e}): the container tests need Docker Engine with Compose; nothing was run")),
    }
}

fn sh(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn stdout_of(cmd: &mut Command) -> String {
    let out = sh(cmd);
    assert!(out.status.success(), "{cmd:?} failed: {}{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout).trim().to_string()
}

/// `docker compose` or `docker-compose`, as deploy/lib.sh picks it.
fn compose_cmd() -> Vec<String> {
    static CMD: OnceLock<Vec<String>> = OnceLock::new();
    CMD.get_or_init(|| {
        let v2 = Command::new("docker").args(["compose", "version"]).output().is_ok_and(|o| o.status.success());
        if v2 {
            vec!["docker".into(), "compose".into()]
        } else {
            vec!["docker-compose".into()]
        }
    })
    .clone()
}

/// The directory of the four binaries of this build (its profile: `cargo test` or `cargo test
/// --release`), each built when missing.
fn binaries() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dirs: Vec<PathBuf> =
            ["initiator", "processor", "controller", "scaling-agent"].iter().map(|b| fleet_test_support::bin(b).parent().unwrap().to_path_buf()).collect();
        assert!(dirs.windows(2).all(|w| w[0] == w[1]), "the binaries are in different directories: {dirs:?}");
        dirs[0].clone()
    })
}

/// Shared input: one million generated transactions, and what `initiator local` (one process, no
/// queues) makes of them.
struct Input {
    _dir: tempfile::TempDir,
    million: PathBuf,
    local: Value,
}

fn input() -> &'static Input {
    static INPUT: OnceLock<Input> = OnceLock::new();
    INPUT.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let million = dir.path().join("million.csv");
        let bin = fleet_test_support::bin("initiator");
        let file = std::fs::File::create(&million).unwrap();
        let st = Command::new(&bin).args(["generate", "--rows", &MILLION.to_string(), "--accounts", "1000", "--seed", "42"]).stdout(file).status().unwrap();
        assert!(st.success(), "initiator generate failed");
        let local: Value = serde_json::from_str(&stdout_of(Command::new(&bin).arg("local").arg(&million).arg("--json"))).unwrap();
        Input { _dir: dir, million, local }
    })
}

/// One compose project of the fleet, brought down (and checked gone) at the end, also on failure.
struct Fleet {
    project: String,
    down: bool,
    /// Environment of every compose.sh call (the agent's policy, listener tuning).
    env: Vec<(String, String)>,
}

/// The fault scenarios count processor containers themselves: the agent only decides there.
const AGENT_DECIDES_ONLY: &[(&str, &str)] = &[("AGENT_BACKEND", "none")];

impl Fleet {
    /// `deploy/compose.sh up` with `processors` processor containers.
    fn up(name: &str, processors: u32) -> Fleet {
        Fleet::up_with(name, processors, &[])
    }

    /// [`Fleet::up`] with extra environment for every compose.sh call.
    fn up_with(name: &str, processors: u32, env: &[(&str, &str)]) -> Fleet {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let fleet = Fleet { project: format!("bft-{name}-{}", std::process::id()), down: false, env };
        let t0 = Instant::now();
        let out = fleet.sh(&["up"], &[("FLEET_PROCESSORS", &processors.to_string())]);
        assert!(out.status.success(), "compose.sh up failed:\n{}{}", text(&out.stdout), text(&out.stderr));
        println!("[{name}] compose.sh up: {:.1} s", t0.elapsed().as_secs_f64());
        assert_eq!(fleet.running("processor").len(), processors as usize, "processor containers after up");
        for s in ["controller", "scaling-agent"] {
            assert_eq!(fleet.running(s).len(), 1, "{s} containers after up");
        }
        for s in ["localstack", "rabbitmq"] {
            let id = &fleet.running(s)[0];
            assert_eq!(inspect(id, "{{.State.Health.Status}}"), "healthy", "{s}");
        }
        fleet.assert_restricted_with_generated_credentials();
        fleet
    }

    /// The fleet's containers run as deploy/k8s's restricted pods do (user 65534, read-only root,
    /// every capability dropped, no new privileges), and the broker has one user, the fleet's, with
    /// the password compose.sh generated: no guest, and every service connected with it.
    fn assert_restricted_with_generated_credentials(&self) {
        for s in ["processor", "controller", "scaling-agent", "cli"] {
            let ids = self.running(s);
            assert!(!ids.is_empty(), "no {s} container running");
            for id in ids {
                let got = inspect(
                    &id,
                    "{{.Config.User}} {{.HostConfig.ReadonlyRootfs}} {{.HostConfig.Privileged}} {{json .HostConfig.CapDrop}} {{json .HostConfig.SecurityOpt}}",
                );
                assert_eq!(got, r#"65534:65534 true false ["ALL"] ["no-new-privileges:true"]"#, "{s} container {id} is not restricted");
            }
        }
        let env = std::fs::read_to_string(repo().join("deploy/.env")).expect("compose.sh wrote no deploy/.env");
        let password = env.lines().find_map(|l| l.strip_prefix("FLEET_AMQP_PASSWORD=")).expect("no FLEET_AMQP_PASSWORD in deploy/.env");
        assert!(password.len() >= 32, "a weak broker password");
        let rabbit = &self.running("rabbitmq")[0];
        let users = stdout_of(Command::new("docker").args(["exec", rabbit, "rabbitmqctl", "-q", "list_users"]));
        let names: Vec<&str> = users.lines().filter_map(|l| l.split_whitespace().next()).filter(|u| *u != "user").collect();
        assert_eq!(names, vec!["fleet"], "the broker's users");
        // Processor, controller and agent hold connections as `fleet` (they would not with another password).
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let conns = stdout_of(Command::new("docker").args(["exec", rabbit, "rabbitmqctl", "-q", "list_connections", "user"]));
            let fleet = conns.lines().filter(|l| l.trim() == "fleet").count();
            if fleet >= 3 {
                break;
            }
            assert!(Instant::now() < deadline, "{fleet} broker connections as fleet after 60 s: {conns}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn command(&self, program: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(args).current_dir(repo()).env("COMPOSE_PROJECT_NAME", &self.project).env("FLEET_IMAGE_PREFIX", PREFIX);
        // The fleet image takes the binaries this test build made (not a second, release build of them).
        cmd.env("FLEET_BINARIES", binaries());
        // Free host ports (a LocalStack or RabbitMQ of the host may hold the default ones).
        cmd.env("FLEET_LOCALSTACK_PORT", "").env("FLEET_RABBITMQ_UI_PORT", "").env("FLEET_PROMETHEUS_PORT", "");
        for v in
            ["FLEET_IMAGE", "LOCALSTACK_IMAGE", "RABBITMQ_IMAGE", "FLEET_IMAGE_SOURCE", "FLEET_WORK_QUEUE", "FLEET_RESULTS_QUEUE", "FLEET_BUCKET", "RUST_LOG"]
        {
            cmd.env_remove(v);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        cmd.envs(env.iter().copied());
        cmd
    }

    /// deploy/compose.sh ARGS.
    fn sh(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        sh(self.command(&repo().join("deploy/compose.sh"), args, env).stdin(Stdio::null()))
    }

    /// The compose tool itself on this project (what a user types for stop, restart, ...).
    fn compose(&self, args: &[&str]) -> Output {
        let images = stdout_of(Command::new(repo().join("deploy/images.sh")).arg("--print").env("FLEET_IMAGE_PREFIX", PREFIX));
        let cmd = compose_cmd();
        let mut c = self.command(Path::new(&cmd[0]), &cmd[1..].iter().map(String::as_str).collect::<Vec<_>>(), &[]);
        c.args(["-f", "deploy/docker-compose.yml"]).args(args);
        for line in images.lines() {
            if let Some((k, v)) = line.split_once('=') {
                c.env(k, v);
            }
        }
        sh(&mut c)
    }

    fn containers(&self, service: &str, all: bool) -> Vec<String> {
        let mut c = Command::new("docker");
        c.args(["ps", "-q", "--filter", &format!("label=com.docker.compose.project={}", self.project)]);
        c.args(["--filter", &format!("label=com.docker.compose.service={service}")]);
        if all {
            c.arg("-a");
        }
        stdout_of(&mut c).lines().map(str::to_string).collect()
    }

    fn running(&self, service: &str) -> Vec<String> {
        self.containers(service, false)
    }

    /// A container port's address on the host.
    fn host_addr(&self, id: &str, port: u16) -> String {
        stdout_of(Command::new("docker").args(["port", id, &format!("{port}/tcp")])).lines().next().unwrap_or_default().to_string()
    }

    /// `compose.sh submit FILE --wait --json` in the background (stdout to a file).
    fn submit_bg_with(&self, file: &Path, out: &Path, flags: &[&str]) -> Child {
        let mut args = vec!["submit", file.to_str().unwrap(), "--wait", "--json"];
        args.extend_from_slice(flags);
        let mut cmd = self.command(&repo().join("deploy/compose.sh"), &args, &[]);
        cmd.stdin(Stdio::null()).stdout(std::fs::File::create(out).unwrap()).stderr(Stdio::piped());
        cmd.spawn().unwrap()
    }

    /// What each running processor container has billed so far (its /state counts), by container.
    fn processed(&self) -> HashMap<String, u64> {
        self.running("processor")
            .into_iter()
            .filter_map(|id| {
                let addr = self.host_addr(&id, 9101);
                let o = Command::new("curl").args(["-fsS", "--max-time", "2", &format!("http://{addr}/state?depth=false")]).output().ok()?;
                let v: Value = serde_json::from_slice(&o.stdout).ok()?;
                Some((id, v.as_array()?.iter().filter_map(|l| l["processed"].as_u64()).sum::<u64>()))
            })
            .collect()
    }

    /// Waits until some processor has billed more than it had at `before` (a chunk of the job just
    /// submitted: earlier jobs of a shared fleet count too), then returns.
    fn wait_mid_job(&self, before: &HashMap<String, u64>) -> SystemTime {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if self.processed().iter().any(|(id, n)| *n > before.get(id).copied().unwrap_or(0)) {
                return SystemTime::now();
            }
            assert!(Instant::now() < deadline, "no processor billed anything within 120 s of the submission");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// At least `n` processor containers running (`compose.sh scale n` when fewer).
    fn at_least(&self, n: usize) {
        if self.running("processor").len() < n {
            let out = self.sh(&["scale", &n.to_string()], &[]);
            assert!(out.status.success(), "scale {n}: {}", text(&out.stderr));
        }
        assert!(self.running("processor").len() >= n, "fewer than {n} processor containers after scale {n}");
    }

    /// The compose Prometheus (profile "monitoring") scrapes every processor container running now
    /// (those the agent added too), the controller and the agent, all up, with the fleet's alert rules
    /// loaded and evaluated.
    fn prometheus_scrapes_every_service(&self) {
        let prom = self.running("prometheus");
        assert_eq!(prom.len(), 1, "no Prometheus container (FLEET_MONITORING=1)");
        let addr = self.host_addr(&prom[0], 9090);
        let get = |path: &str| -> Option<Value> {
            let o = Command::new("curl").args(["-fsS", "--max-time", "3", &format!("http://{addr}{path}")]).output().ok()?;
            serde_json::from_slice(&o.stdout).ok()
        };
        let processors = self.running("processor").len();
        let want = |svc: &str| if svc == "processor" { processors } else { 1 };
        let t = Instant::now();
        let targets = loop {
            let targets: Vec<(String, String)> = get("/api/v1/targets?state=active")
                .and_then(|v| v["data"]["activeTargets"].as_array().cloned())
                .unwrap_or_default()
                .iter()
                .map(|t| (t["labels"]["service"].as_str().unwrap_or("").to_string(), t["health"].as_str().unwrap_or("").to_string()))
                .collect();
            let up = |svc: &str| targets.iter().filter(|(s, h)| s == svc && h == "up").count();
            if ["processor", "controller", "scaling-agent"].iter().all(|s| up(s) == want(s)) {
                break targets;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "Prometheus does not scrape every service ({processors} processors): {targets:?}");
            std::thread::sleep(Duration::from_secs(1));
        };
        println!("[agent] Prometheus scrapes {} targets, all up, {:.1} s after the third processor", targets.len(), t.elapsed().as_secs_f64());
        let rules = get("/api/v1/rules").expect("Prometheus /api/v1/rules");
        let names: Vec<&str> = rules["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .filter_map(|r| r["name"].as_str())
            .collect();
        assert!(names.contains(&"FleetOldestWorkOverSla") && names.len() >= 7, "the fleet's alert rules are not loaded: {names:?}");
        // Every running service's build_info (a processor stopped a moment ago goes stale at its
        // target's next refresh or failed scrape).
        let want = (processors + 2).to_string();
        let t = Instant::now();
        loop {
            let build = get("/api/v1/query?query=count(fleet_build_info)").expect("Prometheus query");
            if build["data"]["result"][0]["value"][1].as_str() == Some(want.as_str()) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "build_info of every service: {build}");
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Every running fleet service's `/metrics` (each processor container, the controller, the
    /// agent), scraped directly: `promtool check metrics` is clean on each (skipped without promtool,
    /// unless FLEET_REQUIRE_STACK), and every metric name an alert of deploy/prometheus/alerts.yml
    /// selects is served by at least one of them ([`MAY_BE_ABSENT`] apart).
    fn metrics_name_every_alerts_metric(&self) {
        let t = Instant::now();
        let mut scraped: Vec<(String, String)> = Vec::new();
        for (service, port) in [("processor", 9101), ("controller", 9102), ("scaling-agent", 9100)] {
            let ids = self.running(service);
            assert!(!ids.is_empty(), "no {service} container running");
            for id in ids {
                let addr = self.host_addr(&id, port);
                let url = format!("http://{addr}/metrics");
                let body = stdout_of(Command::new("curl").args(["-fsS", "--max-time", "5", &url]));
                assert!(body.contains("fleet_build_info{"), "{service} {id}: no fleet_build_info at {url}:\n{body}");
                // The operator's own figures on every service: its memory and CPU, and its SQS calls
                // by operation (each service has made some by now: receives, depth reads).
                for series in ["process_resident_memory_bytes ", "process_cpu_seconds_total ", "fleet_call_seconds_count{dependency=\"sqs\","] {
                    let value = body.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse::<f64>().ok());
                    assert!(value.is_some_and(|v| v > 0.0), "{service} {id}: no {series:?} above 0 at {url}:\n{body}");
                }
                fleet_test_support::promtool::assert_clean(&format!("{service} container {id} ({url})"), &body);
                scraped.push((format!("{service} {}", &id[..12.min(id.len())]), body));
            }
        }
        let served: std::collections::HashSet<String> = scraped.iter().flat_map(|(_, b)| fleet_test_support::promtool::metric_names(b)).collect();
        let mut checked = std::collections::BTreeSet::new();
        let mut missing = Vec::new();
        for (alert, names) in alert_rules() {
            for name in names {
                let exempt = MAY_BE_ABSENT.iter().find(|(n, _)| *n == name);
                if !served.contains(&name) {
                    match exempt {
                        Some((_, why)) => println!("[metrics] {alert}: {name} not served now ({why})"),
                        None => missing.push(format!("{alert}: {name}")),
                    }
                }
                checked.insert(name);
            }
        }
        assert!(
            missing.is_empty(),
            "metrics the alert rules select that no service serves: {missing:?} (scraped: {:?})",
            scraped.iter().map(|(w, _)| w).collect::<Vec<_>>()
        );
        println!(
            "[metrics] {} /metrics scraped ({}), promtool check metrics {}; the alerts' metrics checked: {} ({:.1} s)",
            scraped.len(),
            scraped.iter().map(|(w, _)| w.as_str()).collect::<Vec<_>>().join(", "),
            if fleet_test_support::promtool::available() { "clean on each" } else { "skipped (no promtool)" },
            checked.into_iter().collect::<Vec<_>>().join(" "),
            t.elapsed().as_secs_f64()
        );
    }

    /// Prints the fleet's last log lines, then brings it down (a failed scenario's fleet).
    fn abandon(&mut self) {
        let logs = self.sh(&["logs", "--tail=40"], &[]);
        eprintln!("--- last log lines of {}:\n{}", self.project, text(&logs.stdout));
        let _ = self.sh(&["down"], &[]);
        self.down = true;
    }

    /// Brings the project down and checks nothing of it is left: no container, no network.
    fn down(&mut self) {
        let out = self.sh(&["down"], &[]);
        self.down = true;
        assert!(out.status.success(), "compose.sh down failed: {}{}", text(&out.stdout), text(&out.stderr));
        let label = format!("label=com.docker.compose.project={}", self.project);
        let left = stdout_of(Command::new("docker").args(["ps", "-a", "-q", "--filter", &label]));
        assert!(left.is_empty(), "containers left after down: {left}");
        let nets = stdout_of(Command::new("docker").args(["network", "ls", "-q", "--filter", &label]));
        assert!(nets.is_empty(), "networks left after down: {nets}");
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if self.down {
            return;
        }
        if std::thread::panicking() {
            self.abandon();
        } else {
            let _ = self.sh(&["down"], &[]);
        }
    }
}

fn inspect(id: &str, format: &str) -> String {
    stdout_of(Command::new("docker").args(["inspect", "-f", format, id]))
}

/// Waits for a background submission (at most `limit`) and returns its report (`--json`).
fn finish(mut child: Child, out: &Path, limit: Duration) -> Value {
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the job did not finish within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let body = std::fs::read_to_string(out).unwrap();
    assert!(status.success(), "compose.sh submit exited with {status}: {err}\n{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("submit --json printed no report ({e}): {body}\n{err}"))
}

/// The job is complete and its per-account and per-currency totals equal `initiator local`'s.
fn assert_matches_local(report: &Value) {
    let local = &input().local;
    assert_eq!(report["status"], "complete");
    assert_eq!(report["transactions"]["processed"].as_u64(), Some(MILLION), "{}", report["transactions"]);
    assert_eq!(report["transactions"]["failed"].as_u64(), Some(0));
    assert_eq!(report["totals"], local["totals"], "totals differ from initiator local");
    assert!(report["accounts"] == local["accounts"], "per-account totals differ from initiator local");
}

/// The report was written after `t` (the fault happened mid-job, not after it).
fn assert_finished_after(report: &Value, t: SystemTime) {
    let fin = time::OffsetDateTime::parse(report["finished_at"].as_str().unwrap(), &time::format_description::well_known::Rfc3339).unwrap();
    let t = time::OffsetDateTime::from(t);
    assert!(fin > t, "the job finished at {fin}, before the fault at {t}: the fault was not mid-job");
}

fn secs_since(t: SystemTime) -> f64 {
    t.elapsed().unwrap_or_default().as_secs_f64()
}

// ---- scenarios -------------------------------------------------------------------------------------

/// From no images: compose.sh up builds every image and starts a healthy fleet; a second up reuses
/// them; submit refuses a missing file or a directory (exit 1, nothing enqueued) and bills a small job;
/// down leaves nothing.
fn images_from_nothing() {
    let out = sh(Command::new(repo().join("deploy/images.sh")).arg("--remove").env("FLEET_IMAGE_PREFIX", PREFIX));
    assert!(out.status.success(), "images.sh --remove: {}", text(&out.stderr));
    let have = stdout_of(Command::new("docker").args(["image", "ls", "-q", "--filter", &format!("reference={PREFIX}/*")]));
    assert!(have.is_empty(), "test images still there: {have}");

    let cold = Instant::now();
    let mut fleet = Fleet::up("cold", 1);
    println!("[cold] images from nothing + up: {:.1} s", cold.elapsed().as_secs_f64());
    for (image, size) in stdout_of(Command::new("docker").args(["image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}", &format!("{PREFIX}/*")]))
        .lines()
        .filter_map(|l| l.split_once(' '))
    {
        println!("[cold] image {image}: {size}");
    }

    let warm = Instant::now();
    let out = fleet.sh(&["up"], &[]);
    let log = text(&out.stdout);
    assert!(out.status.success(), "second up: {log}{}", text(&out.stderr));
    for what in ["localstack", "rabbitmq", "fleet"] {
        assert!(log.contains(&format!("{what}: {PREFIX}/")) && log.contains("up to date"), "second up rebuilt {what}:\n{log}");
    }
    println!("[cold] second (warm) up: {:.1} s", warm.elapsed().as_secs_f64());

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such.csv");
    let out = fleet.sh(&["submit", missing.to_str().unwrap(), "--wait"], &[]);
    assert_eq!(out.status.code(), Some(1), "missing file: {}", text(&out.stderr));
    assert!(text(&out.stderr).contains("no-such.csv: no such file (nothing was submitted)"), "{}", text(&out.stderr));
    let out = fleet.sh(&["submit", dir.path().to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(1), "a directory: {}", text(&out.stderr));
    assert!(text(&out.stderr).contains("not a regular file"), "{}", text(&out.stderr));
    let endpoint = format!("http://{}", fleet.host_addr(&fleet.running("localstack")[0], 4566));
    nothing_enqueued(&endpoint);

    // A small job with one bad row: billed, the row rejected with file and line, exit 0.
    let csv = dir.path().join("small.csv");
    let mut body = String::from("txn_id,account_id,amount,currency,timestamp\n");
    for i in 0..2000 {
        body.push_str(&format!("t{i},A{},{}.25,EUR,2026-01-01T00:00:00Z\n", i % 7, i % 90 + 1));
    }
    body.push_str("bad,A1,12.3456,EUR,2026-01-01T00:00:00Z\n");
    std::fs::write(&csv, body).unwrap();
    let out = fleet.sh(&["submit", csv.to_str().unwrap(), "--wait", "--json"], &[]);
    assert_eq!(out.status.code(), Some(0), "small job: {}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (r["transactions"]["accepted"].as_u64(), r["transactions"]["processed"].as_u64(), r["transactions"]["rejected"].as_u64()),
        (Some(2000), Some(2000), Some(1))
    );
    let rejected = &r["rejected"][0];
    assert_eq!(rejected["line"].as_u64(), Some(2002), "{rejected}");
    // One file goes to the cli container on standard input, under the name it was given here.
    assert_eq!(rejected["file"].as_str(), csv.to_str(), "{rejected}");
    assert_eq!(r["files"], serde_json::json!([csv.to_str().unwrap()]));

    // Two files (and a tariff file) are mounted in a one-off container: one job over both.
    let second = dir.path().join("second.csv");
    std::fs::write(&second, "txn_id,account_id,amount,currency,timestamp\nu1,A1,5.00,EUR,2026-01-01T00:00:00Z\nt7,A1,1.00,EUR,2026-01-01T00:00:00Z\n").unwrap();
    let tariff = dir.path().join("tariff.json");
    std::fs::write(&tariff, r#"{"fixed_fee":"0.10","percent":"1.0","refund_fee":"0"}"#).unwrap();
    let out = fleet.sh(&["submit", csv.to_str().unwrap(), second.to_str().unwrap(), "--tariff", tariff.to_str().unwrap(), "--wait", "--json"], &[]);
    assert_eq!(out.status.code(), Some(0), "two files: {}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["files"], serde_json::json!([csv.to_str().unwrap(), second.to_str().unwrap()]));
    assert_eq!(r["tariff"]["fixed_fee"], "0.10", "{}", r["tariff"]);
    // The first file's rows were billed by the job before: each a duplicate of it, not billed again.
    assert_eq!(
        (r["transactions"]["processed"].as_u64(), r["transactions"]["rejected"].as_u64(), r["transactions"]["duplicates"].as_u64()),
        (Some(1), Some(2), Some(2000)),
        "{}",
        r["transactions"]
    );
    let dup = r["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["txn_id"] == "t7" && x["reason"].as_str().is_some_and(|r| r.starts_with("txn_id: duplicate of")))
        .expect("t7 rejected as a duplicate");
    assert_eq!((dup["file"].as_str(), dup["line"].as_u64()), (second.to_str(), Some(3)), "{dup}");

    // Standard input reaches a command executed in the cli container, and a TERM to compose.sh (as
    // `kill`, or a terminal's Ctrl-C) stops that command, which `docker exec` alone leaves running.
    let cli = fleet.running("cli")[0].clone();
    let initiators = || {
        let comms = stdout_of(Command::new("docker").args(["exec", &cli, "sh", "-c", "cat /proc/[0-9]*/comm 2>/dev/null"]));
        comms.lines().filter(|c| *c == "initiator").count()
    };
    // `compose.sh initiator local - --json`, one transaction written to its standard input.
    let local_on_a_pipe = || {
        let mut child = fleet
            .command(&repo().join("deploy/compose.sh"), &["initiator", "local", "-", "--json"], &[])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        std::io::Write::write_all(&mut stdin, b"txn_id,account_id,amount,currency,timestamp\nx1,A1,2.50,EUR,2026-01-01T00:00:00Z\n").unwrap();
        (child, stdin)
    };
    let (mut local, stdin) = local_on_a_pipe();
    // Standard input stays open: the initiator reads on.
    let t = Instant::now();
    while initiators() == 0 {
        assert!(t.elapsed() < Duration::from_secs(30), "no initiator started in the cli container");
        std::thread::sleep(Duration::from_millis(100));
    }
    sh(Command::new("kill").args(["-TERM", &local.id().to_string()]));
    let t = Instant::now();
    let status = loop {
        if let Some(status) = local.try_wait().unwrap() {
            break status;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "compose.sh initiator did not stop on TERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "stopped, not finished: {status:?}");
    let t = Instant::now();
    while initiators() > 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the initiator still runs in the cli container after compose.sh stopped");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(stdin);
    // The same command with its standard input closed bills what it read.
    let (local, stdin) = local_on_a_pipe();
    drop(stdin);
    let out = local.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "initiator local - on a pipe: {}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["transactions"]["processed"].as_u64(), Some(1), "{r}");
    fleet.down();
}

/// Neither a work item nor a blob on the fleet's LocalStack.
fn nothing_enqueued(endpoint: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let aws = fleet_io::config::Aws::local(endpoint).await;
        let work = aws.queue("billing-work").await.unwrap();
        let d = fleet_io::queue::Queue::depth(work.as_ref()).await.unwrap();
        assert_eq!((d.visible, d.in_flight), (0, 0), "work items were enqueued");
        let listed = aws.s3().list_objects_v2().bucket("billing-fleet").prefix("jobs/").send().await.unwrap();
        assert_eq!(listed.key_count(), Some(0), "blobs were stored: {:?}", listed.contents());
    });
}

/// Submits the million-transaction job through the initiator container, runs `fault` once a processor
/// has billed part of it, and checks that the job then completes with totals identical to `initiator
/// local`, its report written after the fault. Returns the seconds from submission to report.
fn million_job(fleet: &Fleet, fault: impl FnOnce(&Fleet)) -> f64 {
    // Chunks of 5,000 (200 work items): the job lasts long enough for a fault to land mid-job.
    million_job_with(fleet, &["--chunk-size", "5000"], fault)
}

fn million_job_with(fleet: &Fleet, flags: &[&str], fault: impl FnOnce(&Fleet)) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report.json");
    // Generated (and billed locally) on first use: outside the timed window. Each job of a shared
    // fleet gets ids of its own (the same rows, so `initiator local`'s totals hold): the same ids
    // twice are billed once.
    static JOBS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let text = std::fs::read_to_string(&input().million).unwrap();
    let fresh = dir.path().join("million.csv");
    std::fs::write(&fresh, text.replace("\nS42-", &format!("\nR{n}-"))).unwrap();
    drop(text);
    let file = &fresh;
    let before = fleet.processed();
    let t0 = SystemTime::now();
    let child = fleet.submit_bg_with(file, &out, flags);
    let at = fleet.wait_mid_job(&before);
    fault(fleet);
    let report = finish(child, &out, Duration::from_secs(600));
    let secs = secs_since(t0);
    assert_matches_local(&report);
    assert_finished_after(&report, at);
    let req = &report["requests"];
    println!("[{}] submit -> report {secs:.2} s, {} requests, {} per 1,000 transactions", fleet.project, req["total"], req["per_1000_transactions"]);
    secs
}

/// A million transactions through the initiator container at its default (per-job) chunk size:
/// totals identical to `initiator local`.
fn million_matches_local(fleet: &mut Fleet) {
    million_job_with(fleet, &[], |_| {});
}

/// A processor container killed (SIGKILL) mid-job: its work items come back after their visibility
/// timeout and the totals stay exact.
fn processor_killed_mid_job(fleet: &mut Fleet) {
    fleet.at_least(2);
    let running = fleet.running("processor");
    let victim = running[1].clone();
    million_job(fleet, |_| {
        stdout_of(Command::new("docker").args(["kill", &victim]));
    });
    assert_eq!(inspect(&victim, "{{.State.ExitCode}}"), "137", "the killed processor");
    assert_eq!(fleet.running("processor").len(), running.len() - 1, "the other processors still run");
}

/// `compose stop processor` mid-job: every processor drains and exits 0; started again, the fleet
/// finishes the job with exact totals.
fn stop_processor_drains(fleet: &mut Fleet) {
    fleet.at_least(2);
    million_job(fleet, |fleet| {
        let ids = fleet.running("processor");
        let t = Instant::now();
        let stop = fleet.compose(&["stop", "processor"]);
        assert!(stop.status.success(), "compose stop processor: {}", text(&stop.stderr));
        println!("[drain] compose stop processor: {:.1} s", t.elapsed().as_secs_f64());
        for id in &ids {
            assert_eq!(inspect(id, "{{.State.Status}} {{.State.ExitCode}}"), "exited 0", "a stopped processor");
            let logs = text(&sh(Command::new("docker").args(["logs", id])).stderr);
            assert!(logs.contains("drained=true"), "processor did not report a full drain:\n{logs}");
        }
        let scale = fleet.sh(&["scale", "2"], &[]);
        assert!(scale.status.success(), "scale 2: {}", text(&scale.stderr));
    });
}

/// `compose restart controller` mid-job: the new controller resumes from the checkpoint; exact totals.
fn controller_restarted_mid_job(fleet: &mut Fleet) {
    let controllers = fleet.running("controller");
    assert_eq!(controllers.len(), 1, "one controller before the restart");
    let id = controllers[0].clone();
    million_job(fleet, |fleet| {
        let started = inspect(&id, "{{.State.StartedAt}}");
        let r = fleet.compose(&["restart", "controller"]);
        assert!(r.status.success(), "compose restart controller: {}", text(&r.stderr));
        assert_ne!(inspect(&id, "{{.State.StartedAt}}"), started, "the controller was not restarted");
    });
}

/// Two controller replicas on one results queue (job leases decide which one aggregates the job); a
/// rolling restart mid-job, one replica at a time (SIGTERM: it gives its leases back), each running
/// again before the next: the totals equal `initiator local`'s and both replicas run at the end.
fn controllers_rolling_restart(fleet: &mut Fleet) {
    let r = fleet.compose(&["up", "-d", "--no-deps", "--no-recreate", "--scale", "controller=2", "controller"]);
    assert!(r.status.success(), "compose up --scale controller=2: {}", text(&r.stderr));
    assert_eq!(fleet.running("controller").len(), 2, "two controller replicas");
    million_job(fleet, |fleet| {
        for id in fleet.running("controller") {
            let started = inspect(&id, "{{.State.StartedAt}}");
            let out = sh(Command::new("docker").args(["restart", &id]));
            assert!(out.status.success(), "docker restart {id}: {}", text(&out.stderr));
            assert_ne!(inspect(&id, "{{.State.StartedAt}}"), started, "controller {id} was not restarted");
            assert_eq!(inspect(&id, "{{.State.Running}}"), "true", "controller {id} runs again before the next one restarts");
        }
    });
    assert_eq!(fleet.running("controller").len(), 2, "both replicas run after the job");
}

/// `compose stop rabbitmq` mid-job: triggers are hints, so the job completes with exact totals and
/// every fleet service stays up. The shared fleet's last scenario: it brings the fleet down.
fn rabbitmq_stopped_mid_job(fleet: &mut Fleet) {
    fleet.at_least(2);
    let processors = fleet.running("processor").len();
    let controllers = fleet.running("controller").len();
    million_job(fleet, |fleet| {
        let r = fleet.compose(&["stop", "rabbitmq"]);
        assert!(r.status.success(), "compose stop rabbitmq: {}", text(&r.stderr));
        assert!(fleet.running("rabbitmq").is_empty(), "rabbitmq still runs");
    });
    assert_eq!(fleet.running("processor").len(), processors, "processors after the broker went away");
    assert_eq!(fleet.running("controller").len(), controllers, "controllers after the broker went away");
    assert_eq!(fleet.running("scaling-agent").len(), 1, "scaling-agent after the broker went away");
    fleet.down();
}

/// The agent's docker backend (compose.sh up's default) on a burst of 1,500 work items, the processors
/// held to one work item at a time: it adds processor containers (1 -> 3) that `compose ps` lists as
/// the service's own; one of them stopped mid-job (SIGTERM: it drains) is started again; the totals
/// equal `initiator local`'s; a later `compose up` at that scale keeps every container; after the
/// stabilization window the agent stops the added ones (drained, removed) and the first one remains.
fn agent_scales_containers() {
    let env = [
        ("AGENT_MIN_INSTANCES", "1"),
        ("AGENT_MAX_INSTANCES", "3"),
        ("AGENT_SLA_SECS", "5"),
        ("AGENT_INSTANCE_THROUGHPUT", "2"),
        ("AGENT_INTERVAL_SECS", "1"),
        ("AGENT_STABILIZATION_SECS", "30"),
        ("LISTENER_MAX_CONSUMERS", "1"),
        ("LISTENER_MAX_CONCURRENCY", "1"),
        ("LISTENER_BUFFER", "0"),
        ("PROCESSOR_DRAIN_SECS", "10"),
        // Prometheus too (profile "monitoring"): it must scrape the processors the agent adds.
        ("FLEET_MONITORING", "1"),
    ];
    let mut fleet = Fleet::up_with("agent", 1, &env);
    let first = fleet.running("processor")[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("burst.csv");
    let bin = fleet_test_support::bin("initiator");
    let st = Command::new(&bin)
        .args(["generate", "--rows", "300000", "--accounts", "500", "--seed", "7"])
        .stdout(std::fs::File::create(&file).unwrap())
        .status()
        .unwrap();
    assert!(st.success());
    let local: Value = serde_json::from_str(&stdout_of(Command::new(&bin).arg("local").arg(&file).arg("--json"))).unwrap();

    let out = dir.path().join("report.json");
    let t0 = Instant::now();
    // 1,500 work items: the job outlasts the scale-up, the stop of a processor (its 10 s drain) and
    // the agent's replacement of it (three processors clear about 60 a second here).
    let child = fleet.submit_bg_with(&file, &out, &["--chunk-size", "200"]);
    let scaled = loop {
        let n = fleet.running("processor").len();
        if n == 3 {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the agent did not reach 3 processor containers ({n})");
        std::thread::sleep(Duration::from_millis(100));
    };
    println!("[agent] submit -> 3 processor containers running: {:.1} s", scaled.as_secs_f64());
    let ps = fleet.compose(&["ps", "-q", "processor"]);
    assert_eq!(text(&ps.stdout).lines().count(), 3, "compose ps does not list the agent's containers:\n{}", text(&ps.stdout));

    // One of the added containers stopped mid-job: it drains; the agent replaces it.
    let added: Vec<String> = fleet.running("processor").into_iter().filter(|id| *id != first).collect();
    // The agent's containers are confined: nothing bound from the host but the processor's role key
    // (a read-only compose secret from deploy/.keys), no privileges, every capability dropped, no new
    // privileges, ports on loopback only.
    let key = repo().join("deploy/.keys/processor.key");
    for id in &added {
        let host = inspect(
            id,
            "{{json .HostConfig.Binds}} {{json .HostConfig.Mounts}} {{.HostConfig.Privileged}} {{json .HostConfig.CapDrop}} {{json .HostConfig.SecurityOpt}}",
        );
        let binds = format!(r#"["{}:/run/secrets/processor.key:ro"] null"#, key.display());
        let mounts = format!(r#"null [{{"Type":"bind","Source":"{}","Target":"/run/secrets/processor.key","ReadOnly":true}}]"#, key.display());
        let rest = r#" false ["ALL"] ["no-new-privileges:true"]"#;
        assert!(host == binds.clone() + rest || host == mounts.clone() + rest, "container {id} the agent added: {host}");
        let ports = inspect(id, "{{json .HostConfig.PortBindings}}");
        assert!(!ports.contains("0.0.0.0") && ports.contains("127.0.0.1"), "container {id} publishes beyond loopback: {ports}");
    }
    let victim = added[0].clone();
    let stopped_at = SystemTime::now();
    let stop = sh(Command::new("docker").args(["stop", &victim]));
    assert!(stop.status.success(), "docker stop: {}", text(&stop.stderr));
    assert_eq!(inspect(&victim, "{{.State.ExitCode}}"), "0", "the stopped processor did not drain cleanly");
    let t = Instant::now();
    while fleet.running("processor").len() < 3 {
        assert!(t.elapsed() < Duration::from_secs(30), "the stopped processor was not started again");
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("[agent] the stopped processor replaced {:.1} s after its stop began", secs_since(stopped_at));
    // Prometheus scrapes every service, the processor the agent started last included.
    fleet.prometheus_scrapes_every_service();
    // And each service's /metrics itself: clean under promtool, every alert's metric served.
    fleet.metrics_name_every_alerts_metric();

    let report = finish(child, &out, Duration::from_secs(300));
    let took = t0.elapsed();
    assert_eq!(report["status"], "complete");
    assert_eq!(report["transactions"]["processed"].as_u64(), Some(300_000));
    assert_eq!(report["totals"], local["totals"], "totals differ from initiator local");
    assert!(report["accounts"] == local["accounts"], "per-account totals differ from initiator local");
    assert_finished_after(&report, stopped_at);
    println!("[agent] 1,500 work items: report {:.1} s after submit", took.as_secs_f64());

    // compose up at the current scale keeps the agent's containers (none recreated).
    let before = {
        let mut v = fleet.running("processor");
        v.sort();
        v
    };
    let up = fleet.sh(&["up"], &[]);
    assert!(up.status.success(), "compose.sh up again: {}{}", text(&up.stdout), text(&up.stderr));
    let after = {
        let mut v = fleet.running("processor");
        v.sort();
        v
    };
    assert_eq!(before, after, "a later compose up replaced the agent's containers");

    // Back to the minimum after the stabilization window: the added containers drain and are removed.
    let t = Instant::now();
    while fleet.containers("processor", true).len() > 1 {
        assert!(t.elapsed() < Duration::from_secs(120), "not back to 1 processor container: {:?}", fleet.containers("processor", true));
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("[agent] back to 1 processor container {:.1} s after the report", t.elapsed().as_secs_f64());
    assert_eq!(fleet.running("processor"), vec![first], "the first processor is the one that remains");
    // Every message was checked by role (the keys compose.sh generated): none refused, the added
    // processors' results counted (the totals above).
    let ctl = &fleet.running("controller")[0];
    let ctl_logs = text(&sh(Command::new("docker").args(["logs", ctl])).stderr);
    assert!(ctl_logs.contains("messages count only when signed by a role"), "the controller checks no roles:\n{ctl_logs}");
    assert!(!ctl_logs.contains("message refused"), "the controller refused messages:\n{ctl_logs}");
    let agent = &fleet.running("scaling-agent")[0];
    let logs = text(&sh(Command::new("docker").args(["logs", agent])).stderr);
    assert!(logs.contains("processor container stopped") && logs.contains("exit_code=Some(0)"), "the agent's stops did not end in a drain:\n{logs}");
    fleet.down();
}
