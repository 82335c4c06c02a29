"""PostgreSQL test helper: a fresh schema per test on the real server.

``AGENTDISPATCH_TEST_PG`` names the server (default: the local one of the
development box). A test that needs PostgreSQL fails loudly when it is down.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import quote

import psycopg

BASE_URI = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def admin() -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit connection to the test database (raises when down)."""
    return psycopg.connect(BASE_URI, autocommit=True, connect_timeout=5)


def schema_uri(schema: str) -> str:
    """The base URI with every connection's search_path set to ``schema``."""
    sep = "&" if "?" in BASE_URI else "?"
    return f"{BASE_URI}{sep}options={quote(f'-csearch_path={schema}')}"


def create_schema() -> tuple[str, str, Callable[[], None]]:
    """A fresh empty schema: (name, uri, drop)."""
    name = "t_" + secrets.token_hex(6)
    with admin() as conn:
        conn.execute(f"CREATE SCHEMA {name}")

    def drop() -> None:
        with admin() as conn:
            # Backends of killed worker processes may still hold locks: end them.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND query LIKE %s",
                (f"%{name}%",),
            )
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")

    return name, schema_uri(name), drop


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A fresh schema for one test, dropped afterwards; yields its URI."""
    _name, uri, drop = create_schema()
    try:
        yield uri
    finally:
        drop()


def restart_postgres() -> None:
    """Restart the local cluster (the crash tests' database failure)."""
    version = os.environ.get("AGENTDISPATCH_TEST_PG_VERSION") or sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True,
        capture_output=True,
        timeout=120,
    )
