#!/usr/bin/env bash
# Builds every image docker-compose.yml needs without an image registry, from what this machine reaches
# (Debian's packages, PyPI, crates.io), reusing the images that are up to date.
#
#   deploy/images.sh [base|localstack|rabbitmq|fleet]...     (default: all four, in that order)
#   deploy/images.sh --print                                 the image names, as compose.sh passes them
#   deploy/images.sh --remove                                removes this prefix's images
#
#   base        Debian bookworm, `debootstrap --variant=minbase` (+ ca-certificates), `docker import`;
#               and the same of Debian trixie for LocalStack. Built once; FLEET_REBUILD_BASE=1 rebuilds them.
#   localstack  deploy/images/localstack: localstack-core 2026.3.0 from PyPI (pinned by
#               localstack/constraints.txt, as deploy/local.sh's) on trixie's Python 3.13.
#   rabbitmq    deploy/images/rabbitmq: Debian's rabbitmq-server + management plugin.
#   prometheus  deploy/images/prometheus: Debian's prometheus with deploy/prometheus's configuration and
#               rules (only for `compose.sh up` with FLEET_MONITORING=1, or asked for by name).
#   fleet       deploy/Dockerfile, stage `prebuilt`: `cargo build --release` on this host (incremental),
#               binaries copied onto the base. Seconds after a code change (plus cargo's own time).
# localstack, rabbitmq and fleet carry a label with a hash of their inputs (files and base image), and
# are rebuilt only when it changes.
#
# Environment: FLEET_IMAGE_PREFIX (billing-fleet), DEBIAN_MIRROR (http://deb.debian.org/debian),
# CARGO (cargo), FLEET_BINARIES (a directory holding the four binaries, built already: the fleet image
# takes them instead of a `cargo build --release`; the container tests pass their own build's).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
label=org.billing-fleet.inputs
work=""
cleanup() { [ -z "$work" ] || rm -rf "$work"; }
trap cleanup EXIT
scratch() { [ -n "$work" ] || work=$(mktemp -d "${TMPDIR:-/var/tmp}/billing-fleet-images.XXXXXX"); }

hash_of() { sha256sum "$@" | sha256sum | cut -c1-16; }
base_id() { docker image inspect -f '{{.Id}}' "${1:-$base_image}"; }
took() { echo "$1: $2 ($(( $(date +%s) - $3 )) s)"; }

