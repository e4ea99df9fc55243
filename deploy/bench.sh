#!/usr/bin/env bash
# Benchmark (not a test): submits generated transactions through the running fleet and prints wall
# time, transactions per second and SQS/S3 requests per 1,000 transactions, next to the time the same
# rows take in one process with no queues (parse, validate, bill). Also checks both give the same
# per-account totals.
#
#   deploy/bench.sh [--compose] [ROWS] [CHUNK_SIZE]     defaults: 1000000 transactions, the initiator's
#                                                       chunk size (chosen per job)
#
# Host mode brings the fleet up with deploy/local.sh first; --compose with deploy/compose.sh up (the
# initiator is then executed in the cli container: the time that takes alone is measured and shown).
# Either is safe when the fleet already runs.
set -euo pipefail
mode=host
if [ "${1:-}" = --compose ]; then mode=compose; shift; fi
rows=${1:-1000000}
chunk=${2:-}
chunk_flags=()
[ -z "$chunk" ] || chunk_flags=(--chunk-size "$chunk")
source "$(dirname "${BASH_SOURCE[0]}")/bench-setup.sh"
if [ "$mode" = host ]; then
  fleet_submit=("$bin" submit)
else
  fleet_submit=("$repo/deploy/compose.sh" submit)
  s0=$(date +%s.%N); "$repo/deploy/compose.sh" initiator --version >/dev/null 2>&1; s1=$(date +%s.%N)
  echo "== initiator start in compose: $(python3 -c "print(f'{$s1 - $s0:.2f}')") s (compose.sh initiator --version)"
fi

echo "== one process, no queues: $rows transactions"
t0=$(date +%s.%N)
"$bin" local "$data" --json >"$run/bench-local.json"
t1=$(date +%s.%N)

echo "== fleet ($mode): submit -> report, chunks of ${chunk:-the default size}"
t2=$(date +%s.%N)
code=0
"${fleet_submit[@]}" "$data" "${chunk_flags[@]}" --wait --json >"$run/bench-fleet.json" 2>"$run/bench-submit.log" || code=$?
t3=$(date +%s.%N)
[ "$code" = 0 ] || { echo "submit failed (exit $code):"; cat "$run/bench-submit.log"; exit 1; }

python3 - "$run/bench-local.json" "$run/bench-fleet.json" "$t0" "$t1" "$t2" "$t3" <<'PY'
import json, sys
local, fleet = (json.load(open(p)) for p in sys.argv[1:3])
t0, t1, t2, t3 = map(float, sys.argv[3:7])
lt, ft = t1 - t0, t3 - t2
n = fleet["transactions"]["processed"]
req = fleet["requests"]
sqs, s3 = sum(req["sqs"].values()), sum(req["s3"].values())
same = local["accounts"] == fleet["accounts"] and local["totals"] == fleet["totals"]
print(f"transactions          {n}")
print(f"one process           {lt:8.3f} s   {n / lt:12,.0f} txn/s")
print(f"fleet submit->report  {ft:8.3f} s   {n / ft:12,.0f} txn/s")
print(f"fleet overhead        {ft - lt:8.3f} s   ({ft / lt:.1f}x the one-process time)")
print(f"SQS requests          {sqs:8d}     {sqs * 1000 / n:8.3f} per 1,000 transactions  {req['sqs']}")
print(f"S3 requests           {s3:8d}     {s3 * 1000 / n:8.3f} per 1,000 transactions  {req['s3']}")
print(f"SQS+S3                {sqs + s3:8d}     {(sqs + s3) * 1000 / n:8.3f} per 1,000 transactions")
cost = req.get("cost")
if cost:
    print(f"request cost          ${cost['total_usd']} (SQS ${cost['sqs_usd']}, S3 ${cost['s3_usd']}), ${cost['per_million_transactions_usd']} per million transactions at {cost['prices']}")
print(f"totals identical      {'yes' if same else 'NO'}")
sys.exit(0 if same else 1)
PY
