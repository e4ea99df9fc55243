#!/usr/bin/env bash
# Creates the fleet's queues and bucket on a running LocalStack (idempotent), with the same hook that a
# LocalStack container runs from /etc/localstack/init/ready.d.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${LOCALSTACK_VENV:-$HOME/.cache/billing-fleet/localstack-venv}
exec "$venv/bin/python" "$here/init/ready.d/10-billing-fleet.py"
