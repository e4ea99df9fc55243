# Sourced by deploy/images.sh and deploy/compose.sh: image names, the compose command, small helpers.
#
# Images (FLEET_IMAGE_PREFIX, default billing-fleet; the tests use their own prefix):
#   $prefix/debian:bookworm        base: debootstrap --variant=minbase from Debian's packages
#   $prefix/debian:trixie          the same of trixie (Python 3.13), LocalStack's base
#   $prefix/localstack:2026.3.0    localstack-core from PyPI on the trixie base (SQS, S3)
#   $prefix/rabbitmq:3.10          Debian's rabbitmq-server with the management plugin
#   $prefix/fleet:latest           the four binaries, built on this host, on the base
#   $prefix/prometheus:2.42        Debian's prometheus with the fleet's scrape config and alert rules
# docker-compose.yml names the official images by default; FLEET_IMAGE_SOURCE=local (compose.sh's
# default) swaps in these through FLEET_IMAGE, LOCALSTACK_IMAGE and RABBITMQ_IMAGE.

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
prefix=${FLEET_IMAGE_PREFIX:-billing-fleet}
localstack_version=2026.3.0
base_image="$prefix/debian:bookworm"
localstack_base_image="$prefix/debian:trixie"
localstack_image="$prefix/localstack:$localstack_version"
rabbitmq_image="$prefix/rabbitmq:3.10"
fleet_image="$prefix/fleet:latest"
prometheus_image="$prefix/prometheus:2.42"

die() { echo "$*" >&2; exit 1; }

# The Docker Engine answers, or a clear error.
need_docker() {
  command -v docker >/dev/null 2>&1 || die "docker: command not found (install Docker Engine with Compose)"
  docker info >/dev/null 2>&1 || die "docker: no Docker Engine answers ($(docker info 2>&1 | grep -m1 -i -E 'error|cannot' || echo 'docker info failed'))"
}

# `docker compose` (v2) where it exists, else `docker-compose` (v1, Debian's package), on the fleet's file.
compose_cmd=()
find_compose() {
  if docker compose version >/dev/null 2>&1; then compose_cmd=(docker compose)
  elif command -v docker-compose >/dev/null 2>&1; then compose_cmd=(docker-compose)
  else die "docker compose: neither 'docker compose' nor 'docker-compose' is installed"; fi
}
compose() { "${compose_cmd[@]}" -f "$repo/deploy/docker-compose.yml" "$@"; }

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }
image_label() { docker image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true; }
