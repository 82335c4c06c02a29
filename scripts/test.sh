#!/usr/bin/env bash
# The whole test suite on a fresh machine. Uses the active virtualenv, or makes
# .venv; installs the locked dev dependencies (requirements/dev.lock) into it;
# makes sure PostgreSQL runs and Debian's chromium, pgbouncer and promtool
# (package prometheus) are present;
# then runs pytest in parallel. Extra arguments go to pytest. The Kafka-protocol
# broker and the private PostgreSQL clusters of the restart tests are started by
# the tests themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install -q --disable-pip-version-check "uv==0.13.9"
uv pip install -q --compile-bytecode -r requirements/dev.lock -e .
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432 >/dev/null || { echo "PostgreSQL is required and could not be started" >&2; exit 1; }
missing=()
# The contract suite also runs behind PgBouncer in transaction mode; the dashboard test drives chromium.
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
[ -x /usr/bin/chromium ] || missing+=(chromium)
# The metrics test checks real scrapes and the scrape example with promtool.
command -v promtool >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
exec python -m pytest -n "${AGENTDISPATCH_TEST_WORKERS:-5}" --dist loadgroup --durations=10 "$@"
