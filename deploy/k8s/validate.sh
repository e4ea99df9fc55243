#!/usr/bin/env bash
# Renders both overlays (render.sh: `kubectl kustomize`) and validates every Kubernetes object in them
# against the Kubernetes schemas of K8S_VERSION (default 1.32.0) with kubernetes-validate from PyPI,
# strict: an unknown or misspelled field is an error. KEDA's objects (keda.sh) are not in those
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
