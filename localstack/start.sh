#!/usr/bin/env bash
# Installs LocalStack (SQS + S3) as a host process when missing, starts it, waits until SQS and S3 are ready.
# Safe to run twice: a LocalStack already answering on the gateway is left alone. It runs with
# patches/sitecustomize.py (a fix for S3 objects truncated by an upload that broke off: see there).
#
# Environment:
#   LOCALSTACK_VENV   virtualenv outside the repository (default ~/.cache/billing-fleet/localstack-venv)
#   LOCALSTACK_DIR    state/log directory (default ~/.cache/billing-fleet/localstack-run)
#   LOCALSTACK_PORT   gateway port on 127.0.0.1 (default 4566)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${LOCALSTACK_VENV:-$HOME/.cache/billing-fleet/localstack-venv}
run=${LOCALSTACK_DIR:-$HOME/.cache/billing-fleet/localstack-run}
port=${LOCALSTACK_PORT:-4566}
health="http://127.0.0.1:${port}/_localstack/health"

ready() {
  local body
  body=$(curl -fsS --max-time 2 "$health" 2>/dev/null) || return 1
  python3 - "$body" <<'PY'
import json, sys
s = json.loads(sys.argv[1]).get("services", {})
ok = all(s.get(n) in ("running", "available") for n in ("sqs", "s3"))
sys.exit(0 if ok else 1)
PY
}

if ready; then
  echo "localstack: already running on 127.0.0.1:${port}"
  exit 0
fi

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import localstack.runtime.main' 2>/dev/null; then
  py=""
  # python3.13 may be installed but not on PATH (pyenv keeps it under its versions directory).
  for cand in python3.13 "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 2>/dev/null | tail -n 1)" python3.11; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import venv' 2>/dev/null; then py=$cand; break; fi
  done
  [ -n "$py" ] || { echo "localstack: need python3.13 (or 3.11) to install LocalStack" >&2; exit 1; }
  echo "localstack: installing into $venv with $py (about a minute)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  if "$py" -c "import sys; sys.exit(0 if sys.version_info >= (3, 13) else 1)"; then
    "$venv/bin/pip" install -q -c "$here/constraints.txt" 'localstack-core[runtime]==2026.3.0' 'cbor2<6' 'pyopenssl<26' 'localstack-twisted<26'
  else
    "$venv/bin/pip" install -q 'localstack-core[runtime]==4.13.1' 'cbor2<6' 'pyopenssl<26' 'localstack-twisted<26'
  fi
fi

mkdir -p "$run/fs"
echo "localstack: starting on 127.0.0.1:${port} (log: $run/localstack.log)"
(
  cd "$run"
  SERVICES=sqs,s3 EAGER_SERVICE_LOADING=1 GATEWAY_LISTEN=127.0.0.1:${port} LOCALSTACK_HOST=127.0.0.1:${port} \
  SQS_ENDPOINT_STRATEGY=path DNS_ADDRESS=0 DISABLE_EVENTS=1 SKIP_SSL_CERT_DOWNLOAD=1 LS_LOG=warn \
  OVERRIDE_IN_DOCKER=0 FILESYSTEM_ROOT="$run/fs" PYTHONPATH="$here/patches${PYTHONPATH:+:$PYTHONPATH}" \
  nohup setsid "$venv/bin/python" -m localstack.runtime.main >>"$run/localstack.log" 2>&1 &
  echo $! >"$run/localstack.pid"
)
for _ in $(seq 1 120); do
  if ready; then echo "localstack: ready (pid $(cat "$run/localstack.pid"))"; exit 0; fi
  if ! kill -0 "$(cat "$run/localstack.pid")" 2>/dev/null; then
    echo "localstack: process exited; last log lines:" >&2; tail -n 30 "$run/localstack.log" >&2; exit 1
  fi
  sleep 1
done
echo "localstack: not ready after 120 s; see $run/localstack.log" >&2
exit 1
