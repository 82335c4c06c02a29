"""Connections of threads that ended are closed: a server's thread pool
retires idle threads and starts new ones, and each new thread opens its own
connections to the SQLite file."""

from __future__ import annotations

import threading
from pathlib import Path

from agentdispatch.backends.sqlite.db import SqliteDb
from backends import descriptors_of


def test_connections_of_ended_threads_are_closed(tmp_path: Path) -> None:
    db = SqliteDb(tmp_path / "c.db")
    with db.tx() as c:
        c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)")
    errors: list[BaseException] = []

    def request() -> None:
        # What a route does: a read on the thread's fast connection, a durable write.
        try:
            db.conn().execute("SELECT count(*) FROM t").fetchone()
            with db.tx(durable=True) as c:
                c.execute("INSERT INTO t DEFAULT VALUES")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    generations, width = 50, 4
    for _ in range(generations):
        threads = [threading.Thread(target=request) for _ in range(width)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    assert not errors, errors
    assert db.conn().execute("SELECT count(*) FROM t").fetchone()[0] == generations * width
    # Open now: this thread's connection, the shared group-commit one, those of
    # the last generation (no thread opened one after it ended) and at most as
    # many again that SQLite closes late (it keeps a closed connection's
    # descriptor while another one holds a lock on the file); not one per
    # thread that ever ran.
    assert descriptors_of(db.path) <= 2 * width + 2, descriptors_of(db.path)
    db.close()
    assert descriptors_of(db.path) == 0
