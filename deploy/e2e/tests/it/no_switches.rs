//! No mutation switch in a user's binary: the controller binary of this build (the one every test
//! here runs, built as `cargo build --workspace` builds it) carries none of the harness's fixes and
//! never reads `CONTROLLER_UNDO` (`controller_core::undo`: the switches are compiled in only by
//! `controller-core-undoable`, which `controller-undoable` links; the fixes' names come from there).

use memchr::memmem;

#[test]
fn the_controller_binary_has_no_mutation_switch() {
    let path = fleet_test_support::bin("controller");
    let exe = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let has = |s: &str| memmem::find(&exe, s.as_bytes()).is_some();
    // The control: the search finds what the binary does read.
    assert!(has("CONTROLLER_ID"), "{}: the search finds no CONTROLLER_ID", path.display());
    assert!(!has("CONTROLLER_UNDO"), "{} reads CONTROLLER_UNDO", path.display());
    let compiled_in: Vec<&str> = controller_undoable::undo::Fix::ALL.iter().map(|f| f.name()).filter(|n| has(n)).collect();
    assert!(compiled_in.is_empty(), "{} names the fixes {compiled_in:?}", path.display());
}

/// Every package a build of `args` compiles, with its features (one entry per distinct compile: a
/// package built as a build dependency with other features is another entry), as `cargo tree`
/// resolves them.
fn resolved(args: &[&str]) -> std::collections::BTreeSet<(String, String)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(["tree", "--locked", "--offline", "-e", "normal,build", "--prefix", "none", "-f", "{p}|{f}"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim_end_matches(" (*)").split_once('|'))
        .map(|(p, f)| (p.to_string(), f.to_string()))
        .collect()
}

/// One feature set for every build of the services: `cargo build --workspace` (which also builds
/// the simulation and the tests' crates) resolves every package of the services with the features a
/// build of the four services alone gives it (deploy/local.sh's, the image's), so switching between
/// them recompiles nothing, and no member turns on a feature in a service's build that the services'
/// own build does not have.
#[test]
fn every_build_of_the_services_resolves_the_same_features() {
    let services = resolved(&["-p", "initiator", "-p", "processor", "-p", "controller", "-p", "scaling-agent"]);
    let workspace = resolved(&["--workspace"]);
    assert!(services.len() > 100, "{} packages", services.len());
    let differ: Vec<String> = services
        .difference(&workspace)
        .map(|(p, f)| {
            let there: Vec<&str> = workspace.iter().filter(|(w, _)| w == p).map(|(_, f)| f.as_str()).collect();
            format!("{p}: [{f}] alone, {there:?} in the workspace")
        })
        .collect();
    assert!(differ.is_empty(), "features differ:\n{}", differ.join("\n"));
}

/// The controller core decides without I/O: it depends directly on the domain's types, serde,
/// tracing and byte buffers only, and nothing in its dependency tree reaches a store, a queue, a
/// broker, the network or an async runtime (nor the controller that drives it).
#[test]
fn the_controller_core_depends_on_no_io() {
    let tree = resolved(&["-p", "controller-core"]);
    let name = |p: &str| p.split(' ').next().unwrap_or("").to_string();
    assert!(tree.iter().any(|(p, _)| name(p) == "controller-core"), "{tree:?}");
    let direct = resolved(&["-p", "controller-core", "--depth", "1"]);
    let direct: std::collections::BTreeSet<String> = direct.iter().map(|(p, _)| name(p)).collect();
    let allowed = ["controller-core", "bytes", "fleet-domain", "serde", "thiserror", "tracing"];
    assert_eq!(direct, allowed.iter().map(|s| s.to_string()).collect(), "the controller core's own dependencies");
    let io = |n: &str| {
        ["tokio", "futures", "mio", "socket2", "hyper", "h2", "reqwest", "lapin", "amq-protocol", "rustls", "fleet-io", "fleet-engine", "controller"]
            .iter()
            .any(|d| n == *d || n.starts_with(&format!("{d}-")))
            || n.starts_with("aws-")
    };
    let reached: Vec<String> = tree.iter().map(|(p, _)| name(p)).filter(|n| n != "controller-core" && io(n)).collect();
    assert!(reached.is_empty(), "the controller core reaches {reached:?}");
}
