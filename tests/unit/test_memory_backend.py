"""The in-memory backend of ``agentdispatch.testing``: handlers run without a
database, time moves with a fake clock, and a failed transaction changes nothing."""

from __future__ import annotations

import pytest

from agentdispatch import Status, Submission
from agentdispatch.errors import InvalidInput
from agentdispatch.handlers import Registry, Turn, builtins
from agentdispatch.lease import LeaseGuard
from agentdispatch.testing import FakeClock, MemoryBackend, memory_dispatcher

START = 1_800_000_000.0


def test_a_submitted_turn_runs_to_its_result() -> None:
    dispatcher, backend = memory_dispatcher()
    job = dispatcher.submit(Submission(kind="echo", tenant="t", payload={"x": 1}))
    assert backend.run_until_idle(builtins()) == ["completed"]
    view = dispatcher.status(job.job_id, "t")
    assert (view["status"], view["result"]) == ("succeeded", {"x": 1})
    assert backend.run_until_idle(builtins()) == []  # nothing left


def test_a_retry_waits_for_the_clock_not_for_real_time() -> None:
    clock = FakeClock(START)
    backend = MemoryBackend(clock=clock)
    calls: list[int] = []
    reg = Registry()

    @reg.register("flaky")
    def flaky(turn: Turn, guard: LeaseGuard) -> str:
        calls.append(turn.attempt)
        if turn.attempt == 1:
            raise ConnectionError("downstream hiccup")
        return "ok"

    job = backend.dispatcher().submit(Submission(kind="flaky", tenant="t"))
    backend.run_until_idle(reg)
    item = backend.store.get(job.job_id, "t")
    assert item.status is Status.READY and item.ready_at > START and calls == [1]
    assert backend.run_until_idle(reg) == []  # the backoff has not passed
    clock.advance(item.ready_at - START)
    assert backend.run_until_idle(reg) == ["completed"]
    assert calls == [1, 2] and backend.store.get(job.job_id, "t").result == "ok"


def test_turns_of_one_session_run_in_order() -> None:
    dispatcher, backend = memory_dispatcher()
    seen: list[int] = []
    reg = Registry()

    @reg.register("step")
    def step(turn: Turn, guard: LeaseGuard) -> None:
        seen.append(turn.payload["n"])

    dispatcher.submit_many([Submission(kind="step", tenant="t", session_id="s", payload={"n": n}) for n in range(5)])
    backend.run_until_idle(reg)
    assert seen == [0, 1, 2, 3, 4]


def test_a_failed_submission_changes_nothing() -> None:
    dispatcher, backend = memory_dispatcher()
    good = Submission(kind="echo", tenant="t")
    orphan = Submission(kind="echo", tenant="t", dependencies=("no-such-job",))
    with pytest.raises(InvalidInput, match="does not exist"):
        dispatcher.submit_many([good, orphan])  # the first item was inserted, then rolled back
    assert backend.store.counts("t") == {} and backend.transport.depth() == 0


def test_a_failed_nested_transaction_is_undone_alone() -> None:
    backend = MemoryBackend()
    kept, undone = backend.dispatcher().submit_many([Submission(kind="echo", tenant="t") for _ in range(2)])
    with backend.db.tx():
        backend.store.cancel(kept.job_id, "t")
        with pytest.raises(RuntimeError), backend.db.tx():
            backend.store.cancel(undone.job_id, "t")
            raise RuntimeError("the caller carries on after this")
    assert backend.store.get(kept.job_id, "t").status is Status.CANCELLED
    assert backend.store.get(undone.job_id, "t").status is Status.READY
    events = [e["event"] for e in backend.store.history(undone.job_id, "t")["events"]]
    assert events == ["submitted"]
