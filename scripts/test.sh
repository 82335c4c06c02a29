#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs the dev extras, makes sure
# PostgreSQL runs and Debian's chromium and pgbouncer are present, then runs pytest. Extra
# arguments go to pytest. The Kafka-protocol broker is started by the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[dev]'
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432 >/dev/null || { echo "PostgreSQL is required and could not be started" >&2; exit 1; }
if ! command -v pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
  # The contract suite also runs behind PgBouncer in transaction mode.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null; }
fi
if [ ! -x /usr/bin/chromium ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
fi
exec python3 -m pytest "$@"
