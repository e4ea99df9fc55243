//! `deploy/k8s/`: both overlays (aws, local) as `kubectl kustomize` renders them
//! (`deploy/k8s/render.sh`), checked for what the fleet relies on: the ScaledObject scales the
//! processor Deployment through the agent's Service and gRPC port, its bounds and fallback target are
//! the agent's own scaling policy (one ConfigMap), every reference resolves. What a security review
//! asks: every pod passes the restricted Pod Security Standard, probes hit real health, one account per
//! service, two controllers with a rolling update and a disruption budget, a default-deny network
//! policy, no secret in a committed file. And KEDA's objects field by field against KEDA's published
//! CRDs (ScaledObject, TriggerAuthentication), which the Kubernetes schemas `deploy/k8s/validate.sh`
//! checks the rest against do not hold. Needs kubectl (Debian's package; validate.sh installs it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

const NS: &str = "billing-fleet";
const SERVICES: [&str; 3] = ["processor", "controller", "scaling-agent"];

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s")
}

/// `deploy/k8s/render.sh OVERLAY`: what `kubectl apply -k` would apply.
fn render(overlay: &str) -> Vec<Yaml> {
    let out = Command::new(k8s_dir().join("render.sh")).arg(overlay).output().unwrap_or_else(|e| panic!("render.sh {overlay}: {e}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "render.sh {overlay} failed (kubectl kustomize): {err}");
    let text = String::from_utf8(out.stdout).unwrap();
    let docs = YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{overlay}: not YAML: {e}"));
    for d in &docs {
        assert!(d["apiVersion"].as_str().is_some() && d["kind"].as_str().is_some(), "{overlay}: a document without apiVersion/kind: {d:?}");
        assert!(d["metadata"]["name"].as_str().is_some(), "{overlay}: a document without a name");
    }
    docs
}

fn overlays() -> Vec<(&'static str, Vec<Yaml>)> {
    ["aws", "local"].into_iter().map(|o| (o, render(o))).collect()
}

fn kind_is(d: &Yaml, kind: &str) -> bool {
    d["kind"].as_str() == Some(kind)
}

fn find<'a>(docs: &'a [Yaml], kind: &str, name: &str) -> &'a Yaml {
    docs.iter().find(|d| kind_is(d, kind) && d["metadata"]["name"].as_str() == Some(name)).unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// A generated ConfigMap or Secret by the name before kustomize's hash suffix.
fn generated<'a>(docs: &'a [Yaml], kind: &str, base: &str) -> &'a Yaml {
    let hashed = |n: &str| n == base || n.strip_prefix(base).and_then(|r| r.strip_prefix('-')).is_some_and(|h| h.len() == 10 && !h.contains('-'));
    docs.iter().find(|d| kind_is(d, kind) && d["metadata"]["name"].as_str().is_some_and(hashed)).unwrap_or_else(|| panic!("no {kind} {base}"))
}

fn name(d: &Yaml) -> &str {
    d["metadata"]["name"].as_str().unwrap()
}

fn container(deploy: &Yaml) -> &Yaml {
    &deploy["spec"]["template"]["spec"]["containers"][0]
}

fn pod(workload: &Yaml) -> &Yaml {
    &workload["spec"]["template"]["spec"]
}

fn env<'a>(c: &'a Yaml, name: &str) -> Option<&'a str> {
    c["env"].as_vec()?.iter().find(|e| e["name"].as_str() == Some(name))?["value"].as_str()
}

fn port(c: &Yaml, name: &str) -> i64 {
    c["ports"].as_vec().unwrap().iter().find(|p| p["name"].as_str() == Some(name)).unwrap_or_else(|| panic!("no port {name}"))["containerPort"]
        .as_i64()
        .unwrap()
}

fn strs(v: &Yaml) -> Vec<&str> {
    v.as_vec().map(|v| v.iter().filter_map(Yaml::as_str).collect()).unwrap_or_default()
}

fn keys(v: &Yaml) -> BTreeSet<&str> {
    v.as_hash().map(|h| h.keys().filter_map(Yaml::as_str).collect()).unwrap_or_default()
}

/// The value of `key` in the ConfigMaps a container takes all of (`envFrom`), as the pod would see it.
fn from_config<'a>(docs: &'a [Yaml], c: &Yaml, key: &str) -> Option<&'a str> {
    c["envFrom"].as_vec()?.iter().filter_map(|e| e["configMapRef"]["name"].as_str()).find_map(|n| find(docs, "ConfigMap", n)["data"][key].as_str())
}

