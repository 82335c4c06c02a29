"""The watchdog behind AGENT_DISPATCH_PG_ANSWER_TIMEOUT_S, on a fake clock:
only a transaction still running past its deadline has its connection cut,
and a connection cut as its transaction finished is closed, never reused."""

from __future__ import annotations

from typing import Any

import pytest

from agentdispatch.backends.postgres import deadline
from agentdispatch.backends.postgres.deadline import Deadlines


class FakeConn:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_only_a_transaction_past_its_deadline_is_cut() -> None:
    clock, cut = Clock(), []
    dl = Deadlines(clock=clock, on_cut=cut.append)
    fast, slow = FakeConn(), FakeConn()
    with dl.watch(slow, 5.0) as slow_ticket:
        with dl.watch(fast, 5.0):
            clock.now += 1
        assert dl.expire_due() == 0
        clock.now += 4.5
        # The watchdog thread reads the same fake clock and may cut it first.
        dl.expire_due()
        assert cut == [slow] and slow_ticket is not None and slow_ticket.expired
    assert slow.closed and not fast.closed
    clock.now += 100
    assert dl.expire_due() == 0 and cut == [slow]


def test_no_bound_watches_nothing() -> None:
    clock, cut = Clock(), []
    dl = Deadlines(clock=clock, on_cut=cut.append)
    for off in (None, 0.0):
        with dl.watch(FakeConn(), off) as ticket:
            clock.now += 10_000
            assert ticket is None and dl.expire_due() == 0
    assert cut == []


def test_the_watchdog_thread_cuts_on_time() -> None:
    cut: list[Any] = []
    dl = Deadlines(on_cut=cut.append)
    conn = FakeConn()
    with dl.watch(conn, 0.05) as ticket:
        assert ticket is not None
        while not ticket.expired:
            with dl._cond:
                dl._cond.wait(0.01)
    assert cut == [conn] and conn.closed


def test_an_idle_watchdog_thread_ends_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadline, "IDLE_EXIT_S", 0.01)
    dl = Deadlines(on_cut=lambda conn: None)
    with dl.watch(FakeConn(), 30.0):
        first = dl._thread
    assert first is not None
    first.join(timeout=10)
    assert not first.is_alive() and dl._thread is None
    with dl.watch(FakeConn(), 30.0):
        assert dl._thread is not None and dl._thread is not first