# build_base [SUITE]: $prefix/debian:SUITE (bookworm: $base_image, the fleet's, RabbitMQ's and
# Prometheus's; trixie: $localstack_base_image, LocalStack's, for Python 3.13).
bases_done=" "
build_base() {
  local suite=${1:-bookworm} base_image
  base_image="$prefix/debian:$suite"
  case "$bases_done" in *" $suite "*) return 0 ;; esac
  bases_done="$bases_done$suite "
  if image_exists "$base_image" && [ "${FLEET_REBUILD_BASE:-0}" != 1 ]; then echo "base: $base_image exists"; return; fi
  local t0; t0=$(date +%s)
  [ "$(id -u)" = 0 ] || die "base: debootstrap needs root (run deploy/images.sh as root, or build $base_image elsewhere)"
  if ! command -v debootstrap >/dev/null 2>&1; then
    echo "base: installing debootstrap (Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  scratch
  local root="$work/rootfs"
  echo "base: debootstrap --variant=minbase $suite from $mirror (about half a minute)"
  debootstrap --variant=minbase --include=ca-certificates "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 20 "$work/debootstrap.log" >&2; die "base: debootstrap failed (log above)"; }
  # As Debian's own slim images: no docs, man pages or locales, no apt caches; security updates on.
  cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$root/etc/apt/apt.conf.d/docker-no-recommends"
  printf 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };\n' >"$root/etc/apt/apt.conf.d/docker-clean"
  find "$root/usr/share/doc" -mindepth 2 -not -name copyright -not -type d -delete
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/*
  tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["bash"]' \
    -m "debootstrap --variant=minbase $suite $mirror" - "$base_image" >/dev/null
  rm -rf "$root"
  took base "built $base_image" "$t0"
}

# build_dir IMAGE NAME CONTEXT_DIR [BASE]: a Dockerfile in CONTEXT_DIR on BASE (the bookworm base), rebuilt
# when its inputs change.
build_dir() {
  local image=$1 name=$2 dir=$3 base=${4:-$base_image} ca="" inputs t0
  inputs=$( (cd "$dir" && hash_of $(find . -type f | sort); base_id "$base") | sha256sum | cut -c1-16)
  if [ "$(image_label "$image" "$label")" = "$inputs" ]; then echo "$name: $image is up to date"; return; fi
  t0=$(date +%s)
  scratch
  rm -rf "$work/$name" && cp -r "$dir" "$work/$name"
  # The CAs this host trusts for HTTPS downloads (PIP_CERT or SSL_CERT_FILE, when set: a host behind a
  # TLS-inspecting proxy needs them in the build too); empty otherwise.
  for f in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}"; do [ -n "$f" ] && [ -s "$f" ] && { ca=$f; break; }; done
  if [ -n "$ca" ]; then cp "$ca" "$work/$name/build-ca.crt"; else : >"$work/$name/build-ca.crt"; fi
  echo "$name: building $image"
  docker build -q --build-arg "BASE_IMAGE=$base" --label "$label=$inputs" -t "$image" "$work/$name" >"$work/$name.log" 2>&1 \
    || { tail -n 30 "$work/$name.log" >&2; die "$name: docker build failed (log above)"; }
  took "$name" "built $image" "$t0"
}

# LocalStack: its image's Dockerfile with the pins deploy/local.sh's LocalStack installs with.
build_localstack() {
  scratch
  rm -rf "$work/localstack-context" && mkdir -p "$work/localstack-context"
  cp "$repo"/deploy/images/localstack/* "$repo"/localstack/constraints.txt "$repo"/localstack/patches/sitecustomize.py "$work/localstack-context/"
  build_dir "$localstack_image" localstack "$work/localstack-context" "$localstack_base_image"
  # An earlier version's image (4.13.1 before 2026-11-27) would stay on disk unused.
  local old
  for old in $(docker images "$prefix/localstack" --format '{{.Repository}}:{{.Tag}}'); do
    [ "$old" != "$localstack_image" ] || continue
    if docker image rm "$old" >/dev/null 2>&1; then echo "localstack: removed $old (an earlier version)"
    else echo "localstack: kept $old (an earlier version, still used by a container)"; fi
  done
}

# Prometheus: its image's Dockerfile and entrypoint with the fleet's scrape configuration and rules.
build_prometheus() {
  scratch
  rm -rf "$work/prometheus-context" && mkdir -p "$work/prometheus-context"
  cp "$repo"/deploy/images/prometheus/* "$repo"/deploy/prometheus/prometheus.yml "$repo"/deploy/prometheus/alerts.yml "$work/prometheus-context/"
  build_dir "$prometheus_image" prometheus "$work/prometheus-context"
}

build_fleet() {
  local t0 target inputs
  t0=$(date +%s)
  # Host-built binaries must not need a newer glibc than the base image's (bookworm: 2.36).
  local glibc; glibc=$(ldd --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+$' || echo 0)
  if [ "$(printf '%s\n2.36\n' "$glibc" | sort -V | tail -n1)" != 2.36 ]; then
    die "fleet: this host's glibc $glibc is newer than Debian bookworm's 2.36: its binaries would not run in $base_image; build with a registry instead (FLEET_IMAGE_SOURCE=registry deploy/compose.sh up)"
  fi
  if [ -n "${FLEET_BINARIES:-}" ]; then
    # Binaries built already (the test suite's own build): not compiled a second time, in another profile.
    target=$FLEET_BINARIES
    echo "fleet: the binaries in $target (FLEET_BINARIES)"
  else
    echo "fleet: cargo build --release (incremental)"
    (cd "$repo" && "${CARGO:-cargo}" build --release --locked --quiet -p initiator -p processor -p controller -p scaling-agent)
    target=$(cd "$repo" && "${CARGO:-cargo}" metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release
  fi
  local bins=("$target/initiator" "$target/processor" "$target/controller" "$target/scaling-agent") b
  for b in "${bins[@]}"; do [ -x "$b" ] || die "fleet: $b is missing (FLEET_BINARIES names a directory with the four binaries)"; done
  inputs=$( (hash_of "${bins[@]}" "$repo/deploy/Dockerfile"; base_id) | sha256sum | cut -c1-16)
  if [ "$(image_label "$fleet_image" "$label")" = "$inputs" ]; then took fleet "$fleet_image is up to date" "$t0"; return; fi
  scratch
  mkdir -p "$work/fleet/bin"
  cp "${bins[@]}" "$work/fleet/bin/"
  # Without DWARF line tables (150 MB -> 28 MB a binary); symbols stay, so backtraces name functions.
  if command -v strip >/dev/null 2>&1; then strip --strip-debug "$work"/fleet/bin/*; fi
  docker build -q -f "$repo/deploy/Dockerfile" --target prebuilt --build-arg "RUNTIME_IMAGE=$base_image" \
    --label "$label=$inputs" -t "$fleet_image" "$work/fleet" >"$work/fleet.log" 2>&1 \
    || { tail -n 30 "$work/fleet.log" >&2; die "fleet: docker build failed (log above)"; }
  rm -rf "$work/fleet"
  took fleet "built $fleet_image" "$t0"
}

case "${1:-}" in
  --print)
    printf 'FLEET_IMAGE=%s\nLOCALSTACK_IMAGE=%s\nRABBITMQ_IMAGE=%s\nPROMETHEUS_IMAGE=%s\n' "$fleet_image" "$localstack_image" "$rabbitmq_image" "$prometheus_image"
    exit 0 ;;
  --remove)
    need_docker
    for i in "$fleet_image" "$localstack_image" "$rabbitmq_image" "$prometheus_image" "$base_image" "$localstack_base_image"; do
      image_exists "$i" && docker image rm "$i" >/dev/null && echo "removed $i"
    done
    docker image prune -f --filter "label=$label" >/dev/null || true
    exit 0 ;;
esac

need_docker
[ $# -gt 0 ] || set -- base localstack rabbitmq fleet
for what in "$@"; do
  case "$what" in
    base) build_base; build_base trixie ;;
    localstack) build_base trixie; build_localstack ;;
    rabbitmq) build_base; build_dir "$rabbitmq_image" rabbitmq "$repo/deploy/images/rabbitmq" ;;
    fleet) build_base; build_fleet ;;
    prometheus) build_base; build_prometheus ;;
    *) die "usage: $0 [base|localstack|rabbitmq|fleet|prometheus]... | --print | --remove" ;;
  esac
done
# Earlier builds of these images, untagged by the ones just built.
docker image prune -f --filter "label=$label" >/dev/null || true
