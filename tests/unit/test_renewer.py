"""The worker's shared renewer: each guard renewed on its own period, woken
early only for a guard due before its next wake-up (not once per turn)."""

from __future__ import annotations

import threading
import time
from typing import Any

from agentdispatch.lease import LeaseGuard, Renewer
from agentdispatch.workitem import Lease


class _CountingStore:
    """Records renewals (the renewer's scheduling is what is under test)."""

    def __init__(self) -> None:
        self.renewals: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        with self._lock:
            self.renewals.setdefault(lease.job_id, []).append(time.monotonic())
        return lease


def _guard(store: Any, renewer: Renewer, job: str, period_s: float) -> LeaseGuard:
    lease = Lease(job_id=job, tenant="t", owner="w:0", epoch=1, token="x", expires_at=time.time() + 60)
    return LeaseGuard(store, lease, ttl_s=period_s * 3, renew_interval_s=period_s, renewer=renewer)


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_each_guard_is_renewed_on_its_period_until_stopped() -> None:
    store = _CountingStore()
    renewer = Renewer()
    try:
        guard = _guard(store, renewer, "a", 0.05).start()
        time.sleep(0.4)
        guard.stop()
        count = len(store.renewals.get("a", []))
        time.sleep(0.2)
        assert 4 <= count <= 9, count
        assert len(store.renewals["a"]) == count  # nothing after stop
    finally:
        renewer.close()


def test_a_guard_due_before_the_next_wakeup_wakes_the_renewer() -> None:
    store = _CountingStore()
    renewer = Renewer()
    try:
        slow = _guard(store, renewer, "slow", 5.0).start()
        time.sleep(0.1)  # the renewer now sleeps until the slow guard is due
        t0 = time.monotonic()
        fast = _guard(store, renewer, "fast", 0.05).start()
        deadline = time.monotonic() + 2.0
        while not store.renewals.get("fast") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.renewals.get("fast"), "the short-period guard was not renewed"
        assert store.renewals["fast"][0] - t0 < 1.0
        fast.stop()
        slow.stop()
    finally:
        renewer.close()


def test_guards_due_later_do_not_wake_the_renewer() -> None:
    store = _CountingStore()
    renewer = Renewer()
    cond = _CountingCondition()
    renewer._cv = cond  # count wake-ups from now on
    try:
        first = _guard(store, renewer, "first", 5.0).start()
        time.sleep(0.1)
        before = cond.notified
        guards = [_guard(store, renewer, f"g{i}", 5.0).start() for i in range(100)]
        assert cond.notified == before  # one thread wake-up per turn would be 100
        for g in [first, *guards]:
            g.stop()
    finally:
        renewer.close()
