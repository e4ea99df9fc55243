//! `deploy/k8s/`: every manifest parses, and the fields the fleet relies on agree with each other: the
//! ScaledObject scales the processor Deployment through the agent's Service and gRPC port, its
//! fallback trigger has pod-identity authentication and the SLA-derived target, the processor's grace
//! period exceeds its drain, and KEDA's bounds match the agent's. And what a security review asks of
//! them: every pod passes the restricted Pod Security Standard, probes hit real health, one account
//! per service, two controllers with a rolling update and a disruption budget, a default-deny network
//! policy, and no Secret committed.

use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

fn docs() -> Vec<Yaml> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s");
    let mut all = Vec::new();
    for f in ["fleet.yaml", "keda.yaml"] {
        let text = std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        let docs = YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{f}: not YAML: {e}"));
        for d in docs {
            assert!(d["apiVersion"].as_str().is_some() && d["kind"].as_str().is_some(), "{f}: a document without apiVersion/kind: {d:?}");
            assert!(d["metadata"]["name"].as_str().is_some(), "{f}: a document without a name");
            all.push(d);
        }
    }
    all
}

fn find<'a>(docs: &'a [Yaml], kind: &str, name: &str) -> &'a Yaml {
    docs.iter().find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name)).unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn container(deploy: &Yaml) -> &Yaml {
    &deploy["spec"]["template"]["spec"]["containers"][0]
}

fn env<'a>(c: &'a Yaml, name: &str) -> Option<&'a str> {
    c["env"].as_vec()?.iter().find(|e| e["name"].as_str() == Some(name))?["value"].as_str()
}

fn port(c: &Yaml, name: &str) -> i64 {
    c["ports"].as_vec().unwrap().iter().find(|p| p["name"].as_str() == Some(name)).unwrap_or_else(|| panic!("no port {name}"))["containerPort"]
        .as_i64()
        .unwrap()
}

