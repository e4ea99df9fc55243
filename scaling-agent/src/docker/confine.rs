//! Confinement of the docker backend (the socket it holds is root on the host): which containers it
//! may touch (its own compose project's and service's, no one-off) and what a new container may take
//! from its template's host config.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use bollard::models::{ContainerInspectResponse, HostConfig, Mount, MountType, PortBinding};
use bollard::query_parameters::InspectContainerOptions;
use bollard::Docker;

use super::{docker_error, short, ONEOFF, PROJECT, SERVICE};
use crate::backend::BackendError;

/// What a new processor container may take from its template's host config: network (never the
/// host's or another container's), restart and log policy, published ports (on 127.0.0.1 only), memory,
/// CPU and pid limits, a read-only root and tmpfs mounts, an init. Never binds, mounts, volumes from
/// another container, devices, privileged mode, added capabilities, the host's PID, IPC, UTS or user
/// namespace, sysctls or security options of its own: a template that has them (a compose file
/// edited by hand, a container someone else made with the same labels) cannot lend them to the
/// containers the agent makes. Every capability is dropped and new privileges are refused.
///
/// One exception, only for the host files `secrets` names (`--docker-secret-files`: the processor's
/// role key): a compose secret of the template, a read-only bind of one of those very files onto
/// `/run/secrets/NAME`, is kept (a bind mount rebuilt with nothing but its source, target and
/// read-only flag), so a new processor signs what it sends as its template does. A bind of any other
/// file (another role's key beside it included), writable, or onto another path is left out as
/// before.
///
/// Returns the confined config and the names of what was left out; an error for a network mode that
/// cannot be confined.
pub(crate) fn confined(t: &HostConfig, secrets: &[PathBuf]) -> Result<(HostConfig, Vec<&'static str>), String> {
    let network_mode = match t.network_mode.as_deref() {
        Some(m) if m == "host" || m.starts_with("container:") || m == "none" => {
            return Err(format!("the template's network mode {m:?} is not given to new containers"));
        }
        m => m.map(str::to_string),
    };
    let port_bindings = t.port_bindings.as_ref().map(|ports| {
        ports
            .iter()
            .map(|(port, bindings)| {
                let local = bindings
                    .as_ref()
                    .map(|bs| bs.iter().map(|b| PortBinding { host_ip: Some("127.0.0.1".into()), host_port: b.host_port.clone() }).collect::<Vec<_>>());
                (port.clone(), local)
            })
            .collect()
    });
    let mut dropped = Vec::new();
    let binds: Vec<String> = t.binds.iter().flatten().filter(|b| secret_bind(b, secrets)).cloned().collect();
    let mounts: Vec<Mount> = t
        .mounts
        .iter()
        .flatten()
        .filter(|m| secret_mount(m, secrets))
        .map(|m| Mount { typ: m.typ, source: m.source.clone(), target: m.target.clone(), read_only: m.read_only, ..Default::default() })
        .collect();
    let checks: [(&'static str, bool); 16] = [
        ("binds", t.binds.as_ref().is_some_and(|b| b.len() > binds.len())),
        ("mounts", t.mounts.as_ref().is_some_and(|m| m.len() > mounts.len())),
        ("volumes_from", some_vec(&t.volumes_from)),
        ("devices", some_vec(&t.devices)),
        ("device_requests", some_vec(&t.device_requests)),
        ("device_cgroup_rules", some_vec(&t.device_cgroup_rules)),
        ("privileged", t.privileged == Some(true)),
        ("cap_add", some_vec(&t.cap_add)),
        ("pid_mode", t.pid_mode.as_deref().is_some_and(|m| !m.is_empty())),
        ("ipc_mode", t.ipc_mode.as_deref().is_some_and(|m| m == "host" || m.starts_with("container:"))),
        ("uts_mode", t.uts_mode.as_deref().is_some_and(|m| !m.is_empty())),
        ("userns_mode", t.userns_mode.as_deref().is_some_and(|m| !m.is_empty())),
        ("security_opt", t.security_opt.as_ref().is_some_and(|v| v.iter().any(|o| !o.starts_with("no-new-privileges")))),
        ("sysctls", t.sysctls.as_ref().is_some_and(|m| !m.is_empty())),
        ("group_add", some_vec(&t.group_add)),
        ("publish_all_ports", t.publish_all_ports == Some(true)),
    ];
    dropped.extend(checks.iter().filter(|(_, has)| *has).map(|(name, _)| *name));
    if t.port_bindings.as_ref().is_some_and(|p| p.values().flatten().flatten().any(|b| b.host_ip.as_deref().is_some_and(|ip| ip != "127.0.0.1"))) {
        dropped.push("port_bindings beyond 127.0.0.1");
    }
    let c = HostConfig {
        network_mode,
        restart_policy: t.restart_policy.clone(),
        log_config: t.log_config.clone(),
        port_bindings,
        memory: t.memory,
        memory_reservation: t.memory_reservation,
        memory_swap: t.memory_swap,
        nano_cpus: t.nano_cpus,
        cpu_shares: t.cpu_shares,
        cpu_period: t.cpu_period,
        cpu_quota: t.cpu_quota,
        cpuset_cpus: t.cpuset_cpus.clone(),
        pids_limit: t.pids_limit,
        ulimits: t.ulimits.clone(),
        readonly_rootfs: t.readonly_rootfs,
        tmpfs: t.tmpfs.clone(),
        shm_size: t.shm_size,
        init: t.init,
        cap_drop: Some(vec!["ALL".into()]),
        security_opt: Some(vec!["no-new-privileges:true".into()]),
        binds: (!binds.is_empty()).then_some(binds),
        mounts: (!mounts.is_empty()).then_some(mounts),
        ..Default::default()
    };
    Ok((c, dropped))
}

/// Whether a file `source` on the host, bound onto `target`, is one of the `secrets` files (a plain
/// absolute path, no `..`, spelt exactly as named) bound onto `/run/secrets/NAME`.
fn secret_paths(source: &str, target: &str, secrets: &[PathBuf]) -> bool {
    let plain = |p: &Path| p.is_absolute() && p.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    let (source, target) = (Path::new(source), Path::new(target));
    plain(source)
        && secrets.iter().any(|f| plain(f) && f.as_os_str() == source.as_os_str())
        && plain(target)
        && target.parent() == Some(Path::new("/run/secrets"))
}

/// A bind `SOURCE:TARGET:OPTIONS` (compose 1.x's secrets) that is a read-only one of `secrets`.
fn secret_bind(bind: &str, secrets: &[PathBuf]) -> bool {
    let mut parts = bind.split(':');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(source), Some(target), Some(options), None) => options.split(',').any(|o| o == "ro") && secret_paths(source, target, secrets),
        _ => false,
    }
}

