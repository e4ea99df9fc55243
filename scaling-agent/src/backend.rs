//! Scaling backends: what starts and stops processor instances once the policy has decided. `none`
//! decides and reports only (a dry run: it takes the desired count as done); `process` runs processors
//! as child processes of the agent (the fleet of `deploy/local.sh`), stopping one with SIGTERM and
//! letting it drain. The `docker` ([`crate::docker`]) and `keda` ([`crate::keda`]) backends live in
//! their own modules.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;
use tokio::time::Instant;

/// A backend's failure (the agent logs it and tries again at its next decision).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("could not start {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("could not signal process {pid}: {source}")]
    Signal { pid: u32, source: nix::Error },
    #[error("docker: could not {what}: {message}")]
    Docker { what: String, message: String },
    #[error("{0}")]
    Config(String),
}

/// Starts and stops processor instances.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    /// Instances running and not stopping.
    async fn actual(&self) -> Result<u32, BackendError>;
    /// Starts or stops instances until `desired` run (stopping ones drain on their own).
    async fn scale(&self, desired: u32) -> Result<(), BackendError>;
    /// Instances stopping (draining) now.
    async fn stopping(&self) -> u32 {
        0
    }
    /// The agent is stopping: what the backend started stops too (process backend), or is left
    /// running (the others).
    async fn shutdown(&self) {}
    /// A work-detected trigger for the work queue arrived (before the agent's next look decides): a
    /// backend that can act at once does (`keda` pushes "active").
    fn work_detected(&self) {}

    /// The work items one instance clears within the SLA, after each decision (throughput x SLA; the
    /// measured throughput once instances report it). The keda backend serves it as its target.
    fn sla_target(&self, _items_per_instance: f64) {}
}

/// Decides and reports only: the desired count is taken as done.
#[derive(Debug, Default)]
pub struct NoneBackend {
    desired: AtomicU32,
}

impl NoneBackend {
    pub fn new(initial: u32) -> NoneBackend {
        NoneBackend { desired: AtomicU32::new(initial) }
    }
}

#[async_trait]
impl Backend for NoneBackend {
    fn name(&self) -> &'static str {
        "none"
    }

    async fn actual(&self) -> Result<u32, BackendError> {
        Ok(self.desired.load(Ordering::SeqCst))
    }

    async fn scale(&self, desired: u32) -> Result<(), BackendError> {
        self.desired.store(desired, Ordering::SeqCst);
        Ok(())
    }
}

/// How the process backend starts a processor.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    /// The processor binary.
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Environment set on top of the agent's own (which the instances inherit).
    pub envs: Vec<(String, String)>,
    /// Instance `slot` (0, 1, ...) serves its state endpoint on this port + slot.
    pub http_base: Option<u16>,
    /// Each instance appends its output to `processor-{slot}.log` here (default: the agent's output).
    pub log_dir: Option<PathBuf>,
    /// A stopping instance gets this long to drain before it is killed.
    pub drain: Duration,
}

struct Running {
    slot: u32,
    pid: u32,
    child: Child,
    stopping: Option<Instant>,
}

/// Processors as child processes of the agent.
pub struct ProcessBackend {
    spec: ProcessSpec,
    children: Mutex<Vec<Running>>,
}

/// A child's state, for `/state`.
#[derive(Debug, Clone, Serialize)]
pub struct ChildView {
    pub slot: u32,
    pub pid: u32,
    pub stopping: bool,
}

impl ProcessBackend {
    pub fn new(spec: ProcessSpec) -> ProcessBackend {
        ProcessBackend { spec, children: Mutex::new(Vec::new()) }
    }

    /// Forgets children that exited; kills those that overran their drain.
    fn reap(&self, children: &mut Vec<Running>) {
        let drain = self.spec.drain + Duration::from_secs(5);
        children.retain_mut(|c| match c.child.try_wait() {
            Ok(Some(status)) => {
                if c.stopping.is_none() {
                    tracing::warn!(slot = c.slot, pid = c.pid, %status, "processor exited on its own");
                } else {
                    tracing::info!(slot = c.slot, pid = c.pid, %status, "processor stopped");
                }
                false
            }
            Ok(None) => {
                if c.stopping.is_some_and(|t| t.elapsed() > drain) {
                    tracing::warn!(slot = c.slot, pid = c.pid, "processor did not drain in time; killing it");
                    let _ = c.child.start_kill();
                }
                true
            }
            Err(e) => {
                tracing::warn!(slot = c.slot, pid = c.pid, error = %e, "could not check a processor");
                true
            }
        });
    }

