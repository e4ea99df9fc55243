#!/usr/bin/env bash
# Benchmark (not a test): what an idle fleet asks of SQS, and how long work that arrives with no
# trigger waits. Every fleet process (agent, controller, processors) talks to LocalStack through a
# counting proxy (deploy/counting-proxy.py), so the count is all of them, all told.
#
#   deploy/bench-idle.sh [WINDOW_SECS]     default 600 (ten minutes), counted from IDLE_SETTLE_SECS
#                                          (default 120) after a small job
#
# Then it submits a job with triggers off (--amqp-url ""): nothing announces it, so the fleet must
# find it by looking; it prints submit -> report against the agent's SLA. Agent settings pass through
# (AGENT_SLA_SECS, AGENT_IDLE_INTERVAL_SECS, ...). The host fleet (deploy/local.sh) is restarted
# behind the proxy and stopped at the end.
set -euo pipefail
window=${1:-600}
settle=${IDLE_SETTLE_SECS:-120}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run=${FLEET_RUN_DIR:-$repo/.run}
proxy_port=${IDLE_PROXY_PORT:-4567}
mkdir -p "$run"
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test} AWS_REGION=${AWS_REGION:-us-east-1}
bin="$repo/target/release/initiator"

"$repo/deploy/local.sh" down >/dev/null 2>&1 || true
python3 "$repo/deploy/counting-proxy.py" "$proxy_port" "${LOCALSTACK_PORT:-4566}" &
proxy=$!
trap 'kill $proxy 2>/dev/null; "$repo/deploy/local.sh" down >/dev/null 2>&1 || true' EXIT
export AWS_ENDPOINT_URL=http://127.0.0.1:$proxy_port
"$repo/deploy/local.sh" up >/dev/null
counts() { curl -fsS "http://127.0.0.1:$proxy_port/__counts"; }

"$bin" generate --rows 20000 --accounts 100 --seed 1 >"$run/idle-job.csv"
"$bin" submit "$run/idle-job.csv" --wait >/dev/null
echo "== a job done; settling ${settle} s, then counting ${window} s of idle"
sleep "$settle"
before=$(counts)
sleep "$window"
after=$(counts)
python3 - "$before" "$after" "$window" <<'PY'
import json, sys
before, after, window = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
diff = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
sqs = sum(v for k, v in diff.items() if k.startswith("sqs."))
print(f"idle SQS requests       {sqs:6d} in {window:.0f} s = {sqs * 3600 / window:6.1f} per hour")
for k, v in sorted(diff.items()):
    print(f"  {k:28s} {v:6d}")
PY

echo "== a job with no trigger (initiator --amqp-url \"\"), submitted to the idle fleet"
t0=$(date +%s.%N)
AMQP_URL="" "$bin" submit "$run/idle-job.csv" --wait >/dev/null
t1=$(date +%s.%N)
sla=$(curl -fsS "http://127.0.0.1:${AGENT_HTTP_ADDR_PORT:-9100}/state" | python3 -c 'import json,sys; print(json.load(sys.stdin)["policy"]["sla"]["secs"])' 2>/dev/null || echo "${AGENT_SLA_SECS:-60}")
python3 -c "t = $t1 - $t0; print(f'untriggered submit -> report {t:6.1f} s   (SLA {$sla} s: {\"within\" if t <= $sla else \"PAST\"})')"
