"""Statement journals stay in memory: inside a group commit's savepoint each
statement's journal grows with the savepoint instead of ending with the
statement, and spilled to a temporary file it cost a write per page touched."""

from __future__ import annotations

import os
from pathlib import Path

from agentdispatch.backends.sqlite.db import SqliteDb
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.stores.base import NewJob


def _temporary_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "etilqs_" in target:  # SQLite's temporary file names
            found.append(target)
    return found


def test_connections_keep_temporary_data_in_memory(tmp_path: Path) -> None:
    db = SqliteDb(tmp_path / "c.db")
    assert db.conn().execute("PRAGMA temp_store").fetchone()[0] == 2
    with db.tx(durable=True) as c:
        assert c.execute("PRAGMA temp_store").fetchone()[0] == 2
    db.close()


def test_a_large_savepoint_opens_no_temporary_file(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "q.db")
    store.migrate()
    jobs = [
        NewJob(job_id=f"j{i}", tenant=f"t{i % 7}", session_id=f"s{i}", kind="echo", payload={"n": i}, max_attempts=3)
        for i in range(2000)
    ]
    # A durable transaction is a member savepoint of a group commit; each
    # queue row fires the fairness triggers, so has a statement journal.
    with store.transaction(durable=True) as tx:
        for job in jobs:
            store.submit_in(tx, [job], max_depth=10_000)
        assert _temporary_files() == []
    store.close()
