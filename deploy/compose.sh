#!/usr/bin/env bash
# The fleet on Docker Compose: LocalStack, RabbitMQ, processor(s), controller and scaling agent, each a
# container (deploy/docker-compose.yml); the initiator executed in the running `cli` container, or a
# one-off container when it needs files mounted.
#
#   deploy/compose.sh up                    builds missing/outdated images (deploy/images.sh), starts the fleet,
#                                           waits until it is healthy, prints where to look
#   deploy/compose.sh submit FILE... [FLAGS] submits CSV files with the initiator (FLAGS as `initiator
#                                           submit`, e.g. --wait --json); its exit code. One file, with no
#                                           terminal, goes on standard input to `cli`; else the files are
#                                           mounted read-only in a one-off container that shows progress
#   deploy/compose.sh initiator ARGS...     any other initiator command (status JOB, report JOB, generate ...)
#   deploy/compose.sh scale N               N processor containers (scaling down drains: SIGTERM, then wait); with
#                                           the agent's docker backend (the default) it scales them on its own
#                                           afterwards: AGENT_BACKEND=none at `up` leaves the count to you
#   deploy/compose.sh ps                    containers and their state endpoints
#   deploy/compose.sh logs [ARGS...]        `docker compose logs` (e.g. -f processor)
#   deploy/compose.sh down                  stops and removes the fleet's containers and network
#   deploy/compose.sh demo [ROWS]           up, generate ROWS (100,000) transactions, submit --wait, report
#   deploy/compose.sh images                deploy/images.sh
#
# Environment:
#   COMPOSE_PROJECT_NAME     billing-fleet
#   FLEET_IMAGE_SOURCE       local (default: images built here by deploy/images.sh, no registry needed) or
#                            registry (official LocalStack and RabbitMQ images, fleet built from deploy/Dockerfile)
#   FLEET_PROCESSORS         processors started by `up` (1; a running fleet keeps its count); `scale` changes it
#   FLEET_MONITORING         1: `up` also starts Prometheus (profile "monitoring": every service scraped,
#                            deploy/prometheus/alerts.yml loaded) on 127.0.0.1:FLEET_PROMETHEUS_PORT (9090)
#   AGENT_BACKEND            docker (the agent scales the processor containers) or none (it only decides)
#   AGENT_MIN_INSTANCES, AGENT_MAX_INSTANCES, AGENT_SLA_SECS, ...: the agent's policy (scaling-agent --help)
#   FLEET_LOCALSTACK_PORT    LocalStack on 127.0.0.1 (4566; empty: a free port)
#   FLEET_RABBITMQ_UI_PORT   RabbitMQ management on 127.0.0.1 (15672; empty: a free port)
#   FLEET_IMAGE_PREFIX, FLEET_IMAGE, LOCALSTACK_IMAGE, RABBITMQ_IMAGE: see deploy/images.sh
#   FLEET_WORK_QUEUE, FLEET_RESULTS_QUEUE, FLEET_BUCKET: resource names (the defaults otherwise)
#   FLEET_AMQP_PASSWORD      the broker user `fleet`'s password; generated once into deploy/.env (0600, git
#                            ignores it), which Compose reads by itself, so plain `docker compose` works too
#
# The status page's bearer token (job reports need it): deploy/.page-token, 32 random hex digits
# generated once (git ignores it), mounted read-only into the controller; `up` prints where it is.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-billing-fleet}
source_kind=${FLEET_IMAGE_SOURCE:-local}
case "$source_kind" in
  local)
    export FLEET_IMAGE=${FLEET_IMAGE:-$fleet_image} LOCALSTACK_IMAGE=${LOCALSTACK_IMAGE:-$localstack_image}
    export RABBITMQ_IMAGE=${RABBITMQ_IMAGE:-$rabbitmq_image} PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-$prometheus_image}
    build_flag=--no-build ;;
  registry) build_flag=--build ;;
  *) die "FLEET_IMAGE_SOURCE must be local or registry (is '$source_kind')" ;;
