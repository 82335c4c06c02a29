"""On SQLite the request path's reads (the installations of a webhook, the
receipt a Twilio status poll asks for) do not queue for the write lock: a
commit in progress, here another process's open write transaction, holds
up writes only. They queued behind every commit (``BEGIN IMMEDIATE``), and
each time the gateway's installation cache expired every webhook of that
moment waited with them."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from backends import sqlite_harness
from intake.kit import install_telegram_bot


def test_request_path_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path)
    try:
        ist, inst = install_telegram_bot(h.store, tmp_path)
        writer = sqlite3.connect(h.store.db.path, isolation_level=None)
        writer.execute("BEGIN IMMEDIATE")  # holds the write lock, as a long commit would
        got: dict[str, Any] = {}
        done = threading.Event()

        def read() -> None:
            got["installations"] = ist.installations("telegram", "7")
            got["receipt"] = ist.receipt_by_source("telegram", "7:1")
            done.set()

        reader = threading.Thread(target=read)
        reader.start()
        try:
            answered = done.wait(10)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
            reader.join(60)
        assert answered, "the reads waited for the write lock"
        assert [i["id"] for i in got["installations"]] == [inst["id"]]
        assert got["receipt"] is None
    finally:
        h.close()
