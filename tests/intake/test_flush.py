"""The WAL flush shared by concurrent intakes: a caller is answered only after
a flush that began after its call, and a failed flush fails its waiters."""

from __future__ import annotations

import threading

import pytest

from agentdispatch.intake.flush import GroupFlush


def test_a_caller_arriving_during_a_flush_waits_for_the_next() -> None:
    entered, release = threading.Event(), threading.Event()
    log: list[str] = []

    def flush() -> None:
        log.append("start")
        if len(log) == 1:  # the first flush is held until the second caller arrived
            entered.set()
            release.wait(30)
        log.append("end")

    g = GroupFlush(flush)
    first = threading.Thread(target=g.wait)
    first.start()
    assert entered.wait(30)
    second_done = threading.Event()

    def second() -> None:
        g.wait()
        log.append("second returned")
        second_done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not second_done.wait(0.2)  # the running flush may predate its commit
    release.set()
    first.join(30)
    assert second_done.wait(30)
    t.join(30)
    assert log == ["start", "end", "start", "end", "second returned"]


def test_callers_share_one_flush() -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def flush() -> None:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            release.wait(30)

    g = GroupFlush(flush)
    leader = threading.Thread(target=g.wait)
    leader.start()
    assert entered.wait(30)
    waiters = [threading.Thread(target=g.wait) for _ in range(8)]
    for w in waiters:
        w.start()
    release.set()
    for w in [leader, *waiters]:
        w.join(30)
        assert not w.is_alive()
    assert len(calls) == 2  # eight callers, one flush after the leader's


def test_a_failed_flush_fails_its_waiters_and_the_next_one_runs() -> None:
    outcomes = iter([OSError("disk gone"), None])

    def flush() -> None:
        error = next(outcomes)
        if error is not None:
            raise error

    g = GroupFlush(flush)
    with pytest.raises(OSError, match="disk gone"):
        g.wait()
    g.wait()  # a new flush, which succeeds
