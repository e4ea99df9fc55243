#!/usr/bin/env bash
# Benchmark (not a test): the controller's peak RSS under a flood of crafted results (well-formed bombs
# that pass the records check and decode up to their chunk's cap), for two decode budgets. Starts
# RabbitMQ and LocalStack when they are missing.
#
#   deploy/bench-flood.sh [MESSAGES]        default 2000
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/deploy/rabbitmq.sh" >/dev/null
"$repo/localstack/start.sh" >/dev/null
export FLEET_REQUIRE_STACK=1 AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f} FLOOD_MESSAGES=${1:-2000}
cd "$repo"
cargo build --workspace --bins --locked -q
log=$(mktemp)
if ! cargo test -p fleet-e2e --test it --locked -- --ignored --nocapture bench_controller_rss_under_a_flood >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; exit 1
fi
grep '^==' "$log"; rm -f "$log"