#[test]
fn the_overlays_agree_on_what_the_fleet_relies_on() {
    for (overlay, docs) in overlays() {
        let docs = &docs[..];
        find(docs, "Namespace", NS);
        for d in docs.iter().filter(|d| !kind_is(d, "Namespace")) {
            let ns = d["metadata"]["namespace"].as_str();
            assert!(ns == Some(NS) || (overlay == "local" && ns == Some("billing-fleet-deps")), "{overlay}: {} is in namespace {ns:?}", name(d));
        }

        // Every Deployment's selector matches its pod labels, and it runs the fleet binary of its
        // name under its own ServiceAccount; every ConfigMap and Secret it takes exists (but the
        // broker's URL on AWS, which the operator creates: no secret is committed).
        for svc in SERVICES {
            let d = find(docs, "Deployment", svc);
            let labels = d["spec"]["template"]["metadata"]["labels"].as_hash().unwrap();
            for (k, v) in d["spec"]["selector"]["matchLabels"].as_hash().unwrap() {
                assert_eq!(labels.get(k), Some(v), "{overlay} {svc}: selector {k:?} does not match the pod labels");
            }
            assert_eq!(container(d)["args"][0].as_str(), Some(svc), "{overlay} {svc}: the container runs another binary");
            assert_eq!(pod(d)["serviceAccountName"].as_str(), Some(svc), "{overlay} {svc}: not its own ServiceAccount");
            let account = find(docs, "ServiceAccount", svc);
            let role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].as_str();
            match overlay {
                "aws" => assert!(role.is_some_and(|r| r.ends_with(&format!(":role/billing-fleet-{svc}"))), "{svc}: no IRSA role of its own"),
                _ => assert!(role.is_none(), "{overlay} {svc}: an IRSA role on a laptop cluster"),
            }
            for from in container(d)["envFrom"].as_vec().unwrap() {
                if let Some(cm) = from["configMapRef"]["name"].as_str() {
                    find(docs, "ConfigMap", cm);
                }
                if let Some(s) = from["secretRef"]["name"].as_str() {
                    if overlay == "aws" {
                        assert_eq!(s, "billing-fleet-amqp", "aws {svc}: takes Secret {s}, which nothing creates");
                    } else {
                        assert_eq!(find(docs, "Secret", s)["metadata"]["namespace"].as_str(), Some(NS));
                    }
                }
            }
        }

        // The processor: KEDA owns the count; SIGKILL only well after the drain.
        let processor = find(docs, "Deployment", "processor");
        assert!(processor["spec"]["replicas"].is_badvalue(), "{overlay}: the processor Deployment sets replicas (KEDA owns them)");
        let drain: i64 = env(container(processor), "PROCESSOR_DRAIN_SECS").unwrap().parse().unwrap();
        let grace = pod(processor)["terminationGracePeriodSeconds"].as_i64().unwrap();
        assert!(grace >= drain + 10, "{overlay}: grace period {grace} s leaves no room after the {drain} s drain");

        // The agent serves KEDA on the port its Service exposes.
        let agent_deploy = find(docs, "Deployment", "scaling-agent");
        let agent = container(agent_deploy);
        assert_eq!(env(agent, "AGENT_BACKEND"), Some("keda"));
        let grpc = port(agent, "grpc");
        assert!(env(agent, "AGENT_KEDA_ADDR").unwrap().ends_with(&format!(":{grpc}")), "AGENT_KEDA_ADDR is not the grpc port");
        let svc = find(docs, "Service", "scaling-agent");
        let sp = svc["spec"]["ports"].as_vec().unwrap().iter().find(|p| p["targetPort"].as_str() == Some("grpc")).expect("the Service exposes no grpc port");
        let agent_labels = agent_deploy["spec"]["template"]["metadata"]["labels"].as_hash().unwrap();
        for (k, v) in svc["spec"]["selector"].as_hash().unwrap() {
            assert_eq!(agent_labels.get(k), Some(v), "the Service does not select the agent's pods");
        }

        // One place for the scaling policy: the agent takes it from the fleet-scaling ConfigMap (and
        // sets none of it itself, which would win over envFrom), and the ScaledObject's bounds and
        // fallback target are the same lines.
        let policy = generated(docs, "ConfigMap", "fleet-scaling");
        let policy_value = |k: &str| policy["data"][k].as_str().unwrap_or_else(|| panic!("fleet-scaling has no {k}"));
        for k in ["AGENT_MIN_INSTANCES", "AGENT_MAX_INSTANCES", "AGENT_SLA_SECS", "AGENT_TARGET_PER_INSTANCE", "AGENT_INSTANCE_THROUGHPUT"] {
            assert!(env(agent, k).is_none(), "{overlay}: the agent sets {k} itself instead of taking scaling.env's");
            if k != "AGENT_INSTANCE_THROUGHPUT" {
                assert_eq!(from_config(docs, agent, k), Some(policy_value(k)), "{overlay}: the agent does not take {k} from fleet-scaling");
            }
        }
        let so = find(docs, "ScaledObject", "processor");
        assert_eq!(so["spec"]["scaleTargetRef"]["name"].as_str(), Some("processor"));
        assert_eq!(
            so["spec"]["maxReplicaCount"].as_i64().map(|v| v.to_string()).as_deref(),
            Some(policy_value("AGENT_MAX_INSTANCES")),
            "{overlay}: KEDA's max is not the policy's"
        );
        assert_eq!(
            so["spec"]["minReplicaCount"].as_i64().map(|v| v.to_string()).as_deref(),
            Some(policy_value("AGENT_MIN_INSTANCES")),
            "{overlay}: KEDA's min is not the policy's"
        );
        assert!(so["spec"]["maxReplicaCount"].as_i64().unwrap() >= 1, "{overlay}: KEDA may run no processor at all");
        let triggers = so["spec"]["triggers"].as_vec().unwrap();
        let push = triggers.iter().find(|t| t["type"].as_str() == Some("external-push")).expect("no external-push trigger");
        let expected = format!("scaling-agent.{NS}.svc.cluster.local:{}", sp["port"].as_i64().unwrap());
        assert_eq!(push["metadata"]["scalerAddress"].as_str(), Some(expected.as_str()), "the push trigger does not reach the agent's Service");
        // The scaler port: mutual TLS on AWS (the agent serves the certificate and requires KEDA's, from
        // one Secret the operator creates; KEDA's TriggerAuthentication takes the CA and its client
        // certificate from the same Secret); plaintext on a laptop cluster, where the NetworkPolicy alone
        // guards it.
        let agent_tls: Vec<Option<&str>> = ["AGENT_KEDA_TLS_CERT", "AGENT_KEDA_TLS_KEY", "AGENT_KEDA_TLS_CLIENT_CA"].iter().map(|k| env(agent, k)).collect();
        if overlay == "aws" {
            let auth = find(docs, "TriggerAuthentication", push["authenticationRef"]["name"].as_str().expect("aws: KEDA reaches the agent without TLS"));
            let refs = auth["spec"]["secretTargetRef"].as_vec().expect("aws: the scaler's TriggerAuthentication takes nothing from a Secret");
            let param = |p: &str| refs.iter().find(|r| r["parameter"].as_str() == Some(p)).unwrap_or_else(|| panic!("aws: KEDA has no {p}"));
            let secret = param("caCert")["name"].as_str().unwrap();
            for p in ["tlsClientCert", "tlsClientKey"] {
                assert_eq!(param(p)["name"].as_str(), Some(secret), "aws: KEDA's {p} is not from the Secret its CA comes from");
            }
            assert!(!docs.iter().any(|d| kind_is(d, "Secret")), "aws: a Secret rendered (the operator creates it)");
            let agent_pod = pod(find(docs, "Deployment", "scaling-agent"));
            let volume = agent_pod["volumes"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|v| v["secret"]["secretName"].as_str() == Some(secret))
                .expect("aws: the agent does not mount the TLS Secret");
            let mount = agent["volumeMounts"].as_vec().unwrap().iter().find(|m| m["name"] == volume["name"]).expect("aws: the TLS volume is not mounted");
            assert_eq!(mount["readOnly"].as_bool(), Some(true));
            let dir = mount["mountPath"].as_str().unwrap();
            let expected = [format!("{dir}/tls.crt"), format!("{dir}/tls.key"), format!("{dir}/{}", param("caCert")["key"].as_str().unwrap())];
            assert_eq!(
                agent_tls,
                expected.iter().map(|e| Some(e.as_str())).collect::<Vec<_>>(),
                "aws: the agent does not serve the mounted certificate, key and client CA"
            );
        } else {
            assert!(push["authenticationRef"].is_badvalue() && agent_tls.iter().all(Option::is_none), "local: the scaler port is plaintext there");
        }
        let sqs = triggers.iter().find(|t| t["type"].as_str() == Some("aws-sqs-queue")).expect("no aws-sqs-queue fallback trigger");
        assert_eq!(
            sqs["metadata"]["queueLength"].as_str(),
            Some(policy_value("AGENT_TARGET_PER_INSTANCE")),
            "{overlay}: the fallback's target is not the policy's"
        );
        let fleet_cm = generated(docs, "ConfigMap", NS);
        let queue = fleet_cm["data"]["FLEET_WORK_QUEUE"].as_str().unwrap();
        let url = sqs["metadata"]["queueURL"].as_str().unwrap();
        assert!(url.ends_with(&format!("/{queue}")), "{overlay}: the fallback watches {url}, not the work queue {queue}");
        let auth = find(docs, "TriggerAuthentication", sqs["authenticationRef"]["name"].as_str().unwrap());
        if overlay == "aws" {
            assert!(url.starts_with("https://sqs.") && fleet_cm["data"]["AWS_ENDPOINT_URL"].is_badvalue(), "aws: not the real SQS");
            assert_eq!(auth["spec"]["podIdentity"]["provider"].as_str(), Some("aws"), "aws: KEDA reads SQS without IRSA");
        } else {
            // Everything at the in-cluster LocalStack, which the deps namespace serves.
            let endpoint = fleet_cm["data"]["AWS_ENDPOINT_URL"].as_str().expect("local: no AWS_ENDPOINT_URL");
            assert_eq!(endpoint, "http://localstack.billing-fleet-deps.svc.cluster.local:4566");
            assert!(url.starts_with(endpoint) && sqs["metadata"]["awsEndpoint"].as_str() == Some(endpoint), "local: KEDA reads another SQS than the fleet");
            let ls = find(docs, "Service", "localstack");
            assert_eq!(ls["metadata"]["namespace"].as_str(), Some("billing-fleet-deps"));
            for r in auth["spec"]["secretTargetRef"].as_vec().expect("local: KEDA has no keys for LocalStack") {
                let secret = find(docs, "Secret", r["name"].as_str().unwrap());
                assert!(!secret["data"][r["key"].as_str().unwrap()].is_badvalue(), "local: Secret {} has no key {:?}", name(secret), r["key"]);
            }
        }
    }
}

