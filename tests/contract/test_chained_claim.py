"""Contract: where the queue shares the store's database, the transaction that
commits a turn also claims the thread's next one; a failure of that claim never
costs the commit, and a chained turn runs even when the worker is stopping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from agentdispatch import Status, Submission
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.handlers import builtins
from agentdispatch.transports.base import Delivery
from agentdispatch.worker import Worker


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _two_turns(harness) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    d = harness.dispatcher()
    first, second = d.submit_many(
        [Submission(kind="echo", payload={"n": n}, tenant="t", session_id=f"s{n}") for n in (1, 2)]
    )
    return first.job_id, second.job_id


def _poll_until(worker: Worker, loop: asyncio.AbstractEventLoop, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        label = worker.poll("t:0", 0, loop)
        if label is not None:
            return label
    raise AssertionError("nothing was delivered")


def _status(harness, job_id: str) -> Status:  # type: ignore[no-untyped-def]
    return harness.store.get(job_id, "t").status


def test_the_commit_claims_the_next_turn(harness, loop) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    assert _poll_until(worker, loop) == "completed"
    done = {a, b} - {j for j in (a, b) if _status(harness, j) is not Status.SUCCEEDED}
    assert len(done) == 1
    (other,) = {a, b} - done
    assert harness.transport.shared_database is (harness.transport.name != "kafka")
    if harness.transport.shared_database:
        # Claimed in the committing transaction: running already, no queue read left.
        assert _status(harness, other) is Status.RUNNING and 0 in worker._chained
    else:
        assert _status(harness, other) is Status.READY and not worker._chained
    assert _poll_until(worker, loop) == "completed"
    assert _status(harness, other) is Status.SUCCEEDED and not worker._chained


def test_a_failing_chained_claim_never_costs_the_commit(harness, loop, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    real_get = harness.transport.get
    calls: list[Delivery | None] = []

    def flaky_get(owner: str, *, visibility_s: float, wait_s: float) -> Delivery | None:
        if calls and calls[-1] is not None:  # the read after a delivery: the chained one
            calls.append(None)
            raise TaskQueueUnavailable("injected: the queue read failed")
        got = real_get(owner, visibility_s=visibility_s, wait_s=wait_s)
        calls.append(got)
        return got

    monkeypatch.setattr(harness.transport, "get", flaky_get)
    assert _poll_until(worker, loop) == "completed"
    statuses = sorted(_status(harness, j).value for j in (a, b))
    # The first turn committed on its own; the second was not claimed.
    assert statuses == ["ready", "succeeded"] and not worker._chained
    monkeypatch.setattr(harness.transport, "get", real_get)
    assert _poll_until(worker, loop) == "completed"
    assert {_status(harness, j) for j in (a, b)} == {Status.SUCCEEDED}


def test_a_chained_turn_runs_when_the_worker_stops(harness, loop) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    assert _poll_until(worker, loop) == "completed"
    worker.stopping.set()
    worker._claim_loop(0)  # returns once nothing is claimed by this thread
    expected = Status.SUCCEEDED if harness.transport.shared_database else Status.READY
    assert sorted(_status(harness, j).value for j in (a, b)) == sorted(["succeeded", expected.value])
    assert not worker._chained


def test_process_handles_one_delivery_and_claims_nothing_else(harness, loop) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    delivery = None
    deadline = time.monotonic() + 30
    while delivery is None and time.monotonic() < deadline:
        delivery = harness.transport.get("t:0", visibility_s=30.0, wait_s=0.2)
    assert delivery is not None
    assert worker.process(delivery, owner="t:0", index=0, loop=loop) == "completed"
    # One succeeded; the other is still queued for any claimant, not held by this worker.
    assert sorted(_status(harness, j).value for j in (a, b)) == ["ready", "succeeded"]
    assert not worker._chained
