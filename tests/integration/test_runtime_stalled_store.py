"""A store that stops answering (a file locked by another process here; a
stalled network link to PostgreSQL alike) makes renewals hang instead of
fail: the async worker must still stop a turn once its lease may have run
out, not when the store comes back (reliability scenario 7)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

from agentdispatch import Registry, Status, Submission
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from backends import sqlite_harness
from contract.helpers import wait_until

TTL_S = 2.0


def test_a_turn_stops_within_its_ttl_while_the_store_hangs(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path, claim_ttl_s=TTL_S, renew_interval_s=0.3)
    started = threading.Event()
    stopped: list[float] = []
    reg = Registry()

    @reg.register("agent")
    async def agent(turn, guard):  # type: ignore[no-untyped-def]
        if turn.attempt > 1:
            return "second"
        started.set()
        try:
            await asyncio.sleep(60)  # a long model call
        except asyncio.CancelledError:
            stopped.append(time.monotonic())
            raise
        return "first"

    job = h.dispatcher().submit(Submission(kind="agent", tenant="t")).job_id
    opts = RuntimeOptions(get_wait_s=0.05, heartbeat_s=1.0, grace_s=5.0, reconcile=False)
    worker = AsyncWorker(h.settings, h.store, h.transport, reg, options=opts)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    lock = sqlite3.connect(Path(h.env["AGENT_DISPATCH_DATA_DIR"]) / "agent_dispatch_queue.db", isolation_level=None)
    try:
        assert started.wait(30)
        lock.execute("BEGIN EXCLUSIVE")  # every write of the worker now waits for the lock
        locked_at = time.monotonic()
        # Held for 3 TTLs: the turn must stop within about one TTL, while the lock is still held.
        while not stopped and time.monotonic() < locked_at + 3 * TTL_S:
            time.sleep(0.05)
        assert stopped, "the turn ran on while its renewals hung"
        assert stopped[0] - locked_at < TTL_S + 1.0
        lock.execute("ROLLBACK")
        wait_until(lambda: h.store.get(job, "t").status is Status.SUCCEEDED, timeout=60)
        item = h.store.get(job, "t")
        assert item.result == "second" and item.attempt == 2
    finally:
        lock.close()
        worker.request_stop()
        thread.join(timeout=60)
        h.close()
    assert not thread.is_alive() and worker.fatal is None