esac
fleet_services=(processor controller scaling-agent)
# The agent reaches the Docker Engine through its socket, with the socket's group (not as root).
# The socket's own group, read, never guessed: without it the agent would get group 0 (root's).
DOCKER_GID=${DOCKER_GID:-$(stat -c %g "${DOCKER_SOCKET:-/var/run/docker.sock}" 2>/dev/null || true)}
[[ $DOCKER_GID =~ ^[0-9]+$ ]] || die "cannot read the group of the Docker socket ${DOCKER_SOCKET:-/var/run/docker.sock}: is the Docker Engine running? (or set DOCKER_GID)"
export DOCKER_GID

# The broker's password: generated once (128 random bits, hex) into deploy/.env, which Compose reads
# from the compose file's directory. A broker keeps the user it made on first boot, so the file stays
# as it is while the fleet exists; `down` removes the broker with its data.
env_file="$repo/deploy/.env"
# The socket's group is recorded there too (refreshed each run), so plain `docker compose` commands
# find it as they find the password.
if grep -q '^DOCKER_GID=' "$env_file" 2>/dev/null; then
  sed -i "s/^DOCKER_GID=.*/DOCKER_GID=$DOCKER_GID/" "$env_file"
else
  (umask 077; printf 'DOCKER_GID=%s\n' "$DOCKER_GID" >>"$env_file")
fi
if [ -z "${FLEET_AMQP_PASSWORD:-}" ] && ! grep -q '^FLEET_AMQP_PASSWORD=.' "$env_file" 2>/dev/null; then
  (umask 077; printf 'FLEET_AMQP_PASSWORD=%s\n' "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" >>"$env_file")
  echo "compose: generated the broker's password into $env_file" >&2
fi

