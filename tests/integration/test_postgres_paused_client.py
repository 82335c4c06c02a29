"""A client paused in the middle of a transaction (SIGSTOP, a frozen VM; the
kernel keeps its connection open) does not hold the rows it locked for good:
PostgreSQL ends its session after a few seconds, another worker runs the turn,
and the paused client's transaction fails with a clear error when it goes on."""

from __future__ import annotations

import threading

from agentdispatch import Status, Submission
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.handlers import Registry
from contract.helpers import wait_until


def test_a_transaction_left_open_loses_its_locks(pg) -> None:
    job = pg.dispatcher().submit(Submission(kind="echo", tenant="t", session_id="s")).job_id
    locked, resume = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def paused_client() -> None:
        try:
            with pg.store.db.transaction(False) as conn:
                # What a claim holds: the session's queue row and its item.
                conn.execute("SELECT id FROM agent_dispatch_queue WHERE job_id = %s FOR UPDATE", (job,)).fetchall()
                conn.execute("SELECT id FROM work_items WHERE id = %s FOR UPDATE", (job,)).fetchall()
                locked.set()
                resume.wait(120)
                conn.execute("SELECT 1").fetchall()
        except BaseException as exc:
            failure.append(exc)

    client = threading.Thread(target=paused_client)
    client.start()
    assert locked.wait(30)
    registry = Registry()
    registry.register("echo")(lambda turn, guard: "done")
    worker = pg.worker(registry)
    worker.start()
    try:
        wait_until(lambda: pg.store.get(job, "t").status is Status.SUCCEEDED, timeout=60)
    finally:
        resume.set()
        client.join(60)
        worker.stop()
    assert len(failure) == 1 and isinstance(failure[0], TaskQueueUnavailable), failure
    assert "IdleInTransactionSessionTimeout" in str(failure[0])
