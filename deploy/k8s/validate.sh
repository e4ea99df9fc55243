#!/usr/bin/env bash
# Renders both overlays (render.sh: `kubectl kustomize`), and the aws one with the optional PodMonitor
# (components/podmonitor), and validates every Kubernetes object in them against the Kubernetes
# schemas of K8S_VERSION (default 1.32.0) with kubernetes-validate from PyPI, strict: an unknown or
# misspelled field is an error. KEDA's objects (keda.sh) are not in those
# schemas: the Rust test scaling-agent/tests/it/k8s_manifests.rs checks them field by field against
# KEDA's published CRDs, and the restricted pod settings, probes, accounts, policies and the one place
# of the scaling policy in both renderings.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${K8S_VALIDATE_VENV:-$HOME/.cache/billing-fleet/k8s-validate-venv}
if ! command -v kubectl >/dev/null 2>&1; then
  echo "k8s: installing kubectl (Debian's package)"
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q kubectl >/dev/null; else sudo apt-get install -y -q kubectl >/dev/null; fi
fi
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "k8s: installing kubernetes-validate into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "kubernetes-validate==1.37.0"
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for overlay in aws local; do
  "$here/render.sh" "$overlay" >"$out/$overlay.yaml"
  # Kubernetes' own objects only (KEDA's CRDs are checked by the Rust test).
  "$venv/bin/python" - "$out/$overlay.yaml" "$out/$overlay-core.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
core = [d for d in docs if not d["apiVersion"].startswith("keda.sh/")]
assert len(core) < len(docs), "no KEDA objects rendered"
yaml.safe_dump_all(core, open(sys.argv[2], "w"))
print(f"k8s: {sys.argv[1].rsplit('/', 1)[-1]}: {len(docs)} objects, {len(docs) - len(core)} of KEDA")
PY
  "$venv/bin/kubernetes-validate" --strict --quiet -k "${K8S_VERSION:-1.32.0}" "$out/$overlay-core.yaml"
  echo "k8s: overlay $overlay is valid Kubernetes ${K8S_VERSION:-1.32.0} (strict)"
done

# The optional PodMonitor (components/podmonitor) on the aws overlay: the Kubernetes objects valid as
# above, and the PodMonitor (not in those schemas) field by field against the Prometheus Operator's
# CRD (monitoring.coreos.com/v1): its pods' `http` port is each fleet Deployment's metrics port, and
# the annotations are off (no double scrape).
mkdir -p "$out/with-podmonitor"
# (Kustomize takes relative paths only.)
rel=$(realpath --relative-to="$out/with-podmonitor" "$here")
printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [%s]\ncomponents: [%s]\n' \
  "$rel/overlays/aws" "$rel/components/podmonitor" >"$out/with-podmonitor/kustomization.yaml"
kubectl kustomize "$out/with-podmonitor" >"$out/podmonitor.yaml"
"$venv/bin/python" - "$out/podmonitor.yaml" "$out/podmonitor-core.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
core = [d for d in docs if not d["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/"))]
monitors = [d for d in docs if d["kind"] == "PodMonitor"]
assert len(monitors) == 1, f"{len(monitors)} PodMonitors"
pm = monitors[0]
def only(what, obj, allowed, required=()):
    assert isinstance(obj, dict), f"{what}: not an object"
    extra = set(obj) - set(allowed)
    assert not extra, f"{what}: {sorted(extra)} not in the PodMonitor CRD"
    missing = [k for k in required if k not in obj]
    assert not missing, f"{what}: {missing} missing"
only("PodMonitor", pm, ["apiVersion", "kind", "metadata", "spec"], ["spec"])
assert pm["apiVersion"] == "monitoring.coreos.com/v1"
spec = pm["spec"]
only("spec", spec, ["selector", "namespaceSelector", "podMetricsEndpoints", "podTargetLabels", "jobLabel", "sampleLimit",
                    "targetLimit", "labelLimit", "attachMetadata", "scrapeProtocols"], ["selector", "podMetricsEndpoints"])
endpoint_keys = ["port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
                 "honorTimestamps", "relabelings", "metricRelabelings", "basicAuth", "bearerTokenSecret", "authorization",
                 "oauth2", "tlsConfig", "proxyUrl", "followRedirects", "enableHttp2", "filterRunning", "trackTimestampsStaleness"]
relabel_keys = ["sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"]
ports = set()
for i, ep in enumerate(spec["podMetricsEndpoints"]):
    only(f"podMetricsEndpoints[{i}]", ep, endpoint_keys)
    for j, r in enumerate(ep.get("relabelings", []) + ep.get("metricRelabelings", [])):
        only(f"podMetricsEndpoints[{i}] relabeling {j}", r, relabel_keys)
    ports.add(ep["port"])
assert any(r.get("targetLabel") == "service" for ep in spec["podMetricsEndpoints"] for r in ep.get("relabelings", [])), "no service label"
sel = spec["selector"]["matchLabels"]
fleet = [d for d in docs if d["kind"] == "Deployment" and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
assert sorted(d["metadata"]["name"] for d in fleet) == ["controller", "processor", "scaling-agent"], [d["metadata"]["name"] for d in fleet]
for d in fleet:
    name, meta = d["metadata"]["name"], d["spec"]["template"]["metadata"]
    named = {p["name"]: p["containerPort"] for p in d["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports <= set(named), f"{name}: no port {ports - set(named)}"
    assert str(named["http"]) == meta["annotations"]["prometheus.io/port"], f"{name}: the annotations' port is not http's"
    assert meta["annotations"]["prometheus.io/scrape"] == "false", f"{name}: annotations still on with the PodMonitor"
yaml.safe_dump_all(core, open(sys.argv[2], "w"))
print(f"k8s: aws + components/podmonitor: {len(docs)} objects; the PodMonitor has the CRD's fields and the pods' http port")
PY
"$venv/bin/kubernetes-validate" --strict --quiet -k "${K8S_VERSION:-1.32.0}" "$out/podmonitor-core.yaml"
echo "k8s: aws + components/podmonitor is valid Kubernetes ${K8S_VERSION:-1.32.0} (strict)"