/// A bind mount (compose 2's secrets) that is a read-only one of `secrets`.
fn secret_mount(m: &Mount, secrets: &[PathBuf]) -> bool {
    m.typ == Some(MountType::BIND)
        && m.read_only == Some(true)
        && m.source.as_deref().zip(m.target.as_deref()).is_some_and(|(s, t)| secret_paths(s, t, secrets))
}

/// Why a container may not be touched: it is not a container of `project`'s `service` that compose
/// made for the service (a one-off `compose run` container, another project's, another service's, or
/// one without compose's labels).
pub(crate) fn foreign(labels: Option<&HashMap<String, String>>, project: &str, service: &str) -> Option<String> {
    let get = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    match (get(PROJECT), get(SERVICE), get(ONEOFF)) {
        (Some(p), Some(s), Some("False")) if p == project && s == service => None,
        (p, s, o) => Some(format!("labels project={p:?} service={s:?} oneoff={o:?}, not {project}/{service}")),
    }
}

fn some_vec<T>(v: &Option<Vec<T>>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_empty())
}

/// Refuses `action` on container `id` unless its labels are the service's (logged when refused).
pub(super) fn check(c: &ContainerInspectResponse, project: &str, service: &str, id: &str, action: &str) -> Result<(), BackendError> {
    match foreign(c.config.as_ref().and_then(|c| c.labels.as_ref()), project, service) {
        None => Ok(()),
        Some(why) => {
            tracing::warn!(container = %short(id), action, reason = %why, "refused: not a container of the service this agent scales");
            Err(BackendError::Config(format!("refused to {action} container {}: {why}", short(id))))
        }
    }
}

