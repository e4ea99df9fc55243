#!/usr/bin/env bash
# Stops the LocalStack host process started by start.sh (by its recorded pid).
set -euo pipefail
run=${LOCALSTACK_DIR:-$HOME/.cache/billing-fleet/localstack-run}
pid=$(cat "$run/localstack.pid" 2>/dev/null || true)
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
  kill -TERM "$pid"
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" || true
  echo "localstack: stopped"
fi
rm -f "$run/localstack.pid"
