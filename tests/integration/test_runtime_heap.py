"""While an async worker serves, the cyclic collector leaves the startup heap
alone and collects young objects less often; when the last worker of the
process stops, the collector is as it was (an embedding process keeps its own)."""

from __future__ import annotations

import gc
from pathlib import Path

from agentdispatch import Registry, Status, Submission, heap
from backends import sqlite_harness
from contract.helpers import wait_until
from contract.test_runtime import running


def test_the_collector_is_tuned_while_workers_serve_and_restored_after(tmp_path: Path) -> None:
    before = gc.get_threshold()
    assert before[0] < heap.YOUNG_THRESHOLD and gc.get_freeze_count() == 0
    h = sqlite_harness(tmp_path)
    reg = Registry()
    built = object.__new__(type("Built", (), {}))  # a tracked object made before the workers start

    @reg.register("agent")
    async def agent(turn: object, guard: object) -> None:
        return None

    try:
        with running(h, reg) as first:
            wait_until(lambda: gc.get_freeze_count() > 0, timeout=30)
            frozen = gc.get_freeze_count()
            assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
            # What startup built is out of the collector's reach.
            assert not any(o is built for o in gc.get_objects())
            with running(h, reg):
                job = h.dispatcher().submit(Submission(kind="agent", tenant="t")).job_id
                wait_until(lambda: h.store.get(job, "t").status is Status.SUCCEEDED, timeout=30)
                # A second worker in the process shares the setting: nothing more is
                # frozen (frozen objects can still be freed when unreferenced).
                assert gc.get_freeze_count() <= frozen
            # The first still serves: still tuned.
            assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD and gc.get_freeze_count() > 0
            assert first.fatal is None
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0
        assert any(o is built for o in gc.get_objects())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
        h.close()


def test_a_gateway_and_a_worker_in_one_process_share_the_collector() -> None:
    before = gc.get_threshold()
    try:
        with heap.serving(rarer_young=False):  # a gateway: frozen, thresholds kept
            assert gc.get_freeze_count() > 0 and gc.get_threshold() == before
            with heap.serving():  # a worker starts beside it
                assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
            # The worker stopped: its threshold goes, the gateway's freeze stays.
            assert gc.get_threshold() == before and gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
