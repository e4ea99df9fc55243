#!/usr/bin/env bash
# Benchmark (not a test) of the controller at scale: one large job through the host fleet
# (deploy/local.sh), with a freshly started controller so that its peak memory and counters are the
# job's own. Prints wall time (submit -> report), the controller's peak RSS (VmHWM), checkpoint
# objects and bytes it wrote (its "controller stopped" log line), SQS+S3 requests per 1,000
# transactions, the warehouse tables' objects (size against accounts.csv, encode time), and whether the totals equal those of `initiator local` over the same files.
#
#   deploy/bench-scale.sh [big|accounts|both] [CHUNK_SIZE]     defaults: both, chunks of 5000
#
#   big       10 files of 1,000,000 transactions (10,000,000, over 1,000 accounts), one job
#   accounts  1,000,000 transactions over 1,000,000 distinct accounts (each account once), one job
#
# Input files are generated once into the run directory ($FLEET_RUN_DIR, default .run/; about 0.7 GB
# for both); `rm .run/scale-*` removes them.
set -euo pipefail
what=${1:-both}
chunk=${2:-5000}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run=${FLEET_RUN_DIR:-$repo/.run}
export AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-http://127.0.0.1:4566} AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test} AWS_REGION=${AWS_REGION:-us-east-1}
"$repo/deploy/local.sh" up >/dev/null
bin="$repo/target/release/initiator"
mkdir -p "$run"

# SIGTERM, then wait for its drain (its last log line carries the checkpoint counters).
stop_controller() {
  local p
  if p=$(cat "$run/controller.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null; then
    kill -TERM "$p"
    for _ in $(seq 1 90); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$run/controller.pid"
}

scenario() {
  local name=$1; shift
  local files=("$@")
  echo "== $name: ${#files[@]} file(s), chunks of $chunk"
  stop_controller
  "$repo/deploy/local.sh" up >/dev/null
  local pid; pid=$(cat "$run/controller.pid")
  local log_from; log_from=$(wc -l <"$run/controller.log")
  local t0 t1 t3 code=0
  t0=$(date +%s.%N)
  "$bin" local "${files[@]}" --json >"$run/scale-$name-local.json"
  t1=$(date +%s.%N)
  "$bin" submit "${files[@]}" --chunk-size "$chunk" --wait --json >"$run/scale-$name-fleet.json" 2>"$run/scale-$name-submit.log" || code=$?
  t3=$(date +%s.%N)
  [ "$code" = 0 ] || { echo "submit failed (exit $code):"; tail -n 20 "$run/scale-$name-submit.log"; exit 1; }
  local hwm; hwm=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
  stop_controller
  local stopped; stopped=$(tail -n +"$((log_from + 1))" "$run/controller.log" | grep "controller stopped" | tail -n 1)
  local tables; tables=$(tail -n +"$((log_from + 1))" "$run/controller.log" | grep "warehouse tables written" | tail -n 1)
  # The job's objects as stored (LocalStack answers an unsigned HEAD): accounts.csv and the two tables'.
  local job day sizes=""
  job=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["job_id"])' "$run/scale-$name-fleet.json")
  day=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["finished_at"][:10])' "$run/scale-$name-fleet.json")
  for key in "warehouse/$job/accounts.csv" "tables/v2/accounts/billed_on=$day/$job.parquet" "tables/v2/jobs/billed_on=$day/$job.parquet"; do
    sizes="$sizes $(curl -sfI "$AWS_ENDPOINT_URL/${FLEET_BUCKET:-billing-fleet}/$key" | awk 'tolower($1)=="content-length:" {print $2+0}')"
  done
  python3 - "$run/scale-$name-local.json" "$run/scale-$name-fleet.json" "$t0" "$t1" "$t3" "$hwm" "$stopped" "$tables" "$sizes" <<'PY'
import json, re, sys
local, fleet = (json.load(open(p)) for p in sys.argv[1:3])
t0, t1, t3 = map(float, sys.argv[3:6])
hwm_kib, stopped, tables = int(sys.argv[6]), sys.argv[7], sys.argv[8]
sizes = [int(x) for x in sys.argv[9].split()] + [0, 0, 0]
field = lambda k: int(re.search(k + r"=(\d+)", stopped).group(1)) if re.search(k + r"=(\d+)", stopped) else -1
n = fleet["transactions"]["processed"]
req = fleet["requests"]
total = sum(req["sqs"].values()) + sum(req["s3"].values())
same = local["accounts"] == fleet["accounts"] and local["totals"] == fleet["totals"]
print(f"transactions            {n:,} over {len(fleet['accounts']):,} (account, currency) rows, status {fleet['status']}")
print(f"one process (local)     {t1 - t0:8.2f} s")
print(f"fleet submit -> report  {t3 - t1:8.2f} s   {n / (t3 - t1):12,.0f} txn/s")
print(f"controller peak RSS     {hwm_kib / 1024:8.1f} MiB")
print(f"checkpoint writes       {field('checkpoint_writes'):8d}     ({field('full_parts')} base parts, {field('delta_parts')} change parts)")
print(f"checkpoint bytes        {field('checkpoint_bytes') / 1e6:8.2f} MB")
print(f"SQS+S3 requests         {total:8d}     {total * 1000 / n:8.3f} per 1,000 transactions")
csv_b, acc_b, jobs_b = sizes[:3]
enc = re.search(r"encode_ms=(\d+)", tables)
print(f"warehouse tables        accounts {acc_b / 1e6:.2f} MB ({acc_b / max(csv_b, 1):.0%} of accounts.csv's {csv_b / 1e6:.2f} MB), jobs {jobs_b:,} B, encoded in {int(enc.group(1)) if enc else -1} ms")
print(f"totals identical        {'yes' if same else 'NO'}")
sys.exit(0 if same else 1)
PY
}

if [ "$what" = big ] || [ "$what" = both ]; then
  files=()
  for i in $(seq 1 10); do
    f="$run/scale-big-$i.csv"
    [ -s "$f" ] || "$bin" generate --rows 1000000 --accounts 1000 --seed "$i" >"$f"
    files+=("$f")
  done
  scenario big "${files[@]}"
fi
if [ "$what" = accounts ] || [ "$what" = both ]; then
  f="$run/scale-accounts.csv"
  [ -s "$f" ] || "$bin" generate --rows 1000000 --accounts 1000000 --every-account --seed 7 >"$f"
  scenario accounts "$f"
fi
"$repo/deploy/local.sh" up >/dev/null
