#!/usr/bin/env bash
# Makes sure a RabbitMQ broker answers on 127.0.0.1:5672: uses a running one, else installs the Debian package
# (when missing) and starts it. Safe to run twice. `deploy/rabbitmq.sh stop` shuts down a broker it started.
set -euo pipefail
if [ "${1:-start}" = stop ]; then
  command -v rabbitmqctl >/dev/null 2>&1 && rabbitmqctl -q shutdown || true
  exit 0
fi
if (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
  echo "rabbitmq: already listening on 127.0.0.1:5672"
  exit 0
fi
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "rabbitmq: installing the Debian package rabbitmq-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq rabbitmq-server >/dev/null
fi
if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  echo "rabbitmq: starting"
  rabbitmq-server -detached
  rabbitmqctl -q wait --timeout 120 "/var/lib/rabbitmq/mnesia/rabbit@$(hostname -s).pid"
fi
for _ in $(seq 1 60); do
  if (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then echo "rabbitmq: ready on 127.0.0.1:5672"; exit 0; fi
  sleep 1
done
echo "rabbitmq: not listening on 5672 after start" >&2
exit 1
