#!/usr/bin/env bash
# What the tests catch: every fix of the controller undone in turn (controller::undo), the
# simulation's seeds to the first failure and the unit tests that fail (the controller's and its
# core's, each built with the switches: controller-undoable, controller-core-undoable).
#   deploy/mutations.sh [SEEDS]      # SEEDS per fix, 1000 by default; prints a markdown table
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${1:-1000}
cargo build -q -p fleet-sim
cargo test -q -p controller-undoable -p controller-core-undoable --lib --no-run 2>/dev/null
echo "## The simulation ($seeds seeds per fix)"
./target/debug/fleet-sim --mutations --seeds "$seeds"
echo
echo "## The controller's and its core's unit tests"
echo "| fix undone | unit tests failing |"
echo "|---|---|"
./target/debug/fleet-sim --undo list | while read -r name _; do
  out=$( (CONTROLLER_UNDO="$name" cargo test -q -p controller-undoable --lib 2>&1; CONTROLLER_UNDO="$name" cargo test -q -p controller-core-undoable --lib 2>&1) || true)
  failing=$(printf '%s\n' "$out" | sed -n 's/^    \([a-z_:0-9]*\)$/\1/p' | sort -u | tr '\n' ' ')
  echo "| $name | ${failing:-none} |"
done
