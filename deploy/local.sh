#!/usr/bin/env bash
# Brings the whole fleet up on this machine without Docker, or down again.
#
#   deploy/local.sh up      LocalStack + RabbitMQ (installed when missing), queues and bucket, release builds
#                           of processor, controller and scaling-agent started in the background.
#   deploy/local.sh down    stops what `up` started (by recorded pid): the services, then LocalStack.
#                           RabbitMQ is left running unless FLEET_STOP_RABBITMQ=1.
#   deploy/local.sh status  shows what runs.
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
services=(processor controller scaling-agent)

alive() { local p; p=$(cat "$run/$1.pid" 2>/dev/null) && [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }

up() {
  mkdir -p "$run"
  "$repo/deploy/rabbitmq.sh"
  LOCALSTACK_DIR=${LOCALSTACK_DIR:-$run/localstack} "$repo/localstack/start.sh"
  "$repo/localstack/init-resources.sh"
  echo "building release binaries (first time: a few minutes)"
  (cd "$repo" && cargo build --release --quiet -p processor -p controller -p scaling-agent -p initiator)
  for s in "${services[@]}"; do
    if alive "$s"; then echo "$s: already running (pid $(cat "$run/$s.pid"))"; continue; fi
    # State endpoints: processor on :9101, controller on :9102 (GET /state, /metrics; PUT /throttle).
    http=""
    case "$s" in processor) http=${PROCESSOR_HTTP_ADDR:-127.0.0.1:9101} ;; controller) http=${CONTROLLER_HTTP_ADDR:-127.0.0.1:9102} ;; esac
    LISTENER_HTTP_ADDR=$http nohup "$repo/target/release/$s" >>"$run/$s.log" 2>&1 </dev/null &
    echo $! >"$run/$s.pid"
    echo "$s: started (pid $!, log $run/$s.log)"
  done
  sleep 1
  for s in "${services[@]}"; do
    alive "$s" || { echo "$s exited at start; last log lines:" >&2; tail -n 20 "$run/$s.log" >&2; exit 1; }
  done
  echo "fleet up: AWS_ENDPOINT_URL=$AWS_ENDPOINT_URL; submit with target/release/initiator submit FILE --wait"
}

down() {
  for s in "${services[@]}"; do
    if alive "$s"; then
      local p; p=$(cat "$run/$s.pid")
      kill -TERM "$p"
      for _ in $(seq 1 70); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$p" 2>/dev/null && { echo "$s: did not stop in 35 s; killing" >&2; kill -KILL "$p"; }
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
  curl -fsS --max-time 2 "$AWS_ENDPOINT_URL/_localstack/health" >/dev/null 2>&1 && echo "localstack: up" || echo "localstack: down"
  (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && echo "rabbitmq: up" || echo "rabbitmq: down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 1 ;;
esac
