#!/usr/bin/env bash
# Renders an overlay of deploy/k8s (aws or local) with `kubectl kustomize` to stdout: what
# `kubectl apply -k deploy/k8s/overlays/OVERLAY` applies. For local it first generates the broker's
# credentials (overlays/local/secrets.sh) unless they exist. Needs kubectl (Debian's package).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
overlay=${1:?usage: deploy/k8s/render.sh aws|local}
[ -f "$here/overlays/$overlay/kustomization.yaml" ] || { echo "k8s: no overlay '$overlay' (aws or local)" >&2; exit 2; }
command -v kubectl >/dev/null 2>&1 || { echo "k8s: kubectl not found (apt-get install kubectl)" >&2; exit 2; }
if [ "$overlay" = local ]; then "$here/overlays/local/secrets.sh" >&2; fi
exec kubectl kustomize "$here/overlays/$overlay"