#[test]
fn the_manifests_agree_on_what_the_fleet_relies_on() {
    let docs = docs();
    let ns = find(&docs, "Namespace", "billing-fleet")["metadata"]["name"].as_str().unwrap();
    for d in &docs {
        if d["kind"].as_str() != Some("Namespace") {
            assert_eq!(d["metadata"]["namespace"].as_str(), Some(ns), "{:?} is outside the namespace", d["metadata"]["name"]);
        }
    }

    // Every Deployment's selector matches its pod labels, and it runs the fleet binary of its name
    // under a ServiceAccount with an IRSA role.
    for name in ["processor", "controller", "scaling-agent"] {
        let d = find(&docs, "Deployment", name);
        let sel = d["spec"]["selector"]["matchLabels"].as_hash().unwrap();
        let labels = d["spec"]["template"]["metadata"]["labels"].as_hash().unwrap();
        for (k, v) in sel {
            assert_eq!(labels.get(k), Some(v), "{name}: selector {k:?} does not match the pod labels");
        }
        assert_eq!(container(d)["args"][0].as_str(), Some(name), "{name}: the container runs another binary");
        let sa = d["spec"]["template"]["spec"]["serviceAccountName"].as_str().unwrap();
        let account = find(&docs, "ServiceAccount", sa);
        assert!(account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].as_str().is_some(), "{sa}: no IRSA role");
    }

    // The processor: KEDA owns the count; SIGKILL only well after the drain.
    let processor = find(&docs, "Deployment", "processor");
    assert!(processor["spec"]["replicas"].is_badvalue(), "the processor Deployment sets replicas (KEDA owns them)");
    let drain: i64 = env(container(processor), "PROCESSOR_DRAIN_SECS").unwrap().parse().unwrap();
    let grace = processor["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap();
    assert!(grace >= drain + 10, "grace period {grace} s leaves no room after the {drain} s drain");

    // The agent serves KEDA on the port its Service exposes.
    let agent_deploy = find(&docs, "Deployment", "scaling-agent");
    let agent = container(agent_deploy);
    assert_eq!(env(agent, "AGENT_BACKEND"), Some("keda"));
    let grpc = port(agent, "grpc");
    assert!(env(agent, "AGENT_KEDA_ADDR").unwrap().ends_with(&format!(":{grpc}")), "AGENT_KEDA_ADDR is not the grpc port");
    let svc = find(&docs, "Service", "scaling-agent");
    let sp = svc["spec"]["ports"].as_vec().unwrap().iter().find(|p| p["targetPort"].as_str() == Some("grpc")).expect("the Service exposes no grpc port");
    let agent_labels = agent_deploy["spec"]["template"]["metadata"]["labels"].as_hash().unwrap();
    for (k, v) in svc["spec"]["selector"].as_hash().unwrap() {
        assert_eq!(agent_labels.get(k), Some(v), "the Service does not select the agent's pods");
    }

    // The ScaledObject: the processor Deployment, by the agent (push), SQS as fallback.
    let so = find(&docs, "ScaledObject", "processor");
    assert_eq!(so["spec"]["scaleTargetRef"]["name"].as_str(), Some("processor"));
    let max = so["spec"]["maxReplicaCount"].as_i64().unwrap();
    assert_eq!(Some(max.to_string().as_str()), env(agent, "AGENT_MAX_INSTANCES"), "KEDA's max differs from the agent's");
    let min = so["spec"]["minReplicaCount"].as_i64().unwrap();
    assert!(min <= env(agent, "AGENT_MIN_INSTANCES").unwrap().parse::<i64>().unwrap(), "KEDA's min is above the agent's");
    let triggers = so["spec"]["triggers"].as_vec().unwrap();
    let push = triggers.iter().find(|t| t["type"].as_str() == Some("external-push")).expect("no external-push trigger");
    let addr = push["metadata"]["scalerAddress"].as_str().unwrap();
    let expected = format!("scaling-agent.{ns}.svc.cluster.local:{}", sp["port"].as_i64().unwrap());
    assert_eq!(addr, expected, "the push trigger does not reach the agent's Service");
    let sqs = triggers.iter().find(|t| t["type"].as_str() == Some("aws-sqs-queue")).expect("no aws-sqs-queue fallback trigger");
    let cm = find(&docs, "ConfigMap", "billing-fleet");
    let queue = cm["data"]["FLEET_WORK_QUEUE"].as_str().unwrap();
    assert!(sqs["metadata"]["queueURL"].as_str().unwrap().ends_with(&format!("/{queue}")), "the fallback watches another queue than the work queue");
    let target = env(agent, "AGENT_INSTANCE_THROUGHPUT").unwrap().parse::<f64>().unwrap() * env(agent, "AGENT_SLA_SECS").unwrap().parse::<f64>().unwrap();
    assert_eq!(sqs["metadata"]["queueLength"].as_str().unwrap().parse::<f64>().unwrap(), target, "the fallback's target is not the SLA-derived one");
    let auth = sqs["authenticationRef"]["name"].as_str().unwrap();
    assert_eq!(find(&docs, "TriggerAuthentication", auth)["spec"]["podIdentity"]["provider"].as_str(), Some("aws"));
}

fn pod(deploy: &Yaml) -> &Yaml {
    &deploy["spec"]["template"]["spec"]
}

