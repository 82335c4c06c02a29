"""Group commit on a real SQLite file: concurrent durable transactions share
one COMMIT, a failing one is rolled back alone, and nobody returns early."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from agentdispatch.backends.sqlite.db import SqliteDb


def test_concurrent_durable_writes_share_commits_and_fail_alone(tmp_path: Path) -> None:
    db = SqliteDb(tmp_path / "g.db")
    with db.tx() as c:
        c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, who TEXT)")
    commits = 0
    original = db._commit_batch

    def counting(batch):  # type: ignore[no-untyped-def]
        nonlocal commits
        commits += 1
        if commits == 1:
            # Hold the first commit until two more writers have joined its batch:
            # sharing then follows from the protocol, not from the scheduler.
            deadline = time.monotonic() + 30
            while batch.joined < 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert batch.joined >= 3, "no writer joined an open batch"
        original(batch)

    db._commit_batch = counting  # type: ignore[method-assign]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    visible_after_return: list[bool] = []

    def writer(n: int) -> None:
        barrier.wait()
        for i in range(50):
            key = n * 1000 + i
            try:
                with db.tx(durable=True) as c:
                    c.execute("INSERT INTO t VALUES (?, ?)", (key, f"w{n}"))
                    if i % 10 == 9:
                        raise RuntimeError("this block fails")
            except RuntimeError as exc:
                errors.append(exc)
                continue
            # A fresh connection sees it: durable and committed before return.
            other = SqliteDb(tmp_path / "g.db")
            visible_after_return.append(
                other.conn().execute("SELECT 1 FROM t WHERE k = ?", (key,)).fetchone() is not None
            )
            other.close()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = {r[0] for r in db.conn().execute("SELECT k FROM t")}
    assert len(errors) == 8 * 5
    assert len(rows) == 8 * 45 and all(k % 1000 % 10 != 9 for k in rows)
    assert all(visible_after_return) and len(visible_after_return) == 8 * 45
    assert commits < 8 * 50, "no two transactions ever shared a commit"
    db.close()


def test_a_block_that_raises_outside_a_group_rolls_back(tmp_path: Path) -> None:
    db = SqliteDb(tmp_path / "g.db")
    with db.tx() as c:
        c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)")
    with pytest.raises(ValueError), db.tx(durable=True) as c:
        c.execute("INSERT INTO t VALUES (1)")
        raise ValueError
    with db.tx(durable=True) as c:
        c.execute("INSERT INTO t VALUES (2)")
    assert [r[0] for r in db.conn().execute("SELECT k FROM t")] == [2]
    db.close()


def test_durable_batches_of_every_thread_use_one_connection(tmp_path: Path) -> None:
    # Its page cache stays warm: a connection that finds the file changed by
    # another connection starts from an empty cache.
    db = SqliteDb(tmp_path / "one.db")
    with db.tx() as c:
        c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)")
    used: list[object] = []
    lock = threading.Lock()

    def writer(n: int) -> None:
        for i in range(20):
            with db.tx(durable=True) as c:
                c.execute("INSERT INTO t VALUES (?)", (n * 100 + i,))
                with lock:
                    used.append(c)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(used) == 80 and len({id(c) for c in used}) == 1
    with db.tx() as c:
        assert c.execute("SELECT count(*) FROM t").fetchone()[0] == 80
    db.close()
    # Closed means closed: a new batch opens a fresh connection.
    with db.tx(durable=True) as c:
        c.execute("INSERT INTO t VALUES (1000)")
        assert c.execute("SELECT count(*) FROM t").fetchone()[0] == 81
    db.close()
