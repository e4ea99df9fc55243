#!/bin/sh
# Fills the compose project into the scrape configuration (Prometheus does not expand variables in it),
# checks it, then runs Prometheus with its data in /tmp (a tmpfs: metrics of a dev fleet, not kept).
set -eu
project=${FLEET_COMPOSE_PROJECT:?FLEET_COMPOSE_PROJECT (the compose project to scrape) is not set}
sed "s/@PROJECT@/$project/g" /etc/prometheus/prometheus.yml >/tmp/prometheus.yml
promtool check config /tmp/prometheus.yml >/dev/null
exec prometheus --config.file=/tmp/prometheus.yml --storage.tsdb.path=/tmp/prometheus \
  --storage.tsdb.retention.time=2d --web.listen-address=:9090 "$@"
