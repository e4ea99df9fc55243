#!/usr/bin/env bash
# Demo: brings the fleet up on this machine (deploy/local.sh up), generates ~100,000 transactions,
# submits them as one job, waits for the controller's report and prints the summary.
#   deploy/demo.sh [ROWS]
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rows=${1:-100000}
run=${FLEET_RUN_DIR:-$repo/.run}
export AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-http://127.0.0.1:4566} AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test} AWS_REGION=${AWS_REGION:-us-east-1}
"$repo/deploy/local.sh" up
mkdir -p "$run"
# A fresh seed each run: the same ids twice are billed once (docs/claims.md).
"$repo/target/release/initiator" generate --rows "$rows" --accounts 1000 --seed "$(date +%s)" >"$run/demo.csv"
echo "submitting $rows transactions from $run/demo.csv"
exec "$repo/target/release/initiator" submit "$run/demo.csv" --wait
