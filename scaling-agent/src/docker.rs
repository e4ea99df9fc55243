//! The `docker` backend: scales a compose service's containers (the processors of
//! `deploy/docker-compose.yml`) through the Docker Engine API.
//!
//! A container it adds is a copy of a running one of the service (image, command, environment, labels
//! with the next `com.docker.compose.container-number`, host config, networks with the service's alias),
//! named as compose names them, so `docker compose ps` lists it and a later `compose up` with the same
//! scale keeps it (the config hash is the template's). Scaling down stops the highest-numbered
//! containers as compose does: `docker stop` sends SIGTERM and waits the container's own grace period
//! (compose's `stop_grace_period`, above the processor's drain), then the container is removed. Scaling
//! up starts the service's stopped containers first (one a user stopped, say), then adds new ones.
//!
//! The socket is root on the host, so the backend is scoped: every container is inspected and its
//! compose project, service and one-off labels checked before it is started, stopped or removed (a
//! mismatch is refused and logged, the container left alone), and a new container gets only a
//! [`confined`] copy of the template's host config: no binds, mounts, devices, privileges or host
//! namespaces, every capability dropped and no new privileges; only the template's read-only compose
//! secrets of the host files `--docker-secret-files` names (the processor's role key) are kept.
//!
//! With a targets file ([`targets`]), every listing of the service's containers also keeps a
//! Prometheus file_sd file of the running ones up to date, for a Prometheus without the socket. The
//! `none` backend in a compose project keeps it too ([`TargetsOnly`]): it decides only, the count is
//! the user's, and the file follows the containers there are.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerSummary, ContainerSummaryStateEnum, EndpointSettings, NetworkConnectRequest, NetworkingConfig,
};
use bollard::query_parameters::{CreateContainerOptions, InspectContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions};
use bollard::Docker;
use tokio_util::task::TaskTracker;

use crate::backend::{Backend, BackendError, NoneBackend};

mod confine;
pub mod targets;
use confine::{confined, inspect_verified};
use targets::{Target, TargetsFile};

const PROJECT: &str = "com.docker.compose.project";
const SERVICE: &str = "com.docker.compose.service";
const NUMBER: &str = "com.docker.compose.container-number";
const ONEOFF: &str = "com.docker.compose.oneoff";

/// Scales the containers of one compose service.
pub struct DockerBackend {
    docker: Docker,
    project: String,
    service: String,
    /// The last container of the service seen running: what a new one copies (kept for a scale from
    /// zero).
    template: Mutex<Option<ContainerInspectResponse>>,
    /// Containers being stopped (draining), by id.
    stopping: Arc<Mutex<HashSet<String>>>,
    stops: TaskTracker,
    /// The template's dropped settings were logged (once).
    warned: std::sync::atomic::AtomicBool,
    /// Where the running containers are written for Prometheus (`--prometheus-targets-file`).
    targets: Option<TargetsFile>,
    /// Each running container's state endpoint port by id, read once (`None`: it serves none).
    ports: Mutex<HashMap<String, Option<u16>>>,
    /// The last write of the targets file failed (logged once until one succeeds).
    targets_failing: std::sync::atomic::AtomicBool,
    /// The host files a new container keeps when its template has them as compose secrets
    /// (`--docker-secret-files`).
    secret_files: Vec<PathBuf>,
}

fn docker_error(what: impl Into<String>) -> impl FnOnce(bollard::errors::Error) -> BackendError {
    let what = what.into();
    move |e| BackendError::Docker { what, message: e.to_string() }
}

impl DockerBackend {
    /// Connects to the Docker Engine (`DOCKER_HOST` or the local socket), agreeing on an API version
    /// the engine speaks. `project` unset: the compose project of the container the agent runs in.
    /// `targets_file`: where to keep the Prometheus file_sd list of the running containers (written
    /// at once, then whenever the set changes).
    pub async fn connect(project: Option<String>, service: String, targets_file: Option<PathBuf>) -> Result<DockerBackend, BackendError> {
        let docker = Docker::connect_with_local_defaults().map_err(docker_error("connect to the Docker Engine"))?;
        let docker = docker.negotiate_version().await.map_err(docker_error("reach the Docker Engine"))?;
        let project = match project {
            Some(p) => p,
            None => Self::own_project(&docker).await?,
        };
        let targets = targets_file.map(|path| TargetsFile::new(path, service.clone()));
        let b = DockerBackend {
            docker,
            project,
            service,
            template: Mutex::new(None),
            stopping: Arc::default(),
            stops: TaskTracker::new(),
            warned: Default::default(),
            targets,
            ports: Mutex::default(),
            targets_failing: Default::default(),
            secret_files: Vec::new(),
        };
        let running = b.containers().await?.serving.len();
        tracing::info!(project = %b.project, service = %b.service, running, targets_file = ?b.targets.as_ref().map(|t| t.path().display().to_string()),
            "docker backend: connected to the compose service's containers");
        Ok(b)
    }

