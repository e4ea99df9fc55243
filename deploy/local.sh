#!/usr/bin/env bash
# Brings the whole fleet up on this machine without Docker, or down again.
#
#   deploy/local.sh up      LocalStack + RabbitMQ (installed when missing), queues and bucket, release builds
#                           of controller and scaling-agent started in the background; the agent runs the
#                           processors (its `process` backend): AGENT_MIN_INSTANCES (1) to
#                           AGENT_MAX_INSTANCES (4); instance N serves its state on port 9110 + N and
#                           logs to processor-N.log; the agent's own state is on :9100.
#   deploy/local.sh down    stops what `up` started (by recorded pid): the services, then LocalStack.
#                           RabbitMQ is left running unless FLEET_STOP_RABBITMQ=1.
#   deploy/local.sh status  shows what runs.
#
# The controller's status page: http://127.0.0.1:9300/ (its reports need the token in .run/page-token).
#
# Logs and pid files go to the run directory ($FLEET_RUN_DIR, default .run/ in the repository).
# `up` twice is safe: running pieces are left alone.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run=${FLEET_RUN_DIR:-$repo/.run}
export AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-http://127.0.0.1:4566}
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test}
export AWS_REGION=${AWS_REGION:-us-east-1}
services=(controller scaling-agent)

alive() { local p; p=$(cat "$run/$1.pid" 2>/dev/null) && [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

up() {
  mkdir -p "$run"
  "$repo/deploy/rabbitmq.sh"
  LOCALSTACK_DIR=${LOCALSTACK_DIR:-$run/localstack} "$repo/localstack/start.sh"
  "$repo/localstack/init-resources.sh"
  # FLEET_SKIP_BUILD=1: run the binaries already in target/release (e.g. another version's, to compare).
  if [ "${FLEET_SKIP_BUILD:-0}" != 1 ]; then
    echo "building release binaries (first time: a few minutes)"
    (cd "$repo" && cargo build --release --quiet -p processor -p controller -p scaling-agent -p initiator)
  fi
  for s in "${services[@]}"; do
    if alive "$s"; then echo "$s: already running (pid $(cat "$run/$s.pid"))"; continue; fi
    # State endpoints: processors on :9110 + N, controller on :9102 (GET /state, /metrics; PUT /throttle),
    # scaling agent on :9100 (GET /state, /metrics).
    # The controller's status page on :9300, its token (for reports) in $run/page-token.
    http="" page=()
    case "$s" in controller)
      http=${CONTROLLER_HTTP_ADDR:-127.0.0.1:9102}
      [ -s "$run/page-token" ] || (umask 077; od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$run/page-token")
      page=(CONTROLLER_PAGE_ADDR="${CONTROLLER_PAGE_ADDR:-127.0.0.1:9300}" CONTROLLER_PAGE_TOKEN_FILE="$run/page-token"
            CONTROLLER_AGENT_URL="${CONTROLLER_AGENT_URL:-http://${AGENT_HTTP_ADDR:-127.0.0.1:9100}}") ;;
    esac
    env "${page[@]}" LISTENER_HTTP_ADDR=$http AGENT_HTTP_ADDR=${AGENT_HTTP_ADDR:-127.0.0.1:9100} AGENT_BACKEND=process \
      AGENT_PROCESSOR_BIN="$repo/target/release/processor" AGENT_PROCESSOR_HTTP_BASE=${AGENT_PROCESSOR_HTTP_BASE:-9110} \
      AGENT_PROCESSOR_LOG_DIR="$run" AGENT_MIN_INSTANCES=${AGENT_MIN_INSTANCES:-1} AGENT_MAX_INSTANCES=${AGENT_MAX_INSTANCES:-4} \
      nohup "$repo/target/release/$s" >>"$run/$s.log" 2>&1 </dev/null &
    echo $! >"$run/$s.pid"
    echo "$s: started (pid $!, log $run/$s.log)"
  done
  sleep 1
  for s in "${services[@]}"; do
    alive "$s" || { echo "$s exited at start; last log lines:" >&2; tail -n 20 "$run/$s.log" >&2; exit 1; }
  done
  # The agent starts the minimum of processors at its first look; wait for the first one's endpoint.
  if [ "${AGENT_MIN_INSTANCES:-1}" -gt 0 ]; then
    for _ in $(seq 1 40); do curl -fsS --max-time 1 "http://127.0.0.1:${AGENT_PROCESSOR_HTTP_BASE:-9110}/healthz" >/dev/null 2>&1 && break; sleep 0.25; done
    curl -fsS --max-time 1 "http://127.0.0.1:${AGENT_PROCESSOR_HTTP_BASE:-9110}/healthz" >/dev/null 2>&1 \
      || { echo "the agent started no processor; last log lines:" >&2; tail -n 20 "$run/scaling-agent.log" >&2; exit 1; }
    echo "processor: started by the scaling agent (state http://127.0.0.1:${AGENT_PROCESSOR_HTTP_BASE:-9110}/state)"
  fi
  echo "fleet up: AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL; submit with target/release/initiator submit FILE --wait"
}

down() {
  for s in "${services[@]}"; do
    if alive "$s"; then
      local p; p=$(cat "$run/$s.pid")
      kill -TERM "$p"
      # The agent stops its processors first (each drains, up to 35 s).
      for _ in $(seq 1 90); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$p" 2>/dev/null && { echo "$s: did not stop in 45 s; killing" >&2; kill -KILL "$p"; }
      echo "$s: stopped"
    fi
    rm -f "$run/$s.pid"
  done
  LOCALSTACK_DIR=${LOCALSTACK_DIR:-$run/localstack} "$repo/localstack/stop.sh"
  if [ "${FLEET_STOP_RABBITMQ:-0}" = 1 ]; then "$repo/deploy/rabbitmq.sh" stop; fi
}

status() {
  for s in "${services[@]}"; do
    if alive "$s"; then echo "$s: running (pid $(cat "$run/$s.pid"))"; else echo "$s: stopped"; fi
  done
  if alive scaling-agent; then
    curl -fsS --max-time 2 "http://${AGENT_HTTP_ADDR:-127.0.0.1:9100}/state" 2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin); d = s.get("last_decision") or {}
print("processors: %s running, %s stopping (desired %s, reason %s)" % (d.get("actual"), s.get("stopping"), d.get("desired"), d.get("reason")))' || true
  fi
  curl -fsS --max-time 2 "$AWS_ENDPOINT_URL/_localstack/health" >/dev/null 2>&1 && echo "localstack: up" || echo "localstack: down"
  (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && echo "rabbitmq: up" || echo "rabbitmq: down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 1 ;;
esac
