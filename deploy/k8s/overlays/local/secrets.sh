#!/usr/bin/env bash
# Generates the local overlay's credentials once: a random password for RabbitMQ's one user and the
# fleet's AMQP_URL with it, in secrets/ next to this script (mode 0600 in a 0700 directory; git ignores
# it). Kept when it exists, so a running broker and the fleet keep agreeing; --force makes a new one
# (then delete the rabbitmq pod too: its user is made on first boot). Prints nothing secret.
set -euo pipefail
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets"
if [ "${1:-}" != --force ] && [ -s "$dir/amqp.env" ] && [ -s "$dir/rabbitmq.env" ]; then
  echo "k8s local: credentials already in $dir"
  exit 0
fi
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
# 128 random bits as 32 hex digits: nothing to escape in a URL.
pass=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
printf 'RABBITMQ_DEFAULT_USER=fleet\nRABBITMQ_DEFAULT_PASS=%s\n' "$pass" >"$dir/rabbitmq.env"
printf 'AMQP_URL=amqp://fleet:%s@rabbitmq.billing-fleet-deps.svc.cluster.local:5672/%%2f\n' "$pass" >"$dir/amqp.env"
echo "k8s local: new broker credentials in $dir"
