"""PostgreSQL test helper: a fresh schema per test on the real server.

``AGENTDISPATCH_TEST_PG`` names the server (default: the local one of the
development box). A test that needs PostgreSQL fails loudly when it is down.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import psycopg

from ports import free_port

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


def _pg_bin() -> Path:
    version = os.environ.get("AGENTDISPATCH_TEST_PG_VERSION") or sorted(os.listdir("/usr/lib/postgresql"))[-1]
    return Path("/usr/lib/postgresql") / version / "bin"


class PrivateCluster:
    """A PostgreSQL cluster of one test's own (initdb into a temp dir, a free
    port), for tests that restart or stop the database: the shared server on
    5432 serves every other test, in parallel, and is never restarted."""

    def __init__(self, parent: Path | None = None) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ad-pg-", dir=parent))
        self.data = self.dir / "data"
        # initdb refuses to run as root: the cluster belongs to the postgres user.
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.dir, user="postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        (self.data / "postgresql.auto.conf").write_text(
            f"port = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{self.dir}'\n"
            "max_connections = 200\nshared_buffers = '32MB'\n"
        )

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as, str(_pg_bin() / tool), *args], check=True, capture_output=True, timeout=120)

    def uri(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PrivateCluster:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, down_s: float = 0.0) -> None:
        """Stop (fast: connections are cut), stay down ``down_s``, start again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def pids(self) -> list[int]:
        """The server's processes: the postmaster and its children."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        kids = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
        return [postmaster, *map(int, kids)]

    def destroy(self) -> None:
        """Stop if running and remove the cluster's files."""
        if (self.data / "postmaster.pid").exists():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


def rows_read_by_a_claim(uri: str, table: str, n: int) -> int:
    """Rows of ``table`` a fair claim of ``n`` reads on ``uri`` (index fetches
    and sequential reads, from this transaction's statistics); the claim must
    find exactly one turn, and is rolled back."""
    from agentdispatch.sqlfiles import queries

    get = queries("agentdispatch.backends.postgres.sql", "transport.sql")["get"]
    with psycopg.connect(uri) as conn:
        got = conn.execute(
            get, {"owner": "probe:0", "vis": 30.0, "n": n, "read": False, "listener": None, "mark_s": 0.0}
        ).fetchall()
        assert len(got) == 1
        row = conn.execute(
            "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) FROM pg_stat_xact_user_tables "
            "WHERE relid = %s::regclass",
            (table,),
        ).fetchone()
        conn.rollback()
    assert row is not None
    return int(row[0])
