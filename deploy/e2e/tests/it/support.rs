//! The fleet's services started in-process on a test stack (`fleet_test_support::Stack`): processor,
//! controller and scaling agent as libraries, the initiator's submit and follow. Everything else of the
//! test support comes from `fleet_test_support`, re-exported here.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fleet_domain::report::Report;
use fleet_io::queue::Queue;
pub use fleet_test_support::*;
use initiator::submit::{Clients, SubmitOptions, Submitted};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The test run's role keys (`fleet_io::auth`): one key file per role in one directory, which is also
/// the controllers' keyring. Every participant a test starts signs with its role's key and every
/// controller checks roles, as a deployment with keys does.
pub struct RoleKeys {
    pub dir: PathBuf,
    pub ring: fleet_io::auth::Keyring,
}

impl RoleKeys {
    /// The key file of `role`.
    pub fn file(&self, role: fleet_io::auth::Role) -> PathBuf {
        self.dir.join(format!("{role}.key"))
    }

    /// The key of `role`.
    pub fn key(&self, role: fleet_io::auth::Role) -> fleet_io::auth::Key {
        self.ring.signing_key(role).expect("every role has a key").clone()
    }
}

/// The run's role keys, made once (in a directory that lives as long as the test process).
pub fn role_keys() -> &'static RoleKeys {
    static KEYS: std::sync::OnceLock<RoleKeys> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a directory for the role keys").keep();
        for role in fleet_io::auth::Role::ALL {
            std::fs::write(dir.join(format!("{role}.key")), fleet_io::auth::Key::generate(role).to_line()).expect("write a role key");
        }
        let ring = fleet_io::auth::Keyring::from_dir(&dir).expect("the keyring reads back");
        RoleKeys { dir, ring }
    })
}

/// Child processes killed when the test ends, also when it fails (a paused one continued first).
pub struct Procs(pub Vec<std::process::Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = std::process::Command::new("kill").args(["-CONT", &c.id().to_string()]).status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub struct Running {
    pub stop: CancellationToken,
    pub handle: JoinHandle<fleet_io::Result<()>>,
}

impl Running {
    /// Graceful stop: cancel and wait.
    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.unwrap().unwrap();
    }
}

/// Runs one job (`opts`) on a processor and a controller started for it and checks that it billed
/// exactly: complete, consistent, `processed` transactions, every account as one process bills the
/// files. Both services are stopped after.
pub async fn bills_exactly(fleet: &impl Fleet, opts: SubmitOptions, processed: u64) -> Report {
    let files = opts.files.clone();
    let p = fleet.start_processor(fast_processor());
    let c = fleet.start_controller();
    let s = fleet.submit_with(opts).await;
    let r = fleet.wait_report(&s, Duration::from_secs(90)).await;
    assert_eq!(r.status, fleet_domain::model::JobStatus::Complete);
    assert_consistent(&r);
    assert_eq!(r.transactions.processed, processed);
    assert_eq!(report_accounts(&r), expected_accounts(&files));
    p.stop().await;
    c.stop().await;
    r
}

/// The services on a test stack.
pub trait Fleet {
    fn clients(&self) -> Clients;
    fn start_processor(&self, settings: processor::Settings) -> Running;
    fn start_agent(&self) -> Running;
    fn start_controller(&self) -> Running;
    /// A controller like [`Fleet::start_controller`]'s that finishes a job with failed chunks
    /// `settle_secs` after its last news.
    fn start_controller_settling(&self, settle_secs: u64) -> Running;
    /// What a controller of this stack talks to, following and publishing triggers until `stop`.
    fn controller_deps(&self, stop: &CancellationToken) -> controller::Deps;
    async fn submit(&self, files: &[PathBuf], chunk_size: u64) -> Submitted;
    async fn submit_with(&self, opts: SubmitOptions) -> Submitted;
    async fn wait_report(&self, s: &Submitted, timeout: Duration) -> Report;
}

impl Fleet for Stack {
    fn clients(&self) -> Clients {
        Clients {
            work: self.work_queues().0,
            results: self.results_queues().0,
            store: self.store.clone(),
            triggers: self.names.trigger_bus(),
            signing_key: Some(role_keys().key(fleet_io::auth::Role::Submitter)),
        }
    }

