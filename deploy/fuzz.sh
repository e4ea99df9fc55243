#!/usr/bin/env bash
# Fuzzes the parsers of untrusted input (CSV rows, chunk blobs, work items, result messages) with
# cargo-fuzz, SECONDS per target (default 60). Needs the nightly toolchain; installs cargo-fuzz from
# crates.io when missing. Crashes land in shared/fuzz/artifacts/<target>/ (controller/fuzz/ for result_message).
#   deploy/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
secs="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(csv_rows chunk_blob work_item result_message)
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
cargo +nightly fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked
for t in "${targets[@]}"; do
  # The domain's parsers are fuzzed from shared/fuzz, the controller's aggregator from controller/fuzz.
  case "$t" in result_message) dir=$repo/controller ;; *) dir=$repo/shared ;; esac
  echo "fuzz: $t for ${secs}s (in $dir/fuzz)"
  (cd "$dir" && cargo +nightly fuzz run --fuzz-dir fuzz "$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536)
done
echo "fuzz: no crash in ${#targets[@]} target(s) x ${secs}s"
