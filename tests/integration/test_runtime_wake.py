"""An idle async worker wakes for a submission (PostgreSQL's LISTEN, SQLite's
sequence watch) instead of waiting out its poll, and its claim asks for as
many turns as the wake told of and one more (turns that came unannounced
while it was woken), not for a full batch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentdispatch import Registry, Status, Submission
from agentdispatch.transports.flow import Batch
from backends import Harness, postgres_harness, sqlite_harness
from contract.helpers import wait_until
from contract.test_runtime import running

#: Far longer than the turns below take: a claim that followed the poll
#: rather than the wake asks for a full batch, which the test would see.
POLL_S = 10.0


def _slow_polling(h: Harness) -> Harness:
    """``h`` with its transport polling every ``POLL_S`` (LISTEN or not)."""
    transport: Any = h.transport
    transport.poll_s = POLL_S
    if hasattr(transport, "fallback_poll_s"):
        transport.fallback_poll_s = POLL_S
    return h


@pytest.mark.parametrize("build", [sqlite_harness, postgres_harness], ids=["sqlite", "postgres"])
def test_an_idle_worker_claims_what_the_wake_told_of(build: Callable[..., Harness], tmp_path: Path) -> None:
    h = _slow_polling(build(tmp_path))
    reg = Registry()
    started: list[str] = []

    @reg.register("agent")
    async def agent(turn: Any, guard: Any) -> None:
        started.append(turn.job_id)

    asked: list[int] = []
    try:
        with running(h, reg, concurrency=16, get_wait_s=POLL_S) as worker:
            real = worker._claim

            def claim(n: int) -> Batch:
                asked.append(n)
                return real(n)

            worker._claim = claim  # type: ignore[method-assign]
            d = h.dispatcher()
            jobs = []
            for _ in range(3):  # one at a time, each after the worker went idle again
                jobs.append(d.submit(Submission(kind="agent", tenant="t")).job_id)
                wait_until(lambda: h.store.get(jobs[-1], "t").status is Status.SUCCEEDED, timeout=60)
            woken = worker.woken_claims
    finally:
        h.close()
    assert sorted(started) == sorted(jobs)
    # The first may race the worker's start-up; the later ones came by the wake.
    assert woken >= 2
    assert asked.count(2) >= 2, asked  # one turn told of: it and one more asked for, not the batch of 16


def test_a_stop_ends_the_wait_for_news(tmp_path: Path) -> None:
    # The claimer waits on the loop for the listener's news: a stop must end
    # that wait at once, or the worker would linger a whole poll (running()
    # asserts that the worker's thread ended within its join timeout).
    h = postgres_harness(tmp_path)
    transport: Any = h.transport
    transport.poll_s = transport.fallback_poll_s = 600.0
    dry = threading.Event()
    try:
        with running(h, Registry(), get_wait_s=600.0) as worker:
            real = worker._claim

            def claim(n: int) -> Batch:
                batch = real(n)
                if batch.dry:
                    dry.set()
                return batch

            worker._claim = claim  # type: ignore[method-assign]
            # After the listener's first news a claim runs and finds nothing: then the wait.
            wait_until(lambda: transport._listener is not None and transport._listener.healthy, timeout=30)
            d = h.dispatcher()
            d.submit(Submission(kind="nothing", tenant="t"))  # news, and a claim after it
            assert dry.wait(30)
    finally:
        h.close()
    assert worker.stopping


@pytest.mark.parametrize("build", [sqlite_harness, postgres_harness], ids=["sqlite", "postgres"])
def test_news_of_more_turns_than_free_slots_is_not_left_to_the_poll(
    build: Callable[..., Harness], tmp_path: Path
) -> None:
    # One slot, three turns told of at once: the claimer takes one, then the
    # next as each turn ends, without a wait for news that ends at the poll.
    h = _slow_polling(build(tmp_path))
    reg = Registry()

    @reg.register("agent")
    async def agent(turn: Any, guard: Any) -> None:
        return None

    waits: list[int | None] = []
    try:
        with running(h, reg, concurrency=1, get_wait_s=POLL_S) as worker:
            real_wait = worker._await_work

            async def await_work(idle: bool) -> int | None:
                told = await real_wait(idle)
                waits.append(told)
                return told

            worker._await_work = await_work  # type: ignore[method-assign]
            # Idle first: the start-up claims and the listener's first news are behind us.
            warm = h.dispatcher().submit(Submission(kind="agent", tenant="t")).job_id
            wait_until(lambda: h.store.get(warm, "t").status is Status.SUCCEEDED, timeout=60)
            waits.clear()
            jobs = [j.job_id for j in h.dispatcher().submit_many([Submission(kind="agent", tenant="t")] * 3)]
            for job in jobs:
                wait_until(lambda job=job: h.store.get(job, "t").status is Status.SUCCEEDED, timeout=60)
            ended = list(waits)
    finally:
        h.close()
    # Every wait since the news ended with news (a count), none at the poll (None).
    assert None not in ended, ended
