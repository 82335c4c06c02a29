"""The batch renewer: one store call renews many leases; a refused one
revokes its guard and tells the runtime (which cancels the turn)."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import pytest

from agentdispatch import LeaseLost
from agentdispatch.lease import LeaseGuard
from agentdispatch.runtime.renewer import BatchRenewer
from agentdispatch.testing import FakeClock
from agentdispatch.workitem import Lease


class _Store:
    def __init__(self, refuse: set[str]) -> None:
        self.calls: list[list[str]] = []
        self.refuse = refuse
        self.called = threading.Event()

    def renew_many(self, leases: list[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        self.calls.append([lease.job_id for lease in leases])
        self.called.set()
        return [
            LeaseLost(f"{lease.job_id} fenced") if lease.job_id in self.refuse else replace(lease, expires_at=99.0)
            for lease in leases
        ]


def _guard(store: object, job: str) -> LeaseGuard:
    lease = Lease(job_id=job, tenant="t", owner="w:0", epoch=1, token="x", expires_at=1.0)
    return LeaseGuard(store, lease, ttl_s=3.0, renew_interval_s=1.0)  # type: ignore[arg-type]


def test_one_call_renews_every_guard_and_refusals_revoke():
    store = _Store(refuse={"j3"})
    guards = [_guard(store, f"j{i}") for i in range(6)]
    told: list[str] = []
    guards[3].on_lost = told.append
    BatchRenewer(store).renew(guards)  # type: ignore[arg-type]
    assert store.calls == [[f"j{i}" for i in range(6)]]
    assert guards[3].lost and told == ["j3 fenced"]
    assert all(g.lease.expires_at == 99.0 for i, g in enumerate(guards) if i != 3)


def test_a_round_with_refusals_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = _Store(refuse={"j1", "j4"})
    renewer = BatchRenewer(store)  # type: ignore[arg-type]
    guards = [_guard(store, f"j{i}") for i in range(6)]
    for g in guards:
        renewer.add(g)
    with caplog.at_level(logging.WARNING, logger="agentdispatch.runtime"):
        renewer.renew(guards)
        renewer.renew([guards[0]])
    [record] = caplog.records
    assert record.getMessage() == "renewal refused for 2 lease(s), their turns stop and commit nothing: j1 fenced"


@pytest.mark.parametrize("meanwhile", ["ended", "stopped by the watchdog"])
def test_a_refusal_of_a_turn_gone_meanwhile_is_not_logged(meanwhile: str, caplog: pytest.LogCaptureFixture) -> None:
    # While the renewal was on its way, the turn ended (and its commit made
    # the renewal fail), or the watchdog stopped it (and logged that).
    store = _Store(refuse={"j0"})
    renewer = BatchRenewer(store)  # type: ignore[arg-type]
    guard = _guard(store, "j0")
    renewer.add(guard)
    renew_many = store.renew_many

    def gone_meanwhile(leases: list[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        if meanwhile == "ended":
            renewer.remove(guard)
        else:
            guard.revoke("not renewed within 3 s")
        return renew_many(leases, ttl_s)

    store.renew_many = gone_meanwhile  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="agentdispatch.runtime"):
        renewer.renew([guard])
    assert guard.lost and caplog.records == []


def test_the_thread_renews_due_guards_together():
    store = _Store(refuse=set())
    clock = FakeClock(start=0.0)
    renewer = BatchRenewer(store, clock=clock).start()  # type: ignore[arg-type]
    try:
        guards = [_guard(store, f"j{i}") for i in range(50)]
        for g in guards:
            renewer.add(g)
            clock.advance(0.001)  # added over a short span, as a claim batch is
        clock.advance(1.2 - clock())  # every guard is due (or due within half a period)
        with renewer._cv:
            renewer._cv.notify()
        assert store.called.wait(10)
        # One statement for all of them, not one per guard.
        assert len(store.calls[0]) == 50, store.calls
    finally:
        renewer.close()


class _SlowStore(_Store):
    """A store whose renewals take ``took`` seconds of the fake clock."""

    def __init__(self, clock: FakeClock, took: float) -> None:
        super().__init__(refuse=set())
        self.clock = clock
        self.took = took

    def renew_many(self, leases: list[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        self.clock.advance(self.took)
        return super().renew_many(leases, ttl_s)


def _slow_guard(store: object, job: str) -> LeaseGuard:
    lease = Lease(job_id=job, tenant="t", owner="w:0", epoch=1, token="x", expires_at=1.0)
    return LeaseGuard(store, lease, ttl_s=12.0, renew_interval_s=4.0)  # type: ignore[arg-type]


def test_a_batch_starts_ahead_so_that_a_slow_commit_lands_on_time():
    clock = FakeClock(start=0.0)
    store = _SlowStore(clock, took=0.4)
    renewer = BatchRenewer(store, clock=clock)  # type: ignore[arg-type]  # no thread: driven by hand
    guard = _slow_guard(store, "j1")
    renewer.add(guard)  # due at 4.0, every 4 s
    assert renewer.lead(guard.every) == 1.0  # before any batch was timed
    clock.advance(3.1 - clock())  # within the lead: due now
    assert renewer._take_due() == [(4.0, guard)]
    renewer.renew_due([guard], 4.0)
    assert store.calls == [["j1"]]
    assert renewer.worst_lateness_s == 0.0  # committed at 3.5, before 4.0
    # From now on twice the slowest batch, at most a quarter of the period.
    assert renewer.lead(guard.every) == pytest.approx(0.8)
    store.took = 3.0
    clock.advance(7.0 - clock())
    assert renewer._take_due() == [(7.1, guard)]
    renewer.renew_due([guard], 7.1)
    assert renewer.lead(guard.every) == 1.0
    # Slower than any lead allows: due at 7.1 (taken at 3.1, every 4 s), committed at 10.0.
    assert renewer.worst_lateness_s == pytest.approx(2.9)


def test_a_round_renews_the_earliest_due_first_a_chunk_a_statement():
    clock = FakeClock(start=0.0)
    store = _Store(refuse=set())
    renewer = BatchRenewer(store, clock=clock)  # type: ignore[arg-type]  # no thread: driven by hand
    renewer.CHUNK = 2
    guards = [_slow_guard(store, f"j{i}") for i in range(5)]
    for g in reversed(guards):  # added latest first: j4 is due first
        renewer.add(g)
        clock.advance(0.1)
    clock.advance(4.0 - clock())
    due = renewer._take_due()
    assert due is not None and [g.job_id for _, g in due] == ["j4", "j3", "j2", "j1", "j0"]
    renewer.renew_round(due)
    assert store.calls == [["j4", "j3"], ["j2", "j1"], ["j0"]]