    fn spawn(&self, slot: u32) -> Result<Running, BackendError> {
        let s = &self.spec;
        let mut cmd = Command::new(&s.program);
        cmd.args(&s.args).envs(s.envs.iter().map(|(k, v)| (k, v))).stdin(Stdio::null()).kill_on_drop(true);
        match s.http_base {
            Some(base) => cmd.env("LISTENER_HTTP_ADDR", format!("127.0.0.1:{}", u32::from(base) + slot)),
            None => cmd.env_remove("LISTENER_HTTP_ADDR"),
        };
        if let Some(dir) = &s.log_dir {
            let open = || std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("processor-{slot}.log")));
            let err = |source| BackendError::Spawn { program: s.program.display().to_string(), source };
            cmd.stdout(open().map_err(err)?).stderr(open().map_err(err)?);
        }
        let child = cmd.spawn().map_err(|source| BackendError::Spawn { program: s.program.display().to_string(), source })?;
        let pid = child.id().unwrap_or(0);
        tracing::info!(slot, pid, "processor started");
        Ok(Running { slot, pid, child, stopping: None })
    }

    fn terminate(c: &mut Running) -> Result<(), BackendError> {
        c.stopping = Some(Instant::now());
        tracing::info!(slot = c.slot, pid = c.pid, "stopping processor (SIGTERM, drain)");
        match kill(Pid::from_raw(c.pid as i32), Signal::SIGTERM) {
            Ok(()) | Err(nix::Error::ESRCH) => Ok(()),
            Err(source) => Err(BackendError::Signal { pid: c.pid, source }),
        }
    }

    /// The children now.
    pub async fn children(&self) -> Vec<ChildView> {
        let mut ch = self.children.lock().await;
        self.reap(&mut ch);
        ch.iter().map(|c| ChildView { slot: c.slot, pid: c.pid, stopping: c.stopping.is_some() }).collect()
    }
}

#[async_trait]
impl Backend for ProcessBackend {
    fn name(&self) -> &'static str {
        "process"
    }

    async fn actual(&self) -> Result<u32, BackendError> {
        let mut ch = self.children.lock().await;
        self.reap(&mut ch);
        Ok(ch.iter().filter(|c| c.stopping.is_none()).count() as u32)
    }

    async fn stopping(&self) -> u32 {
        self.children.lock().await.iter().filter(|c| c.stopping.is_some()).count() as u32
    }

    async fn scale(&self, desired: u32) -> Result<(), BackendError> {
        let mut ch = self.children.lock().await;
        self.reap(&mut ch);
        let running = ch.iter().filter(|c| c.stopping.is_none()).count() as u32;
        if desired > running {
            for _ in running..desired {
                // The lowest free slot (a stopping instance still holds its port).
                let slot = (0..).find(|s| ch.iter().all(|c| c.slot != *s)).unwrap_or(0);
                let r = self.spawn(slot)?;
                ch.push(r);
            }
        } else if desired < running {
            // The newest instances stop first (slot 0, with the well-known state port, stays).
            let mut live: Vec<&mut Running> = ch.iter_mut().filter(|c| c.stopping.is_none()).collect();
            live.sort_by_key(|c| std::cmp::Reverse(c.slot));
            for c in live.into_iter().take((running - desired) as usize) {
                Self::terminate(c)?;
            }
        }
        Ok(())
    }

    async fn shutdown(&self) {
        let mut ch = self.children.lock().await;
        for c in ch.iter_mut().filter(|c| c.stopping.is_none()) {
            if let Err(e) = Self::terminate(c) {
                tracing::warn!(error = %e, "could not stop a processor");
            }
        }
        let deadline = Instant::now() + self.spec.drain + Duration::from_secs(5);
        for c in ch.iter_mut() {
            match tokio::time::timeout_at(deadline, c.child.wait()).await {
                Ok(_) => tracing::info!(slot = c.slot, pid = c.pid, "processor stopped"),
                Err(_) => {
                    tracing::warn!(slot = c.slot, pid = c.pid, "processor did not drain in time; killing it");
                    let _ = c.child.kill().await;
                }
            }
        }
        ch.clear();
    }
}