    fn start_processor(&self, settings: processor::Settings) -> Running {
        let stop = CancellationToken::new();
        let (work, work_dlq) = self.work_queues();
        let keys = fleet_io::trigger::work_keys(&[work.as_ref()]);
        let deps = processor::Deps {
            work,
            work_dlq: Some(work_dlq),
            results: self.results_queues().0,
            store: self.store.clone(),
            triggers: self.names.subscribe(keys, &stop),
            publish: self.names.trigger_bus(),
            signing_key: Some(role_keys().key(fleet_io::auth::Role::Processor)),
        };
        let handle = tokio::spawn(processor::run(settings, deps, stop.clone()));
        Running { stop, handle }
    }

    /// The scaling agent, looking every second: it triggers when a queue turns non-empty, such as work
    /// items coming back after a killed processor's visibility timeout (nobody announces those).
    fn start_agent(&self) -> Running {
        let stop = CancellationToken::new();
        let (work, work_dlq) = self.work_queues();
        let (results, results_dlq) = self.results_queues();
        let watched = scaling_agent::Watched { work, work_dlq, results, results_dlq };
        let deps = scaling_agent::Deps {
            watched,
            publish: self.names.trigger_bus(),
            subscription: None,
            backend: Arc::new(scaling_agent::backend::NoneBackend::new(0)),
        };
        let handle = tokio::spawn(scaling_agent::run(scaling_agent::Settings::quick(), deps, stop.clone()));
        Running { stop, handle }
    }

    fn controller_deps(&self, stop: &CancellationToken) -> controller::Deps {
        let (work, work_dlq) = self.work_queues();
        let (results, results_dlq) = self.results_queues();
        let keys = fleet_io::trigger::work_keys(&[results.as_ref(), work_dlq.as_ref(), results_dlq.as_ref()]);
        controller::Deps {
            results,
            work_dlq,
            results_dlq,
            store: self.store.clone(),
            work: Some(work),
            triggers: self.names.subscribe(keys, stop),
            publish: self.names.trigger_bus(),
        }
    }

    /// A controller that follows triggers: idle, its listeners park after one empty 1 s poll and wake
    /// only on triggers (processors and the initiator announce what they put on its queues).
    fn start_controller(&self) -> Running {
        // A job with failed chunks is finished 3 s after its last news (tests wait less than the 120 s default).
        self.start_controller_settling(3)
    }

    fn start_controller_settling(&self, settle_secs: u64) -> Running {
        let stop = CancellationToken::new();
        let deps = self.controller_deps(&stop);
        let settings = controller::Settings {
            listener: fleet_engine::args::ListenerArgs::quick(),
            drain_secs: 10,
            id: Some(TEST_CONTROLLER.into()),
            settle_secs,
            role_keys: Some(role_keys().ring.clone()),
            ..Default::default()
        };
        let handle = tokio::spawn(controller::run(settings, deps, stop.clone()));
        Running { stop, handle }
    }

    async fn submit(&self, files: &[PathBuf], chunk_size: u64) -> Submitted {
        self.submit_with(SubmitOptions { chunk_size, ..SubmitOptions::new(files.to_vec()) }).await
    }

    async fn submit_with(&self, opts: SubmitOptions) -> Submitted {
        initiator::submit::submit(opts, &self.clients()).await.expect("submit")
    }

    async fn wait_report(&self, s: &Submitted, timeout: Duration) -> Report {
        match initiator::follow::wait(self.store.as_ref(), &s.job_id, s.total_chunks, timeout, false).await {
            Ok(r) => r,
            Err(e) => panic!("job {} did not finish in time: {e:?}\n{}", s.job_id, self.diagnose(&s.job_id).await),
        }
    }
}

/// A command for the fleet binary `name` on a test stack: its queue, bucket and bus names, and
/// LocalStack unless `AWS_ENDPOINT_URL` says otherwise.
pub fn fleet_command(st: &Stack, name: &str) -> std::process::Command {
    let n = &st.names;
    let mut cmd = std::process::Command::new(bin(name));
    cmd.env("FLEET_BUCKET", &n.bucket)
        .env("FLEET_WORK_QUEUE", &n.work_queue)
        .env("FLEET_WORK_DLQ", n.work_dlq())
        .env("FLEET_RESULTS_QUEUE", &n.results_queue)
        .env("FLEET_RESULTS_PARTITIONS", n.results_partitions.to_string())
        .env("FLEET_WORK_SHARDS", n.work_shards.to_string())
        .env("FLEET_TRIGGER_EXCHANGE", &n.trigger_exchange)
        .env("AMQP_URL", &n.amqp_url)
        // Roles: the controller's keyring, and each sender's own key (an operator's command signs
        // with the submitter's: it may abandon too).
        .env("FLEET_ROLE_KEYS", &role_keys().dir);
    let signer = match name {
        "processor" => Some(fleet_io::auth::Role::Processor),
        "initiator" => Some(fleet_io::auth::Role::Submitter),
        _ => None,
    };
    if let Some(role) = signer {
        cmd.env("FLEET_SIGNING_KEY_FILE", role_keys().file(role));
    }
    if std::env::var_os("AWS_ENDPOINT_URL").is_none() {
        cmd.env("AWS_ENDPOINT_URL", LOCALSTACK).env("AWS_ACCESS_KEY_ID", "test").env("AWS_SECRET_ACCESS_KEY", "test").env("AWS_REGION", "us-east-1");
    }
    cmd
}

