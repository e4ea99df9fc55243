#!/bin/sh
# Checks the scrape configuration, then runs Prometheus with its data in /tmp (a tmpfs: metrics of a
# dev fleet, not kept). The processors' targets come from the file the scaling agent writes into
# /etc/prometheus/targets (the compose file's prometheus-targets volume); no Docker socket.
set -eu
promtool check config /etc/prometheus/prometheus.yml >/dev/null
exec prometheus --config.file=/etc/prometheus/prometheus.yml --storage.tsdb.path=/tmp/prometheus \
  --storage.tsdb.retention.time=2d --web.listen-address=:9090 "$@"
