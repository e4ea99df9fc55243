#!/usr/bin/env bash
# Runs the whole test suite: installs and starts what the tests need (RabbitMQ, LocalStack) when they are
# missing, then `cargo test --workspace`. Extra arguments go to cargo test.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
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
# A test that needs LocalStack or RabbitMQ fails here when they are missing (outside this script it skips).
export FLEET_REQUIRE_STACK=1
export AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
# The broker's TLS listener (deploy/rabbitmq.sh made its certificate and CA).
export FLEET_AMQPS_URL=${FLEET_AMQPS_URL:-amqps://guest:guest@localhost:5671/%2f}
export FLEET_AMQPS_CA=${FLEET_AMQPS_CA:-/etc/rabbitmq/tls/ca.pem}
cd "$repo"
# The end-to-end tests run the four binaries; `cargo test` builds only those of packages with tests
# (--tests: the same features as `cargo test`, so nothing is compiled twice).
cargo build --workspace --bins --tests --locked
cargo test --workspace --locked "$@"