/// Inspects container `id` and checks that it is one of `project`'s `service` containers before
/// `action`; one that is not is refused, logged and left alone.
pub(super) async fn inspect_verified(docker: &Docker, project: &str, service: &str, id: &str, action: &str) -> Result<ContainerInspectResponse, BackendError> {
    let c = docker
        .inspect_container(id, None::<InspectContainerOptions>)
        .await
        .map_err(docker_error(format!("inspect container {} before {action}", short(id))))?;
    check(&c, project, service, id, action)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::super::{ONEOFF, PROJECT, SERVICE};
    use super::*;
    use bollard::models::{DeviceMapping, Mount, RestartPolicy, RestartPolicyNameEnum};

    #[test]
    fn a_hostile_template_lends_nothing_but_network_limits_and_local_ports() {
        let t = HostConfig {
            network_mode: Some("billing-fleet_default".into()),
            restart_policy: Some(RestartPolicy { name: Some(RestartPolicyNameEnum::UNLESS_STOPPED), maximum_retry_count: None }),
            port_bindings: Some(HashMap::from([(
                "9101/tcp".to_string(),
                Some(vec![PortBinding { host_ip: Some("0.0.0.0".into()), host_port: Some("".into()) }]),
            )])),
            memory: Some(256 << 20),
            nano_cpus: Some(500_000_000),
            binds: Some(vec!["/:/host:rw".into(), "/var/run/docker.sock:/var/run/docker.sock".into()]),
            mounts: Some(vec![Mount { source: Some("/etc".into()), target: Some("/etc-host".into()), ..Default::default() }]),
            devices: Some(vec![DeviceMapping { path_on_host: Some("/dev/sda".into()), ..Default::default() }]),
            privileged: Some(true),
            cap_add: Some(vec!["SYS_ADMIN".into()]),
            pid_mode: Some("host".into()),
            ipc_mode: Some("host".into()),
            volumes_from: Some(vec!["other".into()]),
            security_opt: Some(vec!["apparmor=unconfined".into()]),
            group_add: Some(vec!["0".into()]),
            ..Default::default()
        };
        let (c, dropped) = confined(&t, &[PathBuf::from("/srv/fleet/deploy/.keys/processor.key")]).unwrap();
        assert_eq!(c.network_mode.as_deref(), Some("billing-fleet_default"));
        assert_eq!(c.memory, Some(256 << 20));
        assert_eq!(c.nano_cpus, Some(500_000_000));
        assert!(c.restart_policy.is_some());
        let ports = c.port_bindings.unwrap();
        assert_eq!(ports["9101/tcp"].as_ref().unwrap()[0].host_ip.as_deref(), Some("127.0.0.1"), "published on loopback only");
        assert_eq!((c.binds, c.mounts, c.devices, c.volumes_from), (None, None, None, None));
        assert_eq!((c.privileged, c.cap_add, c.pid_mode, c.ipc_mode, c.group_add), (None, None, None, None, None));
        assert_eq!(c.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(c.security_opt, Some(vec!["no-new-privileges:true".to_string()]));
        for what in ["binds", "mounts", "devices", "privileged", "cap_add", "pid_mode", "ipc_mode", "volumes_from", "security_opt", "group_add"] {
            assert!(dropped.contains(&what), "{what} reported as dropped: {dropped:?}");
        }
        assert!(dropped.contains(&"port_bindings beyond 127.0.0.1"));
        for mode in ["host", "container:abc", "none"] {
            let t = HostConfig { network_mode: Some(mode.into()), ..Default::default() };
            assert!(confined(&t, &[]).is_err(), "network mode {mode} refused");
        }
        let (_, none) = confined(&HostConfig { network_mode: Some("bridge".into()), ..Default::default() }, &[]).unwrap();
        assert!(none.is_empty(), "{none:?}");
    }

    /// A template's compose secret that is one of the named files (the processor's role key) is
    /// kept, read-only, whether compose made it a bind (1.x) or a mount (2.x, rebuilt without its
    /// bind options); another file beside it (another role's key), every other bind or mount, and
    /// every secret when no file is named, are left out.
    #[test]
    fn only_the_named_read_only_secrets_are_kept() {
        let named = [PathBuf::from("/srv/fleet/deploy/.keys/processor.key")];
        let key = "/srv/fleet/deploy/.keys/processor.key:/run/secrets/processor.key:ro";
        let mount = |source: &str, target: &str, ro: bool| Mount {
            typ: Some(MountType::BIND),
            source: Some(source.into()),
            target: Some(target.into()),
            read_only: Some(ro),
            ..Default::default()
        };
        let t = HostConfig {
            binds: Some(vec![
                key.into(),
                "/srv/fleet/deploy/.keys/processor.key:/run/secrets/processor.key:rw".into(),
                "/srv/fleet/deploy/.keys/processor.key:/run/secrets/processor.key".into(),
                "/srv/fleet/deploy/.keys/submitter.key:/run/secrets/processor.key:ro".into(),
                "/srv/fleet/deploy/.keys/../../etc/shadow:/run/secrets/processor.key:ro".into(),
                "/srv/fleet/deploy/.keys/./processor.key:/run/secrets/p.key:ro".into(),
                "/etc/shadow:/run/secrets/shadow:ro".into(),
                "/srv/fleet/deploy/.keys/processor.key:/etc/processor.key:ro".into(),
                "/srv/fleet/deploy/.keys/processor.key:/run/secrets/../processor.key:ro".into(),
            ]),
            mounts: Some(vec![
                Mount {
                    bind_options: Some(bollard::models::MountBindOptions { create_mountpoint: Some(true), ..Default::default() }),
                    ..mount("/srv/fleet/deploy/.keys/processor.key", "/run/secrets/processor.key", true)
                },
                mount("/srv/fleet/deploy/.keys/controller.key", "/run/secrets/controller.key", true),
                mount("/srv/fleet/deploy/.keys/processor.key", "/run/secrets/c.key", false),
                mount("/", "/run/secrets/root", true),
                Mount { typ: Some(MountType::VOLUME), ..mount("/srv/fleet/deploy/.keys/processor.key", "/run/secrets/a.key", true) },
            ]),
            ..Default::default()
        };
        let (c, dropped) = confined(&t, &named).unwrap();
        assert_eq!(c.binds, Some(vec![key.to_string()]));
        let mounts = c.mounts.unwrap();
        assert_eq!(mounts.len(), 1, "{mounts:?}");
        assert_eq!(mounts[0], mount("/srv/fleet/deploy/.keys/processor.key", "/run/secrets/processor.key", true), "kept without its bind options");
        assert!(dropped.contains(&"binds") && dropped.contains(&"mounts"), "{dropped:?}");
        let only = HostConfig { binds: Some(vec![key.into()]), ..Default::default() };
        let (c, dropped) = confined(&only, &named).unwrap();
        assert_eq!((c.binds.map(|b| b.len()), dropped.len()), (Some(1), 0), "{dropped:?}");
        let (c, dropped) = confined(&only, &[]).unwrap();
        assert_eq!((c.binds, dropped), (None, vec!["binds"]), "without --docker-secret-files nothing is kept");
        let (c, _) = confined(&only, &[PathBuf::from("/srv/fleet/deploy/.keys")]).unwrap();
        assert_eq!(c.binds, None, "naming the directory names none of its files");
    }

    #[test]
    fn only_the_services_own_compose_containers_may_be_touched() {
        let labels = |p: &str, s: &str, o: Option<&str>| {
            let mut m = HashMap::from([(PROJECT.to_string(), p.to_string()), (SERVICE.to_string(), s.to_string())]);
            if let Some(o) = o {
                m.insert(ONEOFF.to_string(), o.to_string());
            }
            m
        };
        assert_eq!(foreign(Some(&labels("fleet", "processor", Some("False"))), "fleet", "processor"), None);
        for (l, why) in [
            (labels("other", "processor", Some("False")), "another project"),
            (labels("fleet", "controller", Some("False")), "another service"),
            (labels("fleet", "processor", Some("True")), "a one-off"),
            (labels("fleet", "processor", None), "no one-off label"),
            (HashMap::new(), "no labels"),
        ] {
            assert!(foreign(Some(&l), "fleet", "processor").is_some(), "{why}");
        }
        assert!(foreign(None, "fleet", "processor").is_some(), "no config at all");
    }
}