/// The restricted Pod Security Standard, field by field, for every container of every pod the fleet's
/// namespace runs; probes on the listeners' real health; requests and limits.
#[test]
fn every_pod_is_restricted_probed_and_bounded() {
    for (overlay, docs) in overlays() {
        let docs = &docs[..];
        let ns = find(docs, "Namespace", NS);
        assert_eq!(
            ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str(),
            Some("restricted"),
            "{overlay}: the namespace does not enforce restricted"
        );
        let workloads: Vec<&Yaml> =
            docs.iter().filter(|d| (kind_is(d, "Deployment") || kind_is(d, "Job")) && d["metadata"]["namespace"].as_str() == Some(NS)).collect();
        assert!(workloads.len() >= 3, "{overlay}: {} workloads", workloads.len());
        for d in workloads {
            let name = format!("{overlay} {}", name(d));
            let p = pod(d);
            let sc = &p["securityContext"];
            assert_eq!(sc["runAsNonRoot"].as_bool(), Some(true), "{name}: runAsNonRoot");
            let uid = sc["runAsUser"].as_i64().unwrap_or_else(|| panic!("{name}: no numeric runAsUser"));
            assert!(uid > 0, "{name}: runs as root");
            assert_eq!(sc["seccompProfile"]["type"].as_str(), Some("RuntimeDefault"), "{name}: seccomp");
            assert_eq!(p["automountServiceAccountToken"].as_bool(), Some(false), "{name}: mounts an API token it never uses");
            assert!(p["hostNetwork"].is_badvalue() && p["hostPID"].is_badvalue() && p["hostIPC"].is_badvalue(), "{name}: host namespaces");
            for v in p["volumes"].as_vec().into_iter().flatten() {
                assert!(v["hostPath"].is_badvalue(), "{name}: a hostPath volume");
            }
            for c in p["containers"].as_vec().unwrap() {
                let cs = &c["securityContext"];
                assert_eq!(cs["allowPrivilegeEscalation"].as_bool(), Some(false), "{name}: privilege escalation");
                assert_eq!(cs["readOnlyRootFilesystem"].as_bool(), Some(true), "{name}: writable root");
                assert_eq!(strs(&cs["capabilities"]["drop"]), vec!["ALL"], "{name}: capabilities");
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
        }
        let mut accounts = Vec::new();
        for svc in SERVICES {
            let d = find(docs, "Deployment", svc);
            let c = container(d);
            let (live, ready) = (c["livenessProbe"]["httpGet"]["path"].as_str(), c["readinessProbe"]["httpGet"]["path"].as_str());
            assert_eq!((live, ready), (Some("/livez"), Some("/readyz")), "{overlay} {svc}: probes on the service's health");
            accounts.push(pod(d)["serviceAccountName"].as_str().unwrap().to_string());
        }
        accounts.sort();
        accounts.dedup();
        assert_eq!(accounts.len(), 3, "{overlay}: one ServiceAccount per service");
        for a in &accounts {
            assert_eq!(find(docs, "ServiceAccount", a)["automountServiceAccountToken"].as_bool(), Some(false), "{a}");
        }

        // Two controllers (leases allow several), replaced one at a time, one always up.
        let ctl = find(docs, "Deployment", "controller");
        assert!(ctl["spec"]["replicas"].as_i64().unwrap() >= 2, "{overlay}: one controller");
        assert_eq!(ctl["spec"]["strategy"]["type"].as_str(), Some("RollingUpdate"));
        assert_eq!(ctl["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"].as_i64(), Some(0));
        let pdb = docs.iter().find(|d| kind_is(d, "PodDisruptionBudget")).expect("no PodDisruptionBudget");
        assert_eq!(pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"].as_str(), Some("controller"));
        assert!(pdb["spec"]["minAvailable"].as_i64().unwrap() >= 1);
        // Readiness follows S3: during its outage no controller is ready, and a budget that counted
        // only ready pods would block every node drain until S3 came back.
        assert_eq!(pdb["spec"]["unhealthyPodEvictionPolicy"].as_str(), Some("AlwaysAllow"), "{overlay}: the budget blocks drains in an outage");
        // Spread over nodes, preferred only: one node still runs both.
        let cp = pod(ctl);
        let spread = cp["topologySpreadConstraints"].as_vec().expect("the controllers are not spread");
        assert!(spread.iter().any(|c| c["topologyKey"].as_str() == Some("kubernetes.io/hostname")), "{overlay}: not spread over nodes");
        for c in spread {
            assert_eq!(c["whenUnsatisfiable"].as_str(), Some("ScheduleAnyway"), "{overlay}: a spread constraint that can leave a controller pending");
            assert_eq!(c["labelSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str(), Some("controller"));
        }
        let anti = &cp["affinity"]["podAntiAffinity"];
        assert!(anti["requiredDuringSchedulingIgnoredDuringExecution"].is_badvalue(), "{overlay}: required anti-affinity (one node could not run both)");
        assert!(anti["preferredDuringSchedulingIgnoredDuringExecution"].as_vec().is_some_and(|v| !v.is_empty()), "{overlay}: no anti-affinity preference");

        // Default deny both ways in the fleet's namespace.
        let deny = docs
            .iter()
            .find(|d| {
                kind_is(d, "NetworkPolicy")
                    && d["metadata"]["namespace"].as_str() == Some(NS)
                    && d["spec"]["podSelector"].as_hash().is_some_and(|h| h.is_empty())
            })
            .expect("no default-deny NetworkPolicy");
        let types = strs(&deny["spec"]["policyTypes"]);
        assert!(types.contains(&"Ingress") && types.contains(&"Egress") && deny["spec"]["ingress"].is_badvalue() && deny["spec"]["egress"].is_badvalue());
    }
}

/// Monitoring and the status page: every fleet pod announces its metrics port (the `http` one) for
/// scraping, which the monitoring namespace may reach, and nothing else; the controller's status page
/// has its own port, its Service, its token from the Secret fleet-page-token, and only the namespace's
/// pods may reach it; every pod may reach an OTLP collector.
#[test]
fn monitoring_reaches_metrics_and_the_page_stays_apart() {
    for (overlay, docs) in overlays() {
        let docs = &docs[..];
        let policy = |n: &str| find(docs, "NetworkPolicy", n);
        let ports_of = |rules: &Yaml| -> BTreeSet<i64> {
            rules.as_vec().into_iter().flatten().flat_map(|r| r["ports"].as_vec().into_iter().flatten()).filter_map(|p| p["port"].as_i64()).collect()
        };
        let monitoring = ports_of(&policy("monitoring-to-state")["spec"]["ingress"]);
        let mut metrics = BTreeSet::new();
        for svc in SERVICES {
            let d = find(docs, "Deployment", svc);
            let annotations = &d["spec"]["template"]["metadata"]["annotations"];
            let http = port(container(d), "http");
            assert_eq!(annotations["prometheus.io/scrape"].as_str(), Some("true"), "{overlay} {svc}: not announced for scraping");
            assert_eq!(annotations["prometheus.io/port"].as_str(), Some(http.to_string().as_str()), "{overlay} {svc}: scraped on another port than http");
            assert_eq!(annotations["prometheus.io/path"].as_str(), Some("/metrics"));
            metrics.insert(http);
        }
        assert_eq!(monitoring, metrics, "{overlay}: the monitoring namespace reaches other ports than the metrics ones");

        // The status page: its own port, not the metrics one, behind the controller Service.
        let ctl = find(docs, "Deployment", "controller");
        let c = container(ctl);
        let page = port(c, "page");
        assert!(!metrics.contains(&page), "{overlay}: the page shares a metrics port");
        assert!(env(c, "CONTROLLER_PAGE_ADDR").unwrap().ends_with(&format!(":{page}")), "{overlay}: CONTROLLER_PAGE_ADDR is not the page port");
        assert!(env(c, "LISTENER_HTTP_ADDR").unwrap().ends_with(&format!(":{}", port(c, "http"))));
        let svc = find(docs, "Service", "controller");
        let labels = ctl["spec"]["template"]["metadata"]["labels"].as_hash().unwrap();
        for (k, v) in svc["spec"]["selector"].as_hash().unwrap() {
            assert_eq!(labels.get(k), Some(v), "{overlay}: the controller Service does not select the controllers");
        }
        let targets: Vec<&str> = svc["spec"]["ports"].as_vec().unwrap().iter().filter_map(|p| p["targetPort"].as_str()).collect();
        assert_eq!(targets, vec!["page"], "{overlay}: the controller Service exposes more than the page");
        // The token: a file of the mounted Secret fleet-page-token (generated on a laptop cluster, the
        // operator's on AWS), key `token`.
        let token_file = env(c, "CONTROLLER_PAGE_TOKEN_FILE").expect("no CONTROLLER_PAGE_TOKEN_FILE");
        let mount = c["volumeMounts"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"].as_str().is_some_and(|p| token_file.starts_with(&format!("{p}/"))))
            .expect("the page token file is on no mount");
        assert_eq!(mount["readOnly"].as_bool(), Some(true));
        let volume = pod(ctl)["volumes"].as_vec().unwrap().iter().find(|v| v["name"] == mount["name"]).unwrap();
        let secret = volume["secret"]["secretName"].as_str().expect("the page token is not from a Secret");
        let item = volume["secret"]["items"].as_vec().unwrap().iter().find(|i| token_file.ends_with(&format!("/{}", i["path"].as_str().unwrap()))).unwrap();
        assert_eq!(item["key"].as_str(), Some("token"));
        if overlay == "aws" {
            assert_eq!(secret, "fleet-page-token");
        } else {
            let s = generated(docs, "Secret", "fleet-page-token");
            assert_eq!(name(s), secret, "local: the controllers mount another Secret than the generated token");
            assert!(!s["data"]["token"].is_badvalue(), "local: the generated Secret has no key token");
        }
        let page_in = policy("controller-page");
        assert_eq!(page_in["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str(), Some("controller"));
        assert_eq!(ports_of(&page_in["spec"]["ingress"]), BTreeSet::from([page]));
        for rule in page_in["spec"]["ingress"].as_vec().unwrap() {
            for from in rule["from"].as_vec().unwrap() {
                assert!(from["namespaceSelector"].is_badvalue(), "{overlay}: the page is open to other namespaces: {from:?}");
            }
        }
        // Out to an OTLP collector (gRPC and HTTP), from every fleet pod.
        let egress = policy("fleet-egress");
        assert_eq!(egress["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/part-of"].as_str(), Some(NS));
        let out = ports_of(&egress["spec"]["egress"]);
        assert!(out.contains(&4317) && out.contains(&4318), "{overlay}: no egress to OTLP: {out:?}");
    }
}

/// Authority by role (docs/security.md): every processor signs with its role's key, a file of the
/// Secret fleet-processor-key; every controller holds the keyring, the Secret fleet-role-keys mounted
/// as a directory (every role's key a file); on a laptop cluster both are generated from the keys
/// secrets.sh made (the keyring every role's, the processors' only their own), on AWS the operator's.
#[test]
fn the_processors_sign_and_the_controllers_hold_every_roles_key() {
    for (overlay, docs) in overlays() {
        let docs = &docs[..];
        let mounted = |deploy: &Yaml, file: &str| -> (String, Yaml) {
            let c = container(deploy);
            let m = c["volumeMounts"]
                .as_vec()
                .unwrap()
                .iter()
                .find(|m| m["mountPath"].as_str().is_some_and(|p| file == p || file.starts_with(&format!("{p}/"))))
                .unwrap_or_else(|| panic!("{overlay}: {file} is on no mount"))
                .clone();
            assert_eq!(m["readOnly"].as_bool(), Some(true), "{overlay}: {file} is writable");
            let v = pod(deploy)["volumes"].as_vec().unwrap().iter().find(|v| v["name"] == m["name"]).unwrap().clone();
            (v["secret"]["secretName"].as_str().expect("not from a Secret").to_string(), v)
        };
        let processor = find(docs, "Deployment", "processor");
        let file = env(container(processor), "FLEET_SIGNING_KEY_FILE").unwrap_or_else(|| panic!("{overlay}: the processors sign nothing"));
        let (secret, volume) = mounted(processor, file);
        let items = volume["secret"]["items"].as_vec().unwrap();
        assert_eq!((items.len(), items[0]["key"].as_str()), (1, Some("processor.key")), "{overlay}: the processors get another key than theirs");
        assert!(file.ends_with(&format!("/{}", items[0]["path"].as_str().unwrap())));
        let controller = find(docs, "Deployment", "controller");
        let dir = env(container(controller), "FLEET_ROLE_KEYS").unwrap_or_else(|| panic!("{overlay}: the controllers check no roles"));
        let (ring, volume) = mounted(controller, dir);
        assert!(volume["secret"]["items"].is_badvalue(), "{overlay}: the keyring is limited to some of its keys");
        if overlay == "aws" {
            assert_eq!((secret.as_str(), ring.as_str()), ("fleet-processor-key", "fleet-role-keys"));
        } else {
            let own = generated(docs, "Secret", "fleet-processor-key");
            assert_eq!(name(own), secret);
            assert_eq!(keys(&own["data"]), BTreeSet::from(["processor.key"]), "local: the processors' Secret holds more than their key");
            let all = generated(docs, "Secret", "fleet-role-keys");
            assert_eq!(name(all), ring);
            assert_eq!(keys(&all["data"]), BTreeSet::from(["controller.key", "operator.key", "processor.key", "submitter.key"]));
            assert_eq!(own["data"]["processor.key"], all["data"]["processor.key"], "local: the keyring does not hold the processors' key");
        }
    }
}

/// No secret in a committed file: the aws overlay renders no Secret at all (the operator creates the
/// broker's and the page token's), the local one only LocalStack's placeholder keys, and the broker
/// credentials and page token that `overlays/local/secrets.sh` generated into a directory git
/// ignores, found in no tracked file.
#[test]
fn no_secret_is_committed() {
    let docs = render("aws");
    assert!(docs.iter().all(|d| !kind_is(d, "Secret")), "aws: a Secret is rendered from committed files");
    let docs = render("local");
    let secrets: Vec<&str> = docs.iter().filter(|d| kind_is(d, "Secret")).map(name).collect();
    assert_eq!(secrets.len(), 6, "local: Secrets {secrets:?}");
    let dir = k8s_dir().join("overlays/local/secrets");
    let ignored = Command::new("git").arg("check-ignore").arg("-q").arg(dir.join("amqp.env")).current_dir(k8s_dir()).status().unwrap();
    assert!(ignored.success(), "git does not ignore {}", dir.display());
    let rabbit = std::fs::read_to_string(dir.join("rabbitmq.env")).unwrap();
    let password = rabbit.lines().find_map(|l| l.strip_prefix("RABBITMQ_DEFAULT_PASS=")).expect("no generated password");
    assert!(password.len() >= 32 && password != "guest", "a weak broker password");
    let amqp = std::fs::read_to_string(dir.join("amqp.env")).unwrap();
    assert!(amqp.contains(&format!("fleet:{password}@")), "the fleet's AMQP_URL does not carry the broker's password");
    let token = std::fs::read_to_string(dir.join("page-token")).unwrap();
    assert!(token.len() >= 32 && token.bytes().all(|b| b.is_ascii_hexdigit()), "a weak page token");
    let processor_key = std::fs::read_to_string(dir.join("keys/processor.key")).unwrap();
    let processor_key = processor_key.trim().split_once(' ').expect("a key line").1.to_string();
    let broker = generated(&docs, "Secret", "rabbitmq-credentials");
    assert_eq!(broker["metadata"]["namespace"].as_str(), Some("billing-fleet-deps"));
    let rabbit_pod = pod(find(&docs, "Deployment", "rabbitmq"));
    assert_eq!(rabbit_pod["containers"][0]["envFrom"][0]["secretRef"]["name"].as_str(), Some(name(broker)), "RabbitMQ does not take the generated user");
    let tracked = Command::new("git").args(["ls-files", "-z"]).current_dir(k8s_dir().join("../..")).output().unwrap();
    let root = k8s_dir().join("../..");
    for f in tracked.stdout.split(|b| *b == 0).filter(|f| !f.is_empty()) {
        let path = root.join(String::from_utf8_lossy(f).as_ref());
        if let Ok(text) = std::fs::read(&path) {
            assert!(!text.windows(password.len()).any(|w| w == password.as_bytes()), "{} holds the broker's password", path.display());
            assert!(!text.windows(token.len()).any(|w| w == token.as_bytes()), "{} holds the page token", path.display());
            assert!(!text.windows(processor_key.len()).any(|w| w == processor_key.as_bytes()), "{} holds the processor's key", path.display());
        }
    }
}

/// Keys of `v` must be among `allowed` (the CRD's properties), and `required` among them.
fn schema(what: &str, v: &Yaml, allowed: &[&str], required: &[&str]) {
    assert!(v.as_hash().is_some(), "{what}: not an object: {v:?}");
    for k in keys(v) {
        assert!(allowed.contains(&k), "{what}: field {k:?} is not in KEDA's CRD (allowed: {allowed:?})");
    }
    for k in required {
        assert!(!v[*k].is_badvalue(), "{what}: required field {k:?} missing");
    }
}

fn int(what: &str, v: &Yaml, min: i64) {
    let i = v.as_i64().unwrap_or_else(|| panic!("{what}: not an integer: {v:?}"));
    assert!(i >= min, "{what}: {i} < {min}");
}

/// The HPA's behavior (autoscaling/v2 HorizontalPodAutoscalerBehavior), which KEDA passes on.
fn hpa_behavior(what: &str, b: &Yaml) {
    schema(what, b, &["scaleUp", "scaleDown"], &[]);
    for dir in keys(b) {
        let rules = &b[dir];
        schema(&format!("{what}.{dir}"), rules, &["stabilizationWindowSeconds", "selectPolicy", "policies", "tolerance"], &[]);
        if !rules["stabilizationWindowSeconds"].is_badvalue() {
            int(&format!("{what}.{dir}.stabilizationWindowSeconds"), &rules["stabilizationWindowSeconds"], 0);
        }
        if let Some(p) = rules["selectPolicy"].as_str() {
            assert!(["Max", "Min", "Disabled"].contains(&p), "{what}.{dir}.selectPolicy {p}");
        }
        for p in rules["policies"].as_vec().into_iter().flatten() {
            schema(&format!("{what}.{dir}.policies[]"), p, &["type", "value", "periodSeconds"], &["type", "value", "periodSeconds"]);
            assert!(["Pods", "Percent"].contains(&p["type"].as_str().unwrap()), "{what}: policy type");
            int(&format!("{what}.{dir}.policies[].value"), &p["value"], 1);
            int(&format!("{what}.{dir}.policies[].periodSeconds"), &p["periodSeconds"], 1);
        }
    }
}

/// KEDA's ScaledObject and TriggerAuthentication, field by field against their published CRDs
/// (keda.sh/v1alpha1, KEDA 2.x: `config/crd/bases/keda.sh_scaledobjects.yaml` and
/// `keda.sh_triggerauthentications.yaml`), and the scalers' metadata against what the external-push and
/// aws-sqs-queue scalers read: a misspelled field would be dropped by the API server's pruning and
/// silently change how the processors scale.
#[test]
fn keda_objects_match_their_published_crds() {
    for (overlay, docs) in overlays() {
        let docs = &docs[..];
        let keda: Vec<&Yaml> = docs.iter().filter(|d| d["apiVersion"].as_str().is_some_and(|a| a.starts_with("keda.sh/"))).collect();
        // The ScaledObject and the fallback's TriggerAuthentication; on AWS also the scaler's mTLS one.
        assert_eq!(keda.len(), if overlay == "aws" { 3 } else { 2 }, "{overlay}: KEDA objects");
        for d in keda {
            let what = format!("{overlay} {} {}", d["kind"].as_str().unwrap(), name(d));
            assert_eq!(d["apiVersion"].as_str(), Some("keda.sh/v1alpha1"), "{what}");
            schema(&what, d, &["apiVersion", "kind", "metadata", "spec"], &["spec"]);
            let spec = &d["spec"];
            match d["kind"].as_str().unwrap() {
                "ScaledObject" => {
                    schema(
                        &what,
                        spec,
                        &[
                            "scaleTargetRef",
                            "pollingInterval",
                            "cooldownPeriod",
                            "initialCooldownPeriod",
                            "idleReplicaCount",
                            "minReplicaCount",
                            "maxReplicaCount",
                            "fallback",
                            "advanced",
                            "triggers",
                        ],
                        &["scaleTargetRef", "triggers"],
                    );
                    schema(&format!("{what}.scaleTargetRef"), &spec["scaleTargetRef"], &["apiVersion", "kind", "name", "envSourceContainerName"], &["name"]);
                    for f in ["pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"] {
                        int(&format!("{what}.{f}"), &spec[f], if f == "pollingInterval" { 1 } else { 0 });
                    }
                    assert!(spec["minReplicaCount"].as_i64() <= spec["maxReplicaCount"].as_i64(), "{what}: min above max");
                    schema(&format!("{what}.fallback"), &spec["fallback"], &["failureThreshold", "replicas", "behavior"], &["failureThreshold", "replicas"]);
                    int(&format!("{what}.fallback.failureThreshold"), &spec["fallback"]["failureThreshold"], 1);
                    int(&format!("{what}.fallback.replicas"), &spec["fallback"]["replicas"], 1);
                    schema(
                        &format!("{what}.advanced"),
                        &spec["advanced"],
                        &["restoreToOriginalReplicaCount", "horizontalPodAutoscalerConfig", "scalingModifiers"],
                        &[],
                    );
                    let hpa = &spec["advanced"]["horizontalPodAutoscalerConfig"];
                    schema(&format!("{what}.advanced.horizontalPodAutoscalerConfig"), hpa, &["name", "behavior"], &[]);
                    hpa_behavior(&format!("{what}.advanced.horizontalPodAutoscalerConfig.behavior"), &hpa["behavior"]);
                    let triggers = spec["triggers"].as_vec().expect("triggers is not a list");
                    assert!(!triggers.is_empty(), "{what}: no trigger");
                    for t in triggers {
                        let ty = t["type"].as_str().unwrap_or_else(|| panic!("{what}: a trigger without type"));
                        let tw = format!("{what} trigger {ty}");
                        schema(&tw, t, &["type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"], &["type", "metadata"]);
                        // The CRD: metadata is a map of strings (a bare number or boolean is refused).
                        for (k, v) in t["metadata"].as_hash().unwrap() {
                            assert!(v.as_str().is_some(), "{tw}: metadata {k:?} is not a string: {v:?}");
                        }
                        if !t["authenticationRef"].is_badvalue() {
                            schema(&format!("{tw}.authenticationRef"), &t["authenticationRef"], &["name", "kind"], &["name"]);
                            let kind = t["authenticationRef"]["kind"].as_str().unwrap_or("TriggerAuthentication");
                            find(docs, kind, t["authenticationRef"]["name"].as_str().unwrap());
                        }
                        let m = &t["metadata"];
                        match ty {
                            "external-push" | "external" => {
                                schema(&tw, m, &["scalerAddress", "caCert", "tlsClientCert", "tlsClientKey", "unsafeSsl", "enableTLS"], &["scalerAddress"]);
                                let addr = m["scalerAddress"].as_str().unwrap();
                                assert!(
                                    addr.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()),
                                    "{tw}: scalerAddress {addr} is not host:port"
                                );
                            }
                            "aws-sqs-queue" => {
                                schema(
                                    &tw,
                                    m,
                                    &[
                                        "queueURL",
                                        "queueURLFromEnv",
                                        "queueLength",
                                        "activationQueueLength",
                                        "awsRegion",
                                        "awsEndpoint",
                                        "identityOwner",
                                        "scaleOnInFlight",
                                        "scaleOnDelayed",
                                    ],
                                    &["queueURL", "awsRegion"],
                                );
                                let len = m["queueLength"].as_str().unwrap().parse::<u64>().unwrap_or_else(|e| panic!("{tw}: queueLength: {e}"));
                                assert!(len >= 1, "{tw}: queueLength 0");
                                for b in ["scaleOnInFlight", "scaleOnDelayed"] {
                                    if let Some(v) = m[b].as_str() {
                                        assert!(v == "true" || v == "false", "{tw}: {b} {v}");
                                    }
                                }
                            }
                            other => panic!("{tw}: unexpected scaler {other}"),
                        }
                    }
                }
                "TriggerAuthentication" => {
                    schema(
                        &what,
                        spec,
                        &[
                            "podIdentity",
                            "secretTargetRef",
                            "env",
                            "configMapTargetRef",
                            "hashiCorpVault",
                            "azureKeyVault",
                            "awsSecretManager",
                            "gcpSecretManager",
                            "boundServiceAccountToken",
                        ],
                        &[],
                    );
                    assert!(!keys(spec).is_empty(), "{what}: authenticates with nothing");
                    if !spec["podIdentity"].is_badvalue() {
                        let pi = &spec["podIdentity"];
                        schema(
                            &format!("{what}.podIdentity"),
                            pi,
                            &["provider", "identityId", "identityTenantId", "identityAuthorityHost", "roleArn", "identityOwner"],
                            &["provider"],
                        );
                        let p = pi["provider"].as_str().unwrap();
                        assert!(["none", "azure-workload", "gcp", "aws", "aws-eks", "aws-kiam"].contains(&p), "{what}: provider {p}");
                    }
                    // The parameters of the scaler that names it: the SQS scaler's keys, or the external
                    // scaler's TLS material.
                    let user = docs
                        .iter()
                        .filter(|d| kind_is(d, "ScaledObject"))
                        .flat_map(|d| d["spec"]["triggers"].as_vec().into_iter().flatten())
                        .find(|t| t["authenticationRef"]["name"].as_str() == Some(name(d)))
                        .and_then(|t| t["type"].as_str())
                        .unwrap_or_else(|| panic!("{what}: no trigger names it"));
                    let known: &[&str] = match user {
                        "aws-sqs-queue" => &["awsAccessKeyID", "awsSecretAccessKey", "awsSessionToken", "awsRoleArn"],
                        "external-push" | "external" => &["caCert", "tlsClientCert", "tlsClientKey"],
                        other => panic!("{what}: named by a {other} trigger"),
                    };
                    for r in spec["secretTargetRef"].as_vec().into_iter().flatten() {
                        schema(&format!("{what}.secretTargetRef[]"), r, &["parameter", "name", "key"], &["parameter", "name", "key"]);
                        let param = r["parameter"].as_str().unwrap();
                        assert!(known.contains(&param), "{what}: the {user} scaler reads no {param}");
                    }
                }
                other => panic!("{what}: unexpected KEDA kind {other}"),
            }
        }
    }
}