/// The `controller` binary on a test stack, as `id` (its leases last 5 s): a process a test can kill.
pub fn controller_process(st: &Stack, id: &str, envs: &[(&str, &str)]) -> std::process::Child {
    let mut cmd = fleet_command(st, "controller");
    cmd.env("CONTROLLER_ID", id)
        .env("CONTROLLER_LEASE_SECS", "5")
        .env("CONTROLLER_SETTLE_SECS", "3")
        // A 3 s settle is far below what the start check accepts (`controller::timings`): tests wait less.
        .env("CONTROLLER_UNCHECKED_TIMINGS", "1")
        .env("LISTENER_RECEIVE_WAIT_SECS", "1")
        .env("LISTENER_MAX_IDLE_MS", "1000")
        .env("RUST_LOG", std::env::var("FLEET_TEST_CONTROLLER_LOG").unwrap_or_else(|_| "warn".into()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    cmd.envs(envs.iter().copied());
    cmd.spawn().expect("start the controller binary")
}

/// The queues and store a process of the fleet talks to (e.g. through a test's proxies).
pub struct Queues {
    pub work: Arc<dyn Queue>,
    pub work_dlq: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
    pub results_dlq: Arc<dyn Queue>,
    pub store: Arc<dyn fleet_io::blob::BlobStore>,
}

/// A processor (fast settings) and a controller on `q`, following and publishing triggers on the
/// bus `names` says, until `stop`.
pub fn start_processor_and_controller(
    names: &fleet_io::config::FleetArgs,
    q: &Queues,
    stop: &CancellationToken,
    processor: processor::Settings,
) -> (JoinHandle<fleet_io::Result<()>>, JoinHandle<fleet_io::Result<()>>, std::net::SocketAddr) {
    let controller_http = free_addr();
    let processor = tokio::spawn(processor::run(
        processor,
        processor::Deps {
            work: q.work.clone(),
            work_dlq: Some(q.work_dlq.clone()),
            results: q.results.clone(),
            store: q.store.clone(),
            triggers: names.subscribe(vec![fleet_io::trigger::work_key(q.work.name())], stop),
            publish: names.trigger_bus(),
            signing_key: Some(role_keys().key(fleet_io::auth::Role::Processor)),
        },
        stop.clone(),
    ));
    let controller = tokio::spawn(controller::run(
        controller::Settings {
            listener: fleet_engine::args::ListenerArgs { http_addr: Some(controller_http), ..fleet_engine::args::ListenerArgs::quick() },
            drain_secs: 10,
            settle_secs: 3,
            role_keys: Some(role_keys().ring.clone()),
            ..Default::default()
        },
        controller::Deps {
            results: q.results.clone(),
            work_dlq: q.work_dlq.clone(),
            results_dlq: q.results_dlq.clone(),
            store: q.store.clone(),
            work: Some(q.work.clone()),
            triggers: names.subscribe([q.results.name(), q.work_dlq.name(), q.results_dlq.name()].map(fleet_io::trigger::work_key).to_vec(), stop),
            publish: names.trigger_bus(),
        },
        stop.clone(),
    ));
    (processor, controller, controller_http)
}

/// A local address no one listens on now.
pub fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port")
}

/// GET on a service's state endpoint (`/state?depth=false`): its JSON.
pub async fn get_state(addr: &str) -> Option<serde_json::Value> {
    serde_json::from_str(get(addr, "/state?depth=false").await?.split("\r\n\r\n").nth(1)?).ok()
}

/// The whole HTTP/1.0 answer (status line, headers, body) to a GET of `path`.
pub async fn get(addr: &str, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Fast processor settings for tests.
pub fn fast_processor() -> processor::Settings {
    processor::Settings { listener: fleet_engine::args::ListenerArgs::quick(), drain_secs: 10, ..Default::default() }
}
