#!/bin/sh
# The official image's default-user variables for Debian's server: RABBITMQ_DEFAULT_USER and
# RABBITMQ_DEFAULT_PASS become a conf.d file (readable by the broker's user only), read on first boot
# when the user database is made. Then the server (exec: it gets the signals).
set -eu
if [ -n "${RABBITMQ_DEFAULT_USER:-}" ] && [ -n "${RABBITMQ_DEFAULT_PASS:-}" ]; then
  umask 077
  printf 'default_user = %s\ndefault_pass = %s\ndefault_user_tags.administrator = true\n' \
    "$RABBITMQ_DEFAULT_USER" "$RABBITMQ_DEFAULT_PASS" >/etc/rabbitmq/conf.d/50-default-user.conf
fi
unset RABBITMQ_DEFAULT_PASS
exec "$@"