    /// New containers keep their template's compose secrets that are these host files (see
    /// [`confined`]): the processors' role key.
    pub fn keep_secret_files(mut self, files: Vec<PathBuf>) -> DockerBackend {
        if !files.is_empty() {
            tracing::info!(files = ?files, "docker backend: new containers keep their template's read-only secrets of these files");
        }
        self.secret_files = files;
        self
    }

    /// The compose project of the container this process runs in (its hostname is the container id).
    async fn own_project(docker: &Docker) -> Result<String, BackendError> {
        let host = std::env::var("HOSTNAME").ok().or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()));
        let missing = || BackendError::Config("the compose project is unknown: the agent runs outside a compose container; set --docker-project".into());
        let host = host.filter(|h| !h.is_empty()).ok_or_else(missing)?;
        let me = docker.inspect_container(&host, None::<InspectContainerOptions>).await.map_err(|_| missing())?;
        me.config.and_then(|c| c.labels).and_then(|mut l| l.remove(PROJECT)).ok_or_else(missing)
    }

    /// The service's containers (`all`: also those not running), one-off ones (`compose run`) left out.
    async fn list(&self, all: bool) -> Result<Vec<ContainerSummary>, BackendError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{PROJECT}={}", self.project), format!("{SERVICE}={}", self.service), format!("{ONEOFF}=False")],
        )]);
        let opts = ListContainersOptions { all, filters: Some(filters), ..Default::default() };
        self.docker.list_containers(Some(opts)).await.map_err(docker_error(format!("list the {} containers", self.service)))
    }

    /// Inspects container `id` and checks that it is one of the service's own (see [`foreign`]) before
    /// the backend does `action` to it; a container that is not is refused, logged and left alone.
    async fn verified(&self, id: &str, action: &str) -> Result<ContainerInspectResponse, BackendError> {
        inspect_verified(&self.docker, &self.project, &self.service, id, action).await
    }

    /// One listing of the service's containers, split: running and not being stopped, stopped (exited
    /// or never started) and not being stopped, each by container number; and the highest number used.
    async fn containers(&self) -> Result<Containers, BackendError> {
        let stopping = self.stopping.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut c = Containers::default();
        let listed = self.list(true).await?;
        if self.targets.is_some() {
            self.publish_targets(&listed).await;
        }
        for s in listed {
            let n = number(&s);
            c.highest = c.highest.max(n);
            let Some(id) = s.id.filter(|id| !stopping.contains(id)) else { continue };
            match s.state {
                Some(ContainerSummaryStateEnum::RUNNING) => c.serving.push((n, id)),
                Some(ContainerSummaryStateEnum::EXITED | ContainerSummaryStateEnum::CREATED) => c.stopped.push((n, id)),
                _ => {}
            }
        }
        c.serving.sort();
        c.stopped.sort();
        Ok(c)
    }

    /// Keeps the targets file at the service's running containers (draining ones too: they serve
    /// metrics until they exit). A container's port is read once (an inspect); one that cannot be
    /// inspected now is left out until the next listing. A failed write is logged and tried again at
    /// the next listing: scaling goes on regardless.
    async fn publish_targets(&self, listed: &[ContainerSummary]) {
        let Some(file) = &self.targets else { return };
        let running: Vec<(String, String)> = listed
            .iter()
            .filter(|s| s.state == Some(ContainerSummaryStateEnum::RUNNING))
            .filter_map(|s| {
                let name = s.names.as_ref()?.first()?.trim_start_matches('/').to_string();
                Some((s.id.clone()?, name))
            })
            .collect();
        let unknown: Vec<String> = {
            let mut ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
            ports.retain(|id, _| running.iter().any(|(r, _)| r == id));
            running.iter().filter(|(id, _)| !ports.contains_key(id)).map(|(id, _)| id.clone()).collect()
        };
        for id in unknown {
            match self.docker.inspect_container(&id, None::<InspectContainerOptions>).await {
                Ok(c) => {
                    let port = c.config.and_then(|c| c.env).and_then(|env| targets::http_port(&env));
                    if port.is_none() {
                        tracing::warn!(container = %short(&id), "a running container has no {} port: not in the Prometheus targets", targets::HTTP_ADDR_ENV);
                    }
                    self.ports.lock().unwrap_or_else(|e| e.into_inner()).insert(id, port);
                }
                Err(e) => {
                    tracing::debug!(container = %short(&id), error = %e, "could not inspect a container for its metrics port; tried again at the next look")
                }
            }
        }
        let found: Vec<Target> = {
            let ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
            running.into_iter().filter_map(|(id, container)| Some(Target { container, port: (*ports.get(&id)?)? })).collect()
        };
        use std::sync::atomic::Ordering::Relaxed;
        match file.update(&found) {
            Ok(true) => {
                self.targets_failing.store(false, Relaxed);
                tracing::info!(path = %file.path().display(), targets = found.len(), "Prometheus targets file written");
            }
            Ok(false) => {}
            Err(e) => {
                if !self.targets_failing.swap(true, Relaxed) {
                    tracing::warn!(path = %file.path().display(), error = %e, "could not write the Prometheus targets file; trying again at each look");
                }
            }
        }
    }

    /// Adds one container numbered `n`, copied from `t`, and starts it.
    async fn add(&self, t: &ContainerInspectResponse, n: u32) -> Result<String, BackendError> {
        let config = t.config.clone().unwrap_or_default();
        let template_name = t.name.as_deref().unwrap_or_default().trim_start_matches('/');
        // compose v1 names containers project_service_N, v2 project-service-N.
        let v1 = template_name.starts_with(&format!("{}_{}_", self.project, self.service));
        let name = if v1 { format!("{}_{}_{n}", self.project, self.service) } else { format!("{}-{}-{n}", self.project, self.service) };
        let mut labels = config.labels.clone().unwrap_or_default();
        labels.insert(NUMBER.into(), n.to_string());
        let (host_config, dropped) = confined(&t.host_config.clone().unwrap_or_default(), &self.secret_files).map_err(BackendError::Config)?;
        if !dropped.is_empty() && !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(?dropped, template = %template_name, "the template's host config has settings new processor containers do not get");
        }
        let host_config = Some(host_config);
        // The service's networks, each with the service name as alias (as compose attaches them): the one
        // the container is created on (its network mode) first.
        let mut networks: Vec<String> = t.network_settings.as_ref().and_then(|s| s.networks.as_ref()).map(|m| m.keys().cloned().collect()).unwrap_or_default();
        networks.sort();
        if let Some(mode) = host_config.as_ref().and_then(|h| h.network_mode.clone()) {
            if let Some(i) = networks.iter().position(|n| *n == mode) {
                let first = networks.remove(i);
                networks.insert(0, first);
            }
        }
        let endpoint = || EndpointSettings { aliases: Some(vec![self.service.clone()]), ..Default::default() };
        let body = ContainerCreateBody {
            user: config.user,
            exposed_ports: config.exposed_ports,
            env: config.env,
            cmd: config.cmd,
            healthcheck: config.healthcheck,
            image: config.image,
            working_dir: config.working_dir,
            entrypoint: config.entrypoint,
            labels: Some(labels),
            stop_signal: config.stop_signal,
            stop_timeout: config.stop_timeout,
            host_config,
            networking_config: networks.first().map(|n| NetworkingConfig { endpoints_config: Some(HashMap::from([(n.clone(), endpoint())])) }),
            ..Default::default()
        };
        let created = self
            .docker
            .create_container(Some(CreateContainerOptions { name: Some(name.clone()), ..Default::default() }), body)
            .await
            .map_err(docker_error(format!("create container {name}")))?;
        for net in networks.iter().skip(1) {
            let req = NetworkConnectRequest { container: created.id.clone(), endpoint_config: Some(endpoint()) };
            self.docker.connect_network(net, req).await.map_err(docker_error(format!("connect {name} to network {net}")))?;
        }
        self.verified(&created.id, "start").await?;
        self.docker.start_container(&created.id, None).await.map_err(docker_error(format!("start container {name}")))?;
        tracing::info!(container = %name, "started a processor container");
        Ok(name)
    }

    /// Stops a container (SIGTERM, then its grace period) and removes it, in the background.
    /// Checked again before the removal: the id could name another container by then.
    fn stop(&self, id: String) {
        self.stopping.lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone());
        let docker = self.docker.clone();
        let stopping = self.stopping.clone();
        let (project, service) = (self.project.clone(), self.service.clone());
        self.stops.spawn(async move {
            let t = Instant::now();
            let stopped = async {
                inspect_verified(&docker, &project, &service, &id, "stop").await?;
                docker.stop_container(&id, None::<StopContainerOptions>).await.map_err(docker_error(format!("stop container {}", short(&id))))?;
                let c = inspect_verified(&docker, &project, &service, &id, "remove").await?;
                let code = c.state.and_then(|s| s.exit_code);
                tracing::info!(container = %short(&id), exit_code = ?code, secs = t.elapsed().as_secs_f64(), "processor container stopped");
                let opts = RemoveContainerOptions { v: true, ..Default::default() };
                docker.remove_container(&id, Some(opts)).await.map_err(docker_error(format!("remove container {}", short(&id))))
            };
            if let Err(e) = stopped.await {
                tracing::warn!(container = %short(&id), error = %e, "could not stop and remove a processor container");
            }
            stopping.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        });
    }
}