/// The restricted Pod Security Standard, field by field, for every container of every Deployment;
/// probes on the listeners' real health; requests and limits.
#[test]
fn every_pod_is_restricted_probed_and_bounded() {
    let docs = docs();
    let ns = find(&docs, "Namespace", "billing-fleet");
    assert_eq!(ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str(), Some("restricted"), "the namespace does not enforce restricted");
    let mut accounts = Vec::new();
    for name in ["processor", "controller", "scaling-agent"] {
        let d = find(&docs, "Deployment", name);
        let p = pod(d);
        let sc = &p["securityContext"];
        assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true), "{name}: runAsNonRoot");
        let uid = sc["runAsUser"].as_i64().unwrap_or_else(|| panic!("{name}: no numeric runAsUser"));
        assert!(uid > 0, "{name}: runs as root");
        assert_eq!(sc["seccompProfile"]["type"].as_str(), Some("RuntimeDefault"), "{name}: seccomp");
        assert_eq!(p["automountServiceAccountToken"].as_bool(), Some(false), "{name}: mounts an API token it never uses");
        assert!(p["hostNetwork"].is_badvalue() && p["hostPID"].is_badvalue() && p["hostIPC"].is_badvalue(), "{name}: host namespaces");
        for c in p["containers"].as_vec().unwrap() {
            let cs = &c["securityContext"];
            assert_eq!(cs["allowPrivilegeEscalation"].as_bool(), Some(false), "{name}: privilege escalation");
            assert_eq!(cs["readOnlyRootFilesystem"].as_bool(), Some(true), "{name}: writable root");
            assert_eq!(
                cs["capabilities"]["drop"].as_vec().map(|v| v.iter().filter_map(Yaml::as_str).collect::<Vec<_>>()),
                Some(vec!["ALL"]),
                "{name}: capabilities"
            );
            assert!(cs["capabilities"]["add"].is_badvalue() && cs["privileged"].as_bool() != Some(true), "{name}: added privileges");
            for (kind, what) in [("requests", "cpu"), ("requests", "memory"), ("limits", "cpu"), ("limits", "memory")] {
                assert!(!c["resources"][kind][what].is_badvalue(), "{name}: no {kind}.{what}");
            }
            // Volume mounts resolve to the pod's volumes (an emptyDir for /tmp: the root is read-only).
            for m in c["volumeMounts"].as_vec().into_iter().flatten() {
                let v = m["name"].as_str().unwrap();
                assert!(p["volumes"].as_vec().unwrap().iter().any(|x| x["name"].as_str() == Some(v)), "{name}: mount {v} has no volume");
            }
        }
        let c = container(d);
        let (live, ready) = (c["livenessProbe"]["httpGet"]["path"].as_str(), c["readinessProbe"]["httpGet"]["path"].as_str());
        assert_eq!((live, ready), (Some("/livez"), Some("/readyz")), "{name}: probes on the service's health");
        accounts.push(p["serviceAccountName"].as_str().unwrap().to_string());
    }
    accounts.sort();
    accounts.dedup();
    assert_eq!(accounts.len(), 3, "one ServiceAccount per service");
    for a in &accounts {
        assert_eq!(find(&docs, "ServiceAccount", a)["automountServiceAccountToken"].as_bool(), Some(false), "{a}");
    }

    // Two controllers (leases allow several), replaced one at a time, one always up.
    let ctl = find(&docs, "Deployment", "controller");
    assert!(ctl["spec"]["replicas"].as_i64().unwrap() >= 2, "one controller");
    assert_eq!(ctl["spec"]["strategy"]["type"].as_str(), Some("RollingUpdate"));
    assert_eq!(ctl["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"].as_i64(), Some(0));
    let pdb = docs.iter().find(|d| d["kind"].as_str() == Some("PodDisruptionBudget")).expect("no PodDisruptionBudget");
    assert_eq!(pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"].as_str(), Some("controller"));
    assert!(pdb["spec"]["minAvailable"].as_i64().unwrap() >= 1);

    // Default deny both ways; no secret in the repository.
    let deny = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("NetworkPolicy") && d["spec"]["podSelector"].as_hash().is_some_and(|h| h.is_empty()))
        .expect("no default-deny NetworkPolicy");
    let types: Vec<&str> = deny["spec"]["policyTypes"].as_vec().unwrap().iter().filter_map(Yaml::as_str).collect();
    assert!(types.contains(&"Ingress") && types.contains(&"Egress") && deny["spec"]["ingress"].is_badvalue() && deny["spec"]["egress"].is_badvalue());
    assert!(docs.iter().all(|d| d["kind"].as_str() != Some("Secret")), "a Secret is committed");
}
