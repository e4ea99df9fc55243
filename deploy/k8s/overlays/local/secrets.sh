#!/usr/bin/env bash
# Generates the local overlay's credentials once: a random password for RabbitMQ's one user and the
# fleet's AMQP_URL with it, and the controllers' status page token (secrets/page-token: 32 random hex
# digits, the Secret fleet-page-token's key `token`), and the roles' keys (secrets/keys/ROLE.key, one
# line `ROLE BASE64-SECRET` of 32 random bytes each: the Secrets fleet-role-keys and
# fleet-processor-key), in secrets/ next to this script (mode 0600 in a
# 0700 directory; git ignores it). Kept when they exist, so a running broker and the fleet keep
# agreeing; --force makes new ones (then delete the rabbitmq pod too: its user is made on first boot;
# and only with no job in flight: results of work items signed with the old keys are refused).
# Prints nothing secret.
set -euo pipefail
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets"
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
made=()
# 128 random bits as 32 hex digits: nothing to escape in a URL.
random_hex() { od -An -tx1 -N16 /dev/urandom | tr -d ' \n'; }
if [ "${1:-}" = --force ] || [ ! -s "$dir/amqp.env" ] || [ ! -s "$dir/rabbitmq.env" ]; then
  pass=$(random_hex)
  printf 'RABBITMQ_DEFAULT_USER=fleet\nRABBITMQ_DEFAULT_PASS=%s\n' "$pass" >"$dir/rabbitmq.env"
  printf 'AMQP_URL=amqp://fleet:%s@rabbitmq.billing-fleet-deps.svc.cluster.local:5672/%%2f\n' "$pass" >"$dir/amqp.env"
  made+=("broker credentials")
fi
if [ "${1:-}" = --force ] || [ ! -s "$dir/page-token" ]; then
  random_hex >"$dir/page-token"
  made+=("status page token")
fi
mkdir -p "$dir/keys"
for role in submitter operator processor controller; do
  if [ "${1:-}" = --force ] || [ ! -s "$dir/keys/$role.key" ]; then
    printf '%s %s\n' "$role" "$(head -c 32 /dev/urandom | base64 -w0)" >"$dir/keys/$role.key"
    made+=("$role key")
  fi
done
if [ ${#made[@]} = 0 ]; then
  echo "k8s local: credentials already in $dir"
else
  echo "k8s local: new $(IFS=,; echo "${made[*]}" | sed 's/,/, /g') in $dir"
fi
