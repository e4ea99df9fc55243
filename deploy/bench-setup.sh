# Sourced by the benchmarks: fleet up, local AWS environment, generated input.
# In: rows, mode (host: deploy/local.sh, compose: deploy/compose.sh), BENCH_ACCOUNTS (1000).
# Out: repo, run, bin (initiator), data (CSV path).
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run=${FLEET_RUN_DIR:-$repo/.run}
accounts=${BENCH_ACCOUNTS:-1000}
export AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-http://127.0.0.1:4566} AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-test}
export AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-test} AWS_REGION=${AWS_REGION:-us-east-1}
if [ "${mode:-host}" = compose ]; then "$repo/deploy/compose.sh" up >/dev/null; else "$repo/deploy/local.sh" up >/dev/null; fi
mkdir -p "$run"
bin="$repo/target/release/initiator"
# A fresh seed per run (BENCH_SEED to repeat one): rows already billed are not billed again
# (docs/claims.md), so a run of the same ids on a fleet that billed them measures duplicates.
seed=${BENCH_SEED:-$(date +%s)}
data="$run/bench-$rows-$accounts-$seed.csv"
rm -f "$run"/bench-"$rows"-"$accounts"-*.csv
[ -s "$data" ] || "$bin" generate --rows "$rows" --accounts "$accounts" --seed "$seed" >"$data"
