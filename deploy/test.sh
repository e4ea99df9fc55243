#!/usr/bin/env bash
# Runs the whole test suite: installs and starts what the tests need (RabbitMQ, LocalStack) when they are
# missing, then `cargo test --workspace`. Extra arguments go to cargo test.
set -euo pipefail
t0=$(date +%s)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The build starts at once, beside the installs below (mostly downloads): on a fresh machine it is
# the longest step. The end-to-end tests run the four binaries; `cargo test` builds only those of
# packages with tests (--tests: the same features as `cargo test`, so nothing is compiled twice).
build_log=$(mktemp "${TMPDIR:-/tmp}/fleet-build.XXXXXX")
# In a process group of its own (so that a stop ends the compilers too), below the installs' priority.
(cd "$repo" && exec setsid nice -n 10 cargo build --workspace --bins --tests --locked) >"$build_log" 2>&1 &
build_pid=$!
trap 'kill -- -"$build_pid" 2>/dev/null || true' EXIT
# The Kubernetes manifests against the Kubernetes schemas (strict).
"$repo/deploy/k8s/validate.sh"
# Debian's Chromium (the status page's browser test) and Prometheus (promtool for the alert rules).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "test.sh: ${missing[*]} missing: install them (apt-get install ${missing[*]}) or run as root" >&2; exit 1; }
  echo "test.sh: installing ${missing[*]} (Debian packages)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The alert rules, and the scrape configuration with a project filled in.
promtool check rules "$repo/deploy/prometheus/alerts.yml"
promtool test rules "$repo/deploy/prometheus/alerts_test.yml"
scrape=$(mktemp) && sed -e 's/@PROJECT@/test/g' -e "s#/etc/prometheus/alerts.yml#$repo/deploy/prometheus/alerts.yml#" "$repo/deploy/prometheus/prometheus.yml" >"$scrape"
promtool check config "$scrape" && rm -f "$scrape"
"$repo/deploy/rabbitmq.sh"
"$repo/localstack/start.sh"
# The fix the LocalStack runs with (localstack/patches): an S3 upload that breaks off leaves the object whole.
PYTHONPATH="$repo/localstack/patches" "${LOCALSTACK_VENV:-$HOME/.cache/billing-fleet/localstack-venv}/bin/python" "$repo/localstack/patches/check.py"
phase() { echo "test.sh: $1 ($(( $(date +%s) - t0 )) s since the start)"; }
# The warehouse's readers (pyarrow, DuckDB with httpfs; PyPI), for the test that reads its tables.
"$repo/deploy/warehouse/venv.sh" >/dev/null
phase "stack up"
# A test that needs LocalStack or RabbitMQ fails here when they are missing (outside this script it skips).
export FLEET_REQUIRE_STACK=1
export AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
# The broker's TLS listener (deploy/rabbitmq.sh made its certificate and CA).
export FLEET_AMQPS_URL=${FLEET_AMQPS_URL:-amqps://guest:guest@localhost:5671/%2f}
export FLEET_AMQPS_CA=${FLEET_AMQPS_CA:-/etc/rabbitmq/tls/ca.pem}
cd "$repo"
# The simulation's fresh seeds: a range of its own for each commit (printed, to replay).
if [ -z "${FLEET_SIM_FRESH_FROM:-}" ] && head=$(git -C "$repo" rev-parse --short=7 HEAD 2>/dev/null); then
  export FLEET_SIM_FRESH_FROM=$(( 0x$head % 900000000 + 100000000 ))
fi
echo "test.sh: the simulation's fresh seeds start at ${FLEET_SIM_FRESH_FROM:-(from the date)}"
build_rc=0
wait "$build_pid" || build_rc=$?
trap - EXIT
if [ "$build_rc" != 0 ]; then
  cat "$build_log" >&2 && rm -f "$build_log"
  echo "test.sh: the build failed (exit $build_rc)" >&2
  exit "$build_rc"
fi
grep -E '^(warning|error)' "$build_log" | sort | uniq -c || true
tail -n 1 "$build_log" && rm -f "$build_log"
phase "built"
if [ $# -gt 0 ]; then
  exec cargo test --workspace --locked "$@"
fi
# The four long outage scenarios (a dependency frozen for ten and three minutes; the tests mostly wait)
# run beside the rest, from the start, each through its own proxies on the same LocalStack and
# RabbitMQ; their output follows the rest's.
long=(outage::s3_hung_for outage::sqs_hung_for outage::rabbitmq_and_s3_down faults::s3_frozen_for)
# (The binary as `cargo test --workspace` builds it: the whole workspace's features, nothing rebuilt.)
it=$(cargo test --workspace --locked --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
print(next(m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact"
           and m["target"]["name"] == "it" and m["manifest_path"].endswith("deploy/e2e/Cargo.toml") and m.get("executable")))')
long_log=$(mktemp "${TMPDIR:-/tmp}/fleet-long-tests.XXXXXX")
(cd deploy/e2e && "$it" --test-threads=${#long[@]} "${long[@]}") >"$long_log" 2>&1 &
long_pid=$!
skips=()
for t in "${long[@]}"; do skips+=(--skip "$t"); done
rc=0
cargo test --workspace --locked -- "${skips[@]}" || rc=$?
phase "the rest done (exit $rc); waiting for the long outage tests"
long_rc=0
wait "$long_pid" || long_rc=$?
echo "---- the long outage tests (exit $long_rc) ----"
cat "$long_log" && rm -f "$long_log"
phase "done"
[ "$rc" = 0 ] && [ "$long_rc" = 0 ]
