#!/usr/bin/env bash
# Validates deploy/k8s/fleet.yaml against the Kubernetes schemas (kubernetes-validate from PyPI, strict:
# unknown fields are errors) for the Kubernetes version given (default 1.32.0). KEDA's CRDs (keda.yaml)
# are not in those schemas: the Rust test scaling-agent/tests/it/k8s_manifests.rs checks them field by
# field, and the restricted pod settings, probes, accounts and policies of fleet.yaml too.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${K8S_VALIDATE_VENV:-$HOME/.cache/billing-fleet/k8s-validate-venv}
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "k8s: installing kubernetes-validate into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "kubernetes-validate==1.37.0"
fi
"$venv/bin/kubernetes-validate" --strict --quiet -k "${K8S_VERSION:-1.32.0}" "$here/fleet.yaml"
echo "k8s: fleet.yaml is valid Kubernetes ${K8S_VERSION:-1.32.0} (strict)"
