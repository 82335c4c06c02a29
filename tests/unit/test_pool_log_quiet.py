"""The pool's connection-failure warnings: no endpoint in the line, and one
every POOL_WARN_EVERY_S at most (an outage fails every retry of every pool)."""

from __future__ import annotations

import logging

from agentdispatch.backends.postgres.db import POOL_WARN_EVERY_S, _QuietPool


def _record(level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(
        "psycopg.pool", level, __file__, 1, "error connecting in %r: %s", ("pool", "host=db.example port=5432"), None
    )


def test_one_warning_per_interval_and_no_endpoint() -> None:
    now = [100.0]
    quiet = _QuietPool(clock=lambda: now[0])
    first = _record()
    assert quiet.filter(first)
    assert first.getMessage() == "PostgreSQL pool: a connection attempt failed (will retry)"
    now[0] += POOL_WARN_EVERY_S / 2
    repeat = _record()
    assert not quiet.filter(repeat)
    assert repeat.levelno == logging.DEBUG and "example" not in repeat.getMessage()
    now[0] += POOL_WARN_EVERY_S / 2
    assert quiet.filter(_record())
    info = _record(logging.INFO)
    assert quiet.filter(info) and info.levelno == logging.INFO