# The status page's bearer token: generated once (128 random bits, hex) into deploy/.page-token,
# which the compose file mounts into the controller (secret fleet-page-token). The controller reads
# it as user 65534: made that user's own (0400) when this runs as root, else readable by all (0644;
# the page's host port is on 127.0.0.1 only).
page_token="$repo/deploy/.page-token"
if [ ! -s "$page_token" ]; then
  (umask 077; od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$page_token")
  echo "compose: generated the status page's token into $page_token" >&2
fi
if [ "$(id -u)" = 0 ]; then
  chown 65534:65534 "$page_token" && chmod 0400 "$page_token"
else
  # (Left as it is when root made it user 65534's: the controller reads it all the same.)
  chmod 0644 "$page_token" 2>/dev/null || true
fi

# The roles' keys (docs/security.md, authority by role): one file per role, generated once into
# deploy/.keys/ (0700: no other user of this machine reaches them; git ignores it). The compose file
# mounts them as secrets: a processor signs with processor.key, the initiator (cli, one-off
# containers) with submitter.key, and the controllers hold all four (their keyring) and count a
# message only when a role that may send it signed it. The services read them as user 65534, the
# initiator as the calling user (every capability dropped, so root too reads by the file's mode):
# user 65534's and the calling user's group's (0440) when this runs as root, else 0644 inside the
# closed directory. The scaling agent's new processors keep the processor's key
# (AGENT_DOCKER_SECRET_FILES: that file as the Docker Engine sees it, recorded in deploy/.env).
keys_dir="$repo/deploy/.keys"
(umask 077; mkdir -p "$keys_dir")
chmod 0700 "$keys_dir" 2>/dev/null || true
new_keys=()
for role in submitter operator processor controller; do
  key="$keys_dir/$role.key"
  if [ ! -s "$key" ]; then
    (umask 077; printf '%s %s\n' "$role" "$(head -c 32 /dev/urandom | base64 -w0)" >"$key") \
      || die "cannot write $key (made by another user? fix its ownership or run as that user)"
    new_keys+=("$role")
  fi
  if [ "$(id -u)" = 0 ]; then
    { chown "65534:$(id -g)" "$key" && chmod 0440 "$key"; } || die "cannot hand $key to user 65534"
  elif ! chmod 0644 "$key" 2>/dev/null || [ ! -r "$key" ]; then
    die "$key is not this user's to read (made by root? run as root, or remove deploy/.keys to make new keys with no job in flight)"
  fi
done
[ ${#new_keys[@]} = 0 ] || echo "compose: generated the role keys of ${new_keys[*]} into $keys_dir" >&2
# Recorded in deploy/.env (rewritten, not edited in place: the path may hold any character).
export FLEET_PROCESSOR_KEY="$keys_dir/processor.key"
{ grep -v -e '^FLEET_PROCESSOR_KEY=' -e '^FLEET_KEYS_DIR=' "$env_file" 2>/dev/null || true; printf 'FLEET_PROCESSOR_KEY=%s\n' "$FLEET_PROCESSOR_KEY"; } >"$env_file.new"
chmod 0600 "$env_file.new" && mv "$env_file.new" "$env_file"

# Container ids of a service (running or not; not one-off containers), read from the labels Compose
# puts on them (the project name as Compose normalises it), without a Compose call (half a second each
# for docker-compose 1.x).
project_label=$(printf '%s' "$COMPOSE_PROJECT_NAME" | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9_-')
# Where `submit` hard-links a file for the cli container to read (mounted read-only at /inbox).
export FLEET_INBOX=${FLEET_INBOX:-$repo/.run/inbox/$project_label}
ids() {
  docker ps -aq --filter "label=com.docker.compose.project=$project_label" \
    --filter "label=com.docker.compose.service=$1" --filter "label=com.docker.compose.oneoff=False" "${@:2}" 2>/dev/null || true
}
running() { ids "$1" --filter status=running; }
count() { running "$1" | grep -c . || true; }
host_port() { docker port "$1" "$2/tcp" 2>/dev/null | grep -m1 -E '^127\.0\.0\.1:' || true; }
name_of() { docker inspect -f '{{.Name}}' "$1" | sed 's#^/##'; }

need_up() {
  [ -n "$(running localstack)" ] || { need_docker; echo "the fleet is not up (project $COMPOSE_PROJECT_NAME): run deploy/compose.sh up first" >&2; exit 3; }
}

# A host port asked for must be free, or already ours.
check_port() {
  local var=$1 default=$2 service=$3 target=$4 port
  port=${!var-$default}
  [ -n "$port" ] || return 0
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || return 0
  local id; for id in $(running "$service"); do [ "$(host_port "$id" "$target")" = "127.0.0.1:$port" ] && return 0; done
  die "127.0.0.1:$port is in use by another program (for $service; deploy/local.sh's? stop it with deploy/local.sh down), or set $var to another port, or empty for a free one"
}

show() {
  local id port n=0
  echo "fleet $COMPOSE_PROJECT_NAME:"
  for id in $(running localstack); do echo "  LocalStack     http://$(host_port "$id" 4566)   (AWS_ENDPOINT_URL for aws and the initiator on this host)"; done
  for id in $(running rabbitmq); do
    port=$(host_port "$id" 15672); [ -z "$port" ] || echo "  RabbitMQ UI    http://$port   (user fleet, password FLEET_AMQP_PASSWORD in deploy/.env)"
  done
  for id in $(running processor); do n=$((n + 1)); echo "  processor      http://$(host_port "$id" 9101)/state  /metrics   ($(name_of "$id"))"; done
  for id in $(running controller); do
    echo "  status page    http://$(host_port "$id" 9300)/   (controller $(name_of "$id"); job reports with the bearer token in $page_token)"
    echo "  controller     http://$(host_port "$id" 9102)/state  /metrics"
  done
  for id in $(running scaling-agent); do echo "  scaling-agent  http://$(host_port "$id" 9100)/state  /metrics   (scaling decisions: logs -f scaling-agent)"; done
  for id in $(running prometheus); do echo "  Prometheus     http://$(host_port "$id" 9090)   (targets: /targets, alerts: /alerts)"; done
  echo "  submit:  deploy/compose.sh submit FILE... --wait     logs: deploy/compose.sh logs -f [SERVICE]"
}

# Waits until every fleet service has its containers running and not restarting (a crash loop shows
# as restarts; its log is printed).
wait_running() {
  local s id deadline=$(( $(date +%s) + 30 ))
  sleep 2
  for s in "${fleet_services[@]}"; do
    for id in $(ids "$s"); do
      while :; do
        local st; st=$(docker inspect -f '{{.State.Status}} {{.RestartCount}}' "$id")
        [ "$st" = "running 0" ] && break
        if [ "${st#* }" != 0 ] || [ "${st% *}" = exited ] || [ "$(date +%s)" -gt "$deadline" ]; then
          docker logs --tail 30 "$id" >&2 || true
          die "$(name_of "$id"): not running ($st); its last log lines are above"
        fi
        sleep 1
      done
    done
  done
}

up() {
  need_docker; find_compose
  local profile=() extra=()
  if [ "${FLEET_MONITORING:-0}" = 1 ]; then profile=(--profile monitoring); extra=(prometheus); fi
  if [ "$source_kind" != registry ]; then
    "$repo/deploy/images.sh"
    [ ${#extra[@]} = 0 ] || "$repo/deploy/images.sh" prometheus
  fi
  check_port FLEET_LOCALSTACK_PORT 4566 localstack 4566
  check_port FLEET_RABBITMQ_UI_PORT 15672 rabbitmq 15672
  [ ${#extra[@]} = 0 ] || check_port FLEET_PROMETHEUS_PORT 9090 prometheus 9090
  local n; n=$(count processor); [ "$n" -gt 0 ] || n=${FLEET_PROCESSORS:-1}
  local t0; t0=$(date +%s)
  mkdir -p "$FLEET_INBOX"
  echo "starting $COMPOSE_PROJECT_NAME (LocalStack and RabbitMQ first, until healthy; $n processor(s))"
  if ! compose "${profile[@]}" up -d $build_flag --remove-orphans --scale "processor=$n" localstack rabbitmq "${fleet_services[@]}" "${extra[@]}"; then
    for s in localstack rabbitmq; do for id in $(ids "$s"); do echo "--- $s:" >&2; docker logs --tail 30 "$id" >&2 || true; done; done
    die "compose up failed (the last log lines of LocalStack and RabbitMQ are above)"
  fi
  wait_running
  # `cli`, where initiator commands are executed, and the initiator's container as Compose configures
  # it, created and never started: one-off initiator containers are run from its configuration.
  local out id
  if out=$(compose --profile cli up --no-start --no-deps initiator cli 2>&1); then
    for id in $(ids cli); do docker start "$id" >/dev/null || echo "compose: could not start the cli container (the initiator runs in containers of its own)" >&2; done
  else
    echo "compose: could not create the initiator's containers (it runs with compose run): ${out##*$'\n'}" >&2
  fi
  echo "up in $(( $(date +%s) - t0 )) s"
  show
}

# submit FILE... [FLAGS]: the files (every argument before the first flag) and --tariff's file are
# mounted read-only at their absolute paths, and the initiator runs in the current directory, so the
# names in messages and the report are the ones given here.
submit() {
  local csv=() files=() args=() f
  while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do csv+=("$1"); shift; done
  [ ${#csv[@]} -gt 0 ] || die "usage: deploy/compose.sh submit FILE... [initiator submit flags]"
  files=("${csv[@]}")
  while [ $# -gt 0 ]; do
    case "$1" in
      --tariff) [ $# -ge 2 ] || die "--tariff needs a file"; files+=("$2"); args+=("$1" "$2"); shift 2 ;;
      --tariff=*) files+=("${1#--tariff=}"); args+=("$1"); shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  run_opts=()
  for f in "${files[@]}"; do
    [ -e "$f" ] || die "$f: no such file (nothing was submitted)"
    [ -f "$f" ] || die "$f: not a regular file (nothing was submitted)"
    [ -r "$f" ] || die "$f: not readable (permission denied; nothing was submitted)"
    run_opts+=(-v "$(readlink -f "$f"):$(cd "$(dirname "$f")" && pwd)/$(basename "$f"):ro")
  done
  # One file and no terminal to draw progress on (a one-off container gets one): executed in `cli`,
  # the file hard-linked (or copied, from another file system) into the inbox it mounts, and given to
  # `initiator submit -` as its standard input there, named as given here. (Streamed through `docker
  # exec -i` instead, 1M rows cost about 0.5 s more CPU in dockerd and containerd-shim.)
  local cli inbox
  cli=$(running cli | head -n1)
  if [ ${#files[@]} = 1 ] && [ -n "$cli" ] && ! { [ -t 0 ] && [ -t 1 ]; }; then
    inbox=$(docker inspect -f '{{range .Mounts}}{{if eq .Destination "/inbox"}}{{.Source}}{{end}}{{end}}' "$cli" 2>/dev/null || true)
    if [ -n "$inbox" ] && [ -d "$inbox" ] && [ -w "$inbox" ]; then
      local spool code=0
      spool=$(mktemp -d "$inbox/submit.XXXXXX")
      trap "rm -rf '$spool'" EXIT
      ln "${csv[0]}" "$spool/input.csv" 2>/dev/null || cp "${csv[0]}" "$spool/input.csv" || die "cannot copy ${csv[0]} into $spool (nothing was submitted)"
      in_cli "$cli" sh -c 'exec initiator submit - "$@" <"$0"' "/inbox/${spool##*/}/input.csv" --stdin-name "${csv[0]}" "${args[@]}" || code=$?
      rm -rf "$spool"
      return "$code"
    fi
  fi
  initiator submit "${csv[@]}" "${args[@]}"
}

# initiator ARGS...: the initiator as the calling user; returns its exit code. Without files to mount
# (run_opts empty), executed in the running `cli` container (`docker exec`: about 0.1 s). Otherwise a
# one-off container in the current directory with the extra `docker run` options in run_opts: `docker
# run` with the configuration Compose gave the initiator's template container at `up` (image,
# environment, read-only root, capabilities) in `cli`'s network namespace: about 0.35 s to start and
# remove it, where `compose run` took 1.3-1.7 s. Without them (a fleet started by plain Compose),
# `compose run`.
run_opts=()
initiator() {
  need_up
  local tty=() code=0 template cli
  cli=$(running cli | head -n1)
  # Nothing to mount: executed in `cli` (its working directory, not this one).
  if [ ${#run_opts[@]} = 0 ] && [ -n "$cli" ]; then
    local a stdin=()
    for a in "$@"; do [ "$a" = - ] && stdin=(-i); done
    in_cli "${stdin[@]}" "$cli" initiator "$@" || code=$?
    return "$code"
  fi
  template=$(ids initiator | head -n1)
  if [ -n "$template" ]; then
    # The environment (the broker's password among it) goes through a 0600 file, not the command line.
    local from=() env_dir
    env_dir=$(mktemp -d)
    trap "rm -rf '$env_dir'" EXIT
    mapfile -t from < <(echo "$template" | template_args "$env_dir/env" "$cli" | grep -v '^$') || from=()
    if [ ${#from[@]} -gt 0 ]; then
      [ -t 0 ] && [ -t 1 ] && tty=(-it)
      # (The submitter's key as Compose mounts it into the template: `docker run` does not copy mounts.)
      docker run --rm "${tty[@]}" -u "$(id -u):$(id -g)" -w "$PWD" "${run_opts[@]}" -v "$keys_dir/submitter.key:/run/secrets/submitter.key:ro" \
        --env-file "$env_dir/env" "${from[@]}" "$@" || code=$?
      rm -rf "$env_dir"
      return "$code"
    fi
    rm -rf "$env_dir"
  fi
  find_compose
  [ -t 0 ] && [ -t 1 ] || tty=(-T)
  compose run --rm --no-deps "${tty[@]}" -u "$(id -u):$(id -g)" -w "$PWD" "${run_opts[@]}" initiator "$@" || code=$?
  return "$code"
}

# in_cli [-i] ID ARGS...: ARGS executed in the running cli container ID as the calling user, with a
# terminal when this side has one at both ends, else with this standard input given -i (ARGS read it);
# returns their exit code. `docker exec` does not pass signals on (stopped, it leaves the command
# running in the container): an INT or TERM this script receives is sent to the command in the
# container, found by a tag in its environment, so Ctrl-C or `kill` stops a submission here as it
# stops the initiator on the host.
in_cli() {
  local stdin=0 id tty=() tag pid code=0
  [ "$1" = -i ] && { stdin=1; shift; }
  id=$1; shift
  if [ -t 0 ] && [ -t 1 ]; then
    tty=(-it)
  elif [ "$stdin" = 1 ]; then
    tty=(-i)
  fi
  tag="$$.$RANDOM$RANDOM"
  # (Started in the background to wait for it interruptibly; standard input passed on explicitly.)
  docker exec "${tty[@]}" -u "$(id -u):$(id -g)" -e "FLEET_EXEC_TAG=$tag" "$id" "$@" <&0 &
  pid=$!
  trap "in_cli_signal '$id' '$tag' INT" INT
  trap "in_cli_signal '$id' '$tag' TERM" TERM
  wait "$pid" || code=$?
  # A signal ends the wait, not the command: wait again for its exit code.
  while kill -0 "$pid" 2>/dev/null; do
    code=0
    wait "$pid" || code=$?
  done
  trap - INT TERM
  return "$code"
}

# in_cli_signal ID TAG SIGNAL: sends SIGNAL to the processes in container ID whose environment holds
# FLEET_EXEC_TAG=TAG.
in_cli_signal() {
  docker exec -u "$(id -u):$(id -g)" "$1" sh -c '
    for e in /proc/[0-9]*/environ; do
      if grep -qxz "FLEET_EXEC_TAG=$0" "$e" 2>/dev/null; then p=${e#/proc/}; kill -"$1" "${p%/environ}" 2>/dev/null; fi
    done' "$2" "$3" || true
}

# template_args ENV_FILE [NET_ID]: for a container (stdin: its id), the `docker run` options and image
# that make another like it, one a line, ending with the image and the entrypoint's arguments; its
# environment written to ENV_FILE (mode 0600) for --env-file. With NET_ID (a running container on the
# same network), the new one joins that container's network namespace instead of attaching its own.
template_args() {
  local id; read -r id
  (umask 077; docker inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$id" >"$1") || return 1
  if [ -n "${2:-}" ]; then printf -- '--network\ncontainer:%s\n' "$2"; else docker inspect -f '--network
{{.HostConfig.NetworkMode}}' "$id"; fi
  docker inspect -f '{{if .HostConfig.ReadonlyRootfs}}--read-only
{{end}}{{range $path, $opts := .HostConfig.Tmpfs}}--tmpfs
{{$path}}{{if $opts}}:{{$opts}}{{end}}
{{end}}{{range .HostConfig.CapDrop}}--cap-drop
{{.}}
{{end}}{{range .HostConfig.CapAdd}}--cap-add
{{.}}
{{end}}{{range .HostConfig.SecurityOpt}}--security-opt
{{.}}
{{end}}{{range $i, $e := .Config.Entrypoint}}{{if eq $i 0}}--entrypoint
{{$e}}
{{$.Config.Image}}
{{else}}{{$e}}
{{end}}{{else}}{{.Config.Image}}
{{end}}' "$id"
}

scale() {
  local n=${1:-}
  [[ "$n" =~ ^[0-9]+$ ]] || die "usage: deploy/compose.sh scale N (processor containers)"
  need_docker; find_compose; need_up
  local before; before=$(count processor)
  echo "processor: $before -> $n"
  compose up -d --no-deps $build_flag --no-recreate --scale "processor=$n" processor
  show
}

down() {
  need_docker; find_compose
  compose --profile cli --profile monitoring down -v --remove-orphans --timeout 45
  rm -rf "$FLEET_INBOX"
}

demo() {
  local rows=${1:-100000}
  up
  mkdir -p "$repo/.run"
  local data="$repo/.run/demo-$rows.csv"
  echo "generating $rows transactions (1,000 accounts) into $data"
  # A fresh seed each run: a demo run again bills new transactions (the same ids twice are billed
  # once: docs/claims.md).
  initiator generate --rows "$rows" --accounts 1000 --seed "$(date +%s)" >"$data"
  echo "submitting $data"
  submit "$data" --wait
}

cmd=${1:-}
[ $# -eq 0 ] || shift
case "$cmd" in
  up) up ;;
  submit) submit "$@" ;;
  initiator) initiator "$@" ;;
  scale) scale "$@" ;;
  ps) need_docker; find_compose; compose ps; show ;;
  logs) need_docker; find_compose; if [ $# -eq 0 ]; then compose logs --tail=100; else compose logs "$@"; fi ;;
  down) down ;;
  demo) demo "$@" ;;
  images) exec "$repo/deploy/images.sh" "$@" ;;
  *) die "usage: deploy/compose.sh up | submit FILE... [FLAGS] | initiator ARGS... | scale N | ps | logs [ARGS] | down | demo [ROWS] | images" ;;
esac