/// The service's containers, as [`DockerBackend::containers`] splits them.
#[derive(Default)]
struct Containers {
    serving: Vec<(u32, String)>,
    stopped: Vec<(u32, String)>,
    highest: u32,
}

fn number(c: &ContainerSummary) -> u32 {
    c.labels.as_ref().and_then(|l| l.get(NUMBER)).and_then(|n| n.parse().ok()).unwrap_or(0)
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

#[async_trait]
impl Backend for DockerBackend {
    fn name(&self) -> &'static str {
        "docker"
    }

    async fn actual(&self) -> Result<u32, BackendError> {
        Ok(self.containers().await?.serving.len() as u32)
    }

    async fn stopping(&self) -> u32 {
        self.stopping.lock().unwrap_or_else(|e| e.into_inner()).len() as u32
    }

    async fn scale(&self, desired: u32) -> Result<(), BackendError> {
        let Containers { serving, stopped, highest } = self.containers().await?;
        let n = serving.len() as u32;
        if desired < n {
            // The newest (highest-numbered) first, as compose scales down.
            for (_, id) in serving.iter().rev().take((n - desired) as usize) {
                tracing::info!(container = %short(id), "stopping a processor container (SIGTERM, then it drains)");
                self.stop(id.clone());
            }
            return Ok(());
        }
        // Stopped containers of the service first, lowest number first, as compose does (so a later
        // `compose up` at this scale finds the same containers and changes nothing).
        let mut missing = desired - n;
        for (_, id) in stopped.into_iter().take(missing as usize) {
            self.verified(&id, "start").await?;
            self.docker.start_container(&id, None).await.map_err(docker_error(format!("start container {}", short(&id))))?;
            tracing::info!(container = %short(&id), "started a stopped processor container again");
            missing -= 1;
        }
        if missing == 0 {
            return Ok(());
        }
        if let Some((_, id)) = serving.first() {
            let t = self.verified(id, "copy").await?;
            *self.template.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        }
        let template = self.template.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(|| {
            BackendError::Config(format!("no running {} container of project {} to copy; start one (compose up)", self.service, self.project))
        })?;
        for next in highest + 1..=highest + missing {
            self.add(&template, next).await?;
        }
        Ok(())
    }

    /// The containers stay (they are the compose project's); stops under way finish first.
    async fn shutdown(&self) {
        self.stops.close();
        self.stops.wait().await;
    }
}

/// The `none` backend (decide and report only) with the docker backend's targets file: the file
/// follows the service's running containers at each of the agent's looks, and nothing is started or
/// stopped.
pub struct TargetsOnly {
    none: NoneBackend,
    docker: DockerBackend,
}

impl TargetsOnly {
    /// `docker` must have a targets file ([`DockerBackend::connect`] with one).
    pub fn new(none: NoneBackend, docker: DockerBackend) -> TargetsOnly {
        TargetsOnly { none, docker }
    }
}

#[async_trait]
impl Backend for TargetsOnly {
    fn name(&self) -> &'static str {
        "none"
    }

    async fn actual(&self) -> Result<u32, BackendError> {
        // Only for the targets file: the count stays the none backend's (the desired one).
        if let Err(e) = self.docker.containers().await {
            tracing::debug!(error = %e, "could not list the containers for the Prometheus targets file; tried again at the next look");
        }
        self.none.actual().await
    }

    async fn scale(&self, desired: u32) -> Result<(), BackendError> {
        self.none.scale(desired).await
    }
}
