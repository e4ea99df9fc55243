#!/usr/bin/env bash
# Benchmark (not a test): what the controller's status page costs in AWS requests. One controller
# (no processor, no agent: the idle fleet's controller) talks to LocalStack through a counting proxy
# (deploy/counting-proxy.py); its requests are counted for PHASE_SECS each:
#
#   no tab      the controller alone (its partition rounds, its long polls): the baseline;
#   hidden tab  the page's script asks nothing while its tab is hidden: the same as no tab, by
#               construction (there is no request to count);
#   one tab     /status.json every 5 s, as the page's script asks while its tab is visible;
#   three tabs  three such pollers, out of step: the controller's cached document keeps the cost of one.
#
#   deploy/bench-page.sh [PHASE_SECS]    default 120; LocalStack must run (localstack/start.sh)
#
# Prints each phase's requests per hour and what the page added over the baseline. Uses the binary in
# FLEET_BIN_DIR (default target/release; target/debug counts the same).
set -euo pipefail
phase=${1:-120}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bins=${FLEET_BIN_DIR:-$repo/target/release}
proxy_port=${PAGE_PROXY_PORT:-4568}
page=127.0.0.1:${PAGE_PORT:-9301}
run=$(mktemp -d)
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test} AWS_REGION=${AWS_REGION:-us-east-1}
suffix=page$$
export FLEET_BUCKET=billing-fleet-$suffix FLEET_WORK_QUEUE=billing-work-$suffix FLEET_RESULTS_QUEUE=billing-results-$suffix
export AWS_ENDPOINT_URL=http://127.0.0.1:${LOCALSTACK_PORT:-4566}
"$bins/initiator" provision >/dev/null

python3 "$repo/deploy/counting-proxy.py" "$proxy_port" "${LOCALSTACK_PORT:-4566}" &
proxy=$!
pids=()
trap 'kill ${pids[@]+"${pids[@]}"} $proxy 2>/dev/null; rm -rf "$run"' EXIT
export AWS_ENDPOINT_URL=http://127.0.0.1:$proxy_port
sleep 1
CONTROLLER_PAGE_ADDR=$page LISTENER_HTTP_ADDR=127.0.0.1:0 AMQP_URL="" CONTROLLER_ID=bench-page \
  "$bins/controller" >"$run/controller.log" 2>&1 &
controller=$!
pids+=("$controller")
for _ in $(seq 1 80); do curl -fsS -o /dev/null "http://$page/status.json" 2>/dev/null && break; sleep 0.25; done
sleep 10
counts() { curl -fsS "http://127.0.0.1:$proxy_port/__counts"; }

# One phase: `tabs` pollers of /status.json every 5 s; prints the phase's counts as JSON.
measure() {
  local tabs=$1 pollers=() before after
  for i in $(seq 1 "$tabs"); do
    (sleep "$(( i * 2 - 2 ))"; while true; do curl -fsS -o /dev/null "http://$page/status.json" || true; sleep 5; done) &
    pollers+=($!)
  done
  before=$(counts)
  sleep "$phase"
  after=$(counts)
  [ ${#pollers[@]} -eq 0 ] || kill "${pollers[@]}" 2>/dev/null || true
  python3 -c 'import json,sys; b,a=json.loads(sys.argv[1]),json.loads(sys.argv[2]); print(json.dumps({k: a[k]-b.get(k,0) for k in a if a[k]-b.get(k,0)}))' "$before" "$after"
}

echo "== counting ${phase} s per phase (controller $page, proxy :$proxy_port)"
none=$(measure 0)
one=$(measure 1)
three=$(measure 3)
python3 - "$phase" "$none" "$one" "$three" <<'PY'
import json, sys
phase = float(sys.argv[1])
phases = [("no tab", json.loads(sys.argv[2])), ("hidden tab", json.loads(sys.argv[2])), ("one visible tab", json.loads(sys.argv[3])), ("three visible tabs", json.loads(sys.argv[4]))]
per_hour = lambda n: n * 3600 / phase
base = phases[0][1]
base_all = sum(base.values())
print(f"{'':20s} {'S3/h':>8s} {'SQS/h':>8s} {'all/h':>8s} {'page/h':>8s}")
for name, c in phases:
    s3 = sum(v for k, v in c.items() if k.startswith("s3."))
    sqs = sum(v for k, v in c.items() if k.startswith("sqs."))
    print(f"{name:20s} {per_hour(s3):8.0f} {per_hour(sqs):8.0f} {per_hour(s3 + sqs):8.0f} {per_hour(s3 + sqs - base_all):8.0f}")
for name, c in phases[2:]:
    extra = {k: v - base.get(k, 0) for k, v in c.items() if v - base.get(k, 0) > 0}
    print(f"  {name} over no tab: " + ", ".join(f"{k} {per_hour(v):.0f}/h" for k, v in sorted(extra.items())))
PY
