"""Contract: the async runtime on every backend (turns as tasks, the async
guard, fencing that reaches a running turn, timeouts, overload)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from agentdispatch import LeaseLost, Registry, Status, Submission
from agentdispatch.errors import Overloaded
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.transports.flow import TurnEnd
from agentdispatch.workitem import Outcome

from .helpers import wait_until

FAST = {"claim_ttl_s": 3.0, "renew_interval_s": 0.3}


@contextmanager
def running(harness, registry: Registry, store=None, **options) -> Iterator[AsyncWorker]:
    opts = RuntimeOptions(**{"get_wait_s": 0.05, "heartbeat_s": 1.0, "grace_s": 5.0, **options})
    worker = AsyncWorker(harness.settings, store or harness.store, harness.transport, registry, options=opts)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(worker.run_forever()), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the worker did not stop"
    assert worker.fatal is None, worker.fatal


def test_many_async_turns_in_flight_at_once_and_each_effect_once(make_harness):
    harness = make_harness(**FAST)
    n = 40
    inside = 0
    all_in = threading.Event()
    lock = threading.Lock()
    effects: list[str] = []
    reg = Registry()

    @reg.register("agent")
    async def agent(turn, guard):
        nonlocal inside
        with lock:
            inside += 1
            if inside == n:
                all_in.set()
        # Every turn waits until all n are in flight: they finish only if the
        # worker really runs n at once on its loop.
        while not all_in.is_set():
            await asyncio.sleep(0.01)
        sent = await guard.side_effect_async(f"send:{turn.job_id}", lambda: _record(effects, turn.job_id))
        return {"sent": sent}

    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="agent", tenant="t", payload={"i": i})) for i in range(n)]
    with running(harness, reg, concurrency=n, threads=2) as worker:
        wait_until(lambda: worker.ended[TurnEnd.COMPLETED] == n, timeout=60)
    assert sorted(effects) == sorted(j.job_id for j in jobs)
    for j in jobs:
        item = harness.store.get(j.job_id, "t")
        assert item.status is Status.SUCCEEDED and item.result == {"sent": j.job_id}
        ledger = harness.store.history(j.job_id, "t")["side_effects"]
        assert [(e["key"], e["state"]) for e in ledger] == [(f"send:{j.job_id}", "committed")]


async def _record(effects: list[str], job_id: str) -> str:
    effects.append(job_id)
    return job_id


def test_session_turns_never_overlap_and_sync_handlers_still_run(make_harness):
    harness = make_harness(**FAST)
    active: dict[str, int] = {}
    overlaps: list[str] = []
    lock = threading.Lock()
    reg = Registry()

    def enter(session: str) -> None:
        with lock:
            active[session] = active.get(session, 0) + 1
            if active[session] > 1:
                overlaps.append(session)

    def leave(session: str) -> None:
        with lock:
            active[session] -= 1

    @reg.register("async_turn")
    async def async_turn(turn, guard):
        enter(turn.session_id)
        await asyncio.sleep(0.02)
        leave(turn.session_id)
        return turn.payload

    @reg.register("sync_turn")
    def sync_turn(turn, guard):
        enter(turn.session_id)
        guard.side_effect(f"e:{turn.job_id}", lambda: None)
        leave(turn.session_id)
        return turn.payload

    d = harness.dispatcher()
    jobs = [
        d.submit(Submission(kind=("async_turn", "sync_turn")[i % 2], tenant="t", session_id=f"s{i % 3}", payload=i))
        for i in range(24)
    ]
    with running(harness, reg, concurrency=16, threads=4) as worker:
        wait_until(lambda: worker.ended[TurnEnd.COMPLETED] == len(jobs), timeout=60)
    assert overlaps == []
    assert [harness.store.get(j.job_id, "t").result for j in jobs] == list(range(24))


def test_cancel_mid_await_cancels_the_task_and_fences_the_late_commit(make_harness):
    # Renewals far apart: only the worker's cancellation poll can stop the turn in time.
    harness = make_harness(claim_ttl_s=120.0, renew_interval_s=60.0)
    started = threading.Event()
    cancelled = threading.Event()
    effects: list[str] = []
    leases = []
    reg = Registry()

    @reg.register("agent")
    async def agent(turn, guard):
        leases.append(guard.lease)
        started.set()
        try:
            await asyncio.sleep(3600)  # a model call that never answers
        except asyncio.CancelledError:
            cancelled.set()
            raise
        await guard.side_effect_async("send", lambda: _record(effects, turn.job_id))

    job = harness.dispatcher().submit(Submission(kind="agent", tenant="t"))
    with running(harness, reg, concurrency=4) as worker:
        assert started.wait(30)
        harness.dispatcher().cancel(job.job_id, "t")
        # Within a renew interval or so (a poll, not a timing assert).
        assert cancelled.wait(30), "the running task was not cancelled"
        assert worker.renewer.calls == 0, "a renewal, not the cancellation poll, stopped the turn"
        wait_until(lambda: worker.ended[TurnEnd.FENCED] == 1)
    assert effects == []
    assert harness.store.history(job.job_id, "t")["side_effects"] == []
    assert harness.store.get(job.job_id, "t").status is Status.CANCELLED
    try:
        harness.store.commit(leases[0], Outcome(ok=True, result="late"))
    except LeaseLost:
        pass
    else:
        raise AssertionError("the late commit was not fenced")


class _LatePoll:
    """The real store, with the worker's first cancellation poll held until
    the test lets it go: a read that waited for a connection or the CPU."""

    def __init__(self, store) -> None:
        self._store = store
        self.polled = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def cancelled_since(self, since: float) -> tuple[float, list[str]]:
        if not self.polled.is_set():
            self.polled.set()
            assert self.go.wait(30)
        return self._store.cancelled_since(since)


def test_a_cancellation_made_while_the_first_poll_waits_still_stops_the_turn(make_harness, monkeypatch):
    # No lookback: only the claim time can put the cancellation inside the window.
    monkeypatch.setattr("agentdispatch.runtime.worker.CANCEL_LOOKBACK_S", 0.0)
    harness = make_harness(claim_ttl_s=120.0, renew_interval_s=60.0)
    store = _LatePoll(harness.store)
    started = threading.Event()
    cancelled = threading.Event()
    reg = Registry()

    @reg.register("agent")
    async def agent(turn, guard):
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    job = harness.dispatcher().submit(Submission(kind="agent", tenant="t"))
    with running(harness, reg, store=store, concurrency=4, cancel_poll_s=0.05) as worker:
        assert started.wait(30)
        assert store.polled.wait(30)
        harness.dispatcher().cancel(job.job_id, "t")
        store.go.set()
        assert cancelled.wait(30), "the running task was not cancelled"
        assert worker.renewer.calls == 0
        wait_until(lambda: worker.ended[TurnEnd.FENCED] == 1)
    assert harness.store.get(job.job_id, "t").status is Status.CANCELLED


@pytest.mark.parametrize("where", ["kind", "submission"])
def test_a_turn_past_its_timeout_is_cancelled_and_retried_with_reason_timeout(make_harness, where):
    harness = make_harness(**FAST)
    cancelled = threading.Event()
    reg = Registry()

    # The kind's timeout is an hour where the submission's own must win.
    @reg.register("hangs", timeout_s=0.3 if where == "kind" else 3600.0)
    async def hangs(turn, guard):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    sub = Submission(kind="hangs", tenant="t", timeout_s=0.3 if where == "submission" else None)
    job = harness.dispatcher().submit(sub)
    assert harness.store.get(job.job_id, "t").timeout_s == (0.3 if where == "submission" else None)
    with running(harness, reg, concurrency=2):
        assert cancelled.wait(30)
        wait_until(
            lambda: harness.store.get(job.job_id, "t").attempt >= 1 and _reason(harness, job.job_id) == "timeout"
        )
    item = harness.store.get(job.job_id, "t")
    assert item.error is not None and item.error.startswith("timeout")


def _reason(harness, job_id: str) -> str | None:
    item = harness.store.get(job_id, "t")
    return item.reason if item.status in (Status.READY, Status.RUNNING) and item.error else None


def test_overloaded_lowers_the_concurrency_limit_and_retries_the_turn(make_harness):
    harness = make_harness(**FAST)
    reg = Registry()

    @reg.register("gateway")
    async def gateway(turn, guard):
        raise Overloaded(0.2)

    job = harness.dispatcher().submit(Submission(kind="gateway", tenant="t"))
    with running(harness, reg, concurrency=64) as worker:
        wait_until(lambda: worker.ended[TurnEnd.RETRIED] >= 1)
        assert worker.limit.limit < 64
    item = harness.store.get(job.job_id, "t")
    assert item.error is not None and "overloaded" in item.error


def test_a_child_turn_on_the_runtime_sees_its_parents_results(harness):
    reg = Registry()

    async def make(turn, guard):
        return {"from": turn.payload}

    async def gather(turn, guard):
        return {"parents": turn.parent_results}

    reg.add("make", make)
    reg.add("gather", gather)
    d = harness.dispatcher()
    a = d.submit(Submission(kind="make", tenant="t", payload="a"))
    child = d.submit(Submission(kind="gather", tenant="t", dependencies=(a.job_id,)))
    with running(harness, reg, concurrency=4, threads=2):
        wait_until(lambda: harness.store.get(child.job_id, "t").status is Status.SUCCEEDED, timeout=30)
    assert harness.store.get(child.job_id, "t").result == {"parents": {a.job_id: {"from": "a"}}}


def test_a_finished_turn_commits_while_the_claimer_waits_for_work(make_harness):
    # The claimer of a dry queue waits for news (here until the test lets it
    # go); the turn it started must commit meanwhile: the wait holds no
    # thread that commits need.
    harness = make_harness(**FAST)
    started, waiting, let_go = threading.Event(), threading.Event(), threading.Event()
    real_wait = harness.transport.wait

    def held_wait(timeout_s: float) -> None:
        if not started.is_set():  # before the turn came (a consumer may still be joining)
            real_wait(timeout_s)
            return
        waiting.set()
        let_go.wait(60)

    harness.transport.wait = held_wait  # type: ignore[method-assign]
    if hasattr(harness.store, "wait_for_submission"):  # an idle worker's wait on SQLite
        harness.store.wait_for_submission = held_wait
    real_poll = getattr(harness.transport, "arrival_poll_s", None)
    if real_poll is not None:  # PostgreSQL: the claimer waits for news on the loop itself

        def held_poll() -> float:
            if started.is_set():
                waiting.set()
            return real_poll()

        harness.transport.arrival_poll_s = held_poll
    reg = Registry()

    @reg.register("agent")
    async def agent(turn, guard):
        started.set()
        while not waiting.is_set():  # the claimer is in its wait: finish now
            await asyncio.sleep(0.01)
        return "done"

    job = harness.dispatcher().submit(Submission(kind="agent", tenant="t"))
    try:
        with running(harness, reg, concurrency=4) as worker:
            wait_until(lambda: worker.ended[TurnEnd.COMPLETED] == 1, timeout=30)
            let_go.set()
    finally:
        let_go.set()
    assert harness.store.get(job.job_id, "t").status is Status.SUCCEEDED
