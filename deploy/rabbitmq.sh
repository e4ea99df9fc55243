#!/usr/bin/env bash
# Makes sure a RabbitMQ broker answers on 127.0.0.1:5672 (AMQP) and 5671 (AMQPS): uses a running one, else
# installs the Debian package (when missing) and starts it. Safe to run twice. `deploy/rabbitmq.sh stop`
# shuts down a broker it started.
#
# TLS: a test CA and a certificate for localhost/127.0.0.1 are made with openssl into /etc/rabbitmq/tls
# (nothing committed; made once), and the broker gets a TLS listener on 5671 that uses them. A broker of
# the Debian package already running without it is restarted once to add it. The CA is what a client
# trusts: AMQP_CA_FILE=/etc/rabbitmq/tls/ca.pem with amqps://localhost:5671 (the tests do).
set -euo pipefail
tls_dir=/etc/rabbitmq/tls
conf=/etc/rabbitmq/conf.d/20-billing-fleet-tls.conf
if [ "${1:-start}" = stop ]; then
  command -v rabbitmqctl >/dev/null 2>&1 && rabbitmqctl -q shutdown || true
  exit 0
fi
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if listening 5672 && { listening 5671 || ! command -v rabbitmqctl >/dev/null 2>&1; }; then
  echo "rabbitmq: already listening on 127.0.0.1:5672$(listening 5671 && echo ' and 5671 (TLS)')"
  exit 0
fi
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "rabbitmq: installing the Debian package rabbitmq-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq rabbitmq-server openssl >/dev/null
fi
if [ ! -s "$tls_dir/server.pem" ]; then
  echo "rabbitmq: making a test CA and a localhost certificate in $tls_dir"
  mkdir -p "$tls_dir"
  (
    cd "$tls_dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 -subj "/CN=billing-fleet test CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n' > server.ext
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 -extfile server.ext -out server.pem 2>/dev/null
    rm -f server.csr server.ext ca.srl
  )
  chown -R rabbitmq:rabbitmq "$tls_dir" 2>/dev/null || true
  chmod 0750 "$tls_dir"; chmod 0640 "$tls_dir"/*.key
fi
if [ ! -s "$conf" ]; then
  mkdir -p "$(dirname "$conf")"
  cat > "$conf" <<CONF
listeners.tcp.default = 5672
listeners.ssl.default = 5671
ssl_options.cacertfile = $tls_dir/ca.pem
ssl_options.certfile = $tls_dir/server.pem
ssl_options.keyfile = $tls_dir/server.key
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
CONF
  chown rabbitmq:rabbitmq "$conf" 2>/dev/null || true
fi
if rabbitmq-diagnostics -q ping >/dev/null 2>&1 && ! listening 5671; then
  echo "rabbitmq: restarting once to add the TLS listener"
  rabbitmqctl -q shutdown || true
fi
if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  echo "rabbitmq: starting"
  rabbitmq-server -detached
  rabbitmqctl -q wait --timeout 120 "/var/lib/rabbitmq/mnesia/rabbit@$(hostname -s).pid"
fi
for _ in $(seq 1 60); do
  if listening 5672 && listening 5671; then echo "rabbitmq: ready on 127.0.0.1:5672 and 5671 (TLS, CA $tls_dir/ca.pem)"; exit 0; fi
  sleep 1
done
echo "rabbitmq: not listening on 5672 and 5671 after start" >&2
exit 1
