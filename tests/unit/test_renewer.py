"""The worker's shared renewer: each guard renewed on its own period, woken
early only for a guard due before its next wake-up (not once per turn).
Driven by a fake clock: time moves only when the test says so."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from agentdispatch.lease import LeaseGuard, Renewer
from agentdispatch.testing import FakeClock
from agentdispatch.workitem import Lease


class _CountingStore:
    """Records renewals at the fake time (the renewer's scheduling is what is
    under test)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.renewals: dict[str, list[float]] = {}
        self._cv = threading.Condition()

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        with self._cv:
            self.renewals.setdefault(lease.job_id, []).append(self.clock())
            self._cv.notify_all()
        return lease

    def wait_for(self, job: str, n: int) -> None:
        """Until ``job`` was renewed ``n`` times (the timeout only bounds a broken test)."""
        with self._cv:
            done = self._cv.wait_for(lambda: len(self.renewals.get(job, [])) >= n, timeout=10)
        assert done, f"{job} renewed at {self.renewals.get(job)}, expected {n} renewals"


def _guard(store: Any, renewer: Renewer, job: str, period_s: float) -> LeaseGuard:
    lease = Lease(job_id=job, tenant="t", owner="w:0", epoch=1, token="x", expires_at=2000.0)
    return LeaseGuard(store, lease, ttl_s=period_s * 3, renew_interval_s=period_s, renewer=renewer)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=1000.0)


def test_each_guard_is_renewed_on_its_period_until_stopped(clock: FakeClock) -> None:
    store = _CountingStore(clock)
    renewer = Renewer(clock=clock)
    try:
        guard = _guard(store, renewer, "a", 1.0).start()
        witness = _guard(store, renewer, "w", 1.0).start()
        for n in range(1, 5):
            clock.advance(1.0)
            store.wait_for("a", n)
            store.wait_for("w", n)
        assert store.renewals["a"] == [1001.0, 1002.0, 1003.0, 1004.0]
        guard.stop()
        clock.advance(1.0)
        store.wait_for("w", 5)  # the renewer has run the tick after the stop
        assert len(store.renewals["a"]) == 4  # nothing after stop
        witness.stop()
    finally:
        renewer.close()


def test_a_guard_due_before_the_next_wakeup_wakes_the_renewer(clock: FakeClock) -> None:
    store = _CountingStore(clock)
    renewer = Renewer(clock=clock)
    try:
        slow = _guard(store, renewer, "slow", 5.0).start()
        clock.advance(1.0)
        clock.wait_for_sleeper(at=1005.0)  # the renewer sleeps until the slow guard is due
        fast = _guard(store, renewer, "fast", 0.5).start()
        clock.wait_for_sleeper(at=1001.5)  # woken by the add, it sleeps until the fast one is due
        clock.advance(0.5)
        store.wait_for("fast", 1)
        assert store.renewals == {"fast": [1001.5]}
        fast.stop()
        slow.stop()
    finally:
        renewer.close()


def test_guards_due_later_do_not_wake_the_renewer(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _CountingStore(clock)
    renewer = Renewer(clock=clock)
    notified: list[int] = []
    notify = renewer._cv.notify
    monkeypatch.setattr(renewer._cv, "notify", lambda n=1: (notified.append(n), notify(n)))
    try:
        first = _guard(store, renewer, "first", 5.0).start()
        clock.advance(1.0)
        clock.wait_for_sleeper(at=1005.0)
        before = len(notified)
        # Later turns: each due a second after the first guard.
        guards = [_guard(store, renewer, f"g{i}", 5.0).start() for i in range(100)]
        assert len(notified) == before  # one thread wake-up per turn would be 100
        for g in [first, *guards]:
            g.stop()
    finally:
        renewer.close()
