"""An idle worker on SQLite wakes on a new submission, not at its next poll;
a busy one keeps the transport's poll (claims batched)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from agentdispatch import Registry, Submission
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from backends import sqlite_harness


def test_wait_for_submission_wakes_on_a_new_item_from_another_connection(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path)
    other = sqlite_harness(tmp_path)  # the same file: another process's submits, in effect
    try:
        store: Any = h.store
        assert store.wait_for_submission(0.01) == 0  # nothing new since the first look
        woke: list[int] = []
        waiter = threading.Thread(target=lambda: woke.append(store.wait_for_submission(60.0)))
        waiter.start()
        other.dispatcher().submit(Submission(kind="agent", tenant="t"))
        waiter.join(timeout=60)
        assert woke == [1]  # how many came: what an idle worker's next claim asks for
        # Renewals, commits and claims move no sequence number: no wake for them.
        assert store.wait_for_submission(0.01) == 0
        # Submissions that landed between two waits wake the next one at once.
        other.dispatcher().submit_many([Submission(kind="agent", tenant="t") for _ in range(3)])
        assert store.wait_for_submission(60.0) == 3
    finally:
        other.close()
        h.close()


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []


def test_only_an_idle_worker_waits_on_the_store_wake(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path)
    try:
        seen = _Recorder()
        store: Any = h.store
        transport: Any = h.transport
        store.wait_for_submission = lambda timeout_s: seen.calls.append(("store", timeout_s))
        transport.wait = lambda timeout_s: seen.calls.append(("transport", timeout_s))
        opts = RuntimeOptions(concurrency=8, get_wait_s=0.5)
        worker = AsyncWorker(h.settings, h.store, h.transport, Registry(), options=opts)
        worker._wait_for_work(True)
        worker._wait_for_work(False)
        # Idle: the store's wake, at most the transport's own poll; busy: the poll.
        assert seen.calls == [("store", min(0.5, transport.poll_s)), ("transport", 0.5)]
    finally:
        h.close()
