"""A tenant whose every group is held is held out of the fair claim's scan
(migration 023): a claim's work does not grow with the tenants that have
turns in flight, and every way a group comes back frees its tenant at once,
or, while another transaction holds the tenant's row, at the next claim."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from agentdispatch.dispatch import Submission
from agentdispatch.envelope import Envelope
from backends import Harness
from pg import admin, rows_read_by_a_claim


@pytest.fixture
def h(pg: Harness) -> Harness:
    return pg


def _rows(h: Harness, sql: str) -> list[tuple[Any, ...]]:
    with admin() as conn:
        conn.execute(f"SET search_path = {h.pg_schema}")
        return conn.execute(sql).fetchall()  # type: ignore[arg-type]


def _held(h: Harness) -> list[bool]:
    """Whether each tenant is held (tenants are kept by a reference, not by name)."""
    return sorted(bool(held) for (held,) in _rows(h, "SELECT held FROM dispatch_fair_tenants"))


def _wakes(h: Harness) -> int:
    return int(_rows(h, "SELECT count(*) FROM dispatch_fair_wakes")[0][0])


def _get(h: Harness, owner: str = "w:0", vis: float = 600.0) -> Any:
    return h.transport.get(owner, visibility_s=vis, wait_s=0.0)


def test_a_short_claim_reads_no_more_tenant_rows_with_tenants_in_flight(h: Harness) -> None:
    d = h.dispatcher()
    d.submit(Submission(kind="echo", tenant="new0"))
    # A claim of two with one queued: it comes up short.
    alone = rows_read_by_a_claim(h.env["STATE_DB_URI"], "dispatch_fair_tenants", 2)
    # 300 tenants with a turn each in flight (claimed, not finished), and one more queued.
    d.submit_many([Submission(kind="echo", tenant=f"t{i}") for i in range(300)])
    while _get(h) is not None:
        pass
    assert set(_held(h)) == {True}
    d.submit(Submission(kind="echo", tenant="new1"))
    busy = rows_read_by_a_claim(h.env["STATE_DB_URI"], "dispatch_fair_tenants", 2)
    # Each tenant in flight used to cost a visit and a lock of its row (300 here).
    assert busy <= alone + 10, (alone, busy)


def test_each_way_a_group_comes_back_frees_its_tenant(h: Harness) -> None:
    d = h.dispatcher()
    d.submit_many([Submission(kind="echo", tenant="a", session_id="s", payload=i) for i in range(2)])
    first = _get(h)
    assert first is not None
    assert _held(h) == [True]  # its only group's head is claimed
    assert _get(h) is None
    # A new session of the tenant: a new group, free.
    d.submit(Submission(kind="echo", tenant="a", session_id="other"))
    assert _held(h) == [False]
    other = _get(h)
    assert other is not None and Envelope.from_json(other.raw).session_id == "other"
    assert _held(h) == [True]
    # An acknowledgement: the session's next turn is its head now.
    assert h.transport.ack(first)
    assert _held(h) == [False]
    second = _get(h)
    assert second is not None
    assert _held(h) == [True]
    # A release without a delay.
    h.transport.release(second, 0.0)
    assert _held(h) == [False]
    again = _get(h)
    assert again is not None and again.raw == second.raw
    # A release with one holds the group (and the tenant) until the row is visible.
    h.transport.release(again, 60.0)
    assert _held(h) == [True]
    # A dead worker's claims, given back by the reaper.
    with h.store.transaction() as tx:
        tx.release_claims("w:", time.time())
    assert _held(h) == [False]
    assert _get(h, "w2:0") is not None
    assert _wakes(h) == 0


def test_a_lapsed_claim_frees_its_tenant_at_the_next_claim(h: Harness) -> None:
    h.dispatcher().submit(Submission(kind="echo", job_id="j1", tenant="a"))
    assert _get(h, "w1:0", vis=0.3) is not None
    assert _held(h) == [True]
    # Its worker is gone: the claim after the row's visibility ran out puts the
    # group back, frees the tenant and finds the row.
    second = h.transport.get("w2:0", visibility_s=30.0, wait_s=5.0)
    assert second is not None and second.deliveries == 2


def test_a_tenant_row_another_transaction_holds_gets_a_wake(h: Harness) -> None:
    d = h.dispatcher()
    d.submit(Submission(kind="echo", tenant="a", session_id="s1"))
    assert _get(h) is not None
    assert _held(h) == [True]
    # Another transaction (a claim serving the tenant, say) holds its row while a
    # new session of it arrives: the enqueue does not wait, it leaves a wake.
    with psycopg.connect(h.env["STATE_DB_URI"]) as other:
        other.execute("SELECT 1 FROM dispatch_fair_tenants FOR NO KEY UPDATE")
        done = threading.Event()
        threading.Thread(
            target=lambda: (d.submit(Submission(kind="echo", tenant="a", session_id="s2")), done.set()), daemon=True
        ).start()
        assert done.wait(10.0)  # not held up by the lock
        assert _wakes(h) == 1
        assert _held(h) == [True]
        # While the row is still held, a claim leaves the wake for later.
        assert _get(h) is None
        assert _wakes(h) == 1
        other.rollback()
    # The next claim clears the tenant, takes the wake and finds the turn.
    got = _get(h)
    assert got is not None and Envelope.from_json(got.raw).session_id == "s2"
    assert _wakes(h) == 0


def test_concurrent_claims_acks_and_arrivals_leave_no_tenant_held_with_a_free_group(h: Harness) -> None:
    """Claimers, acknowledgers and submitters race over a few tenants (each
    turn its own session, so every claim may hold a tenant's last free group):
    every turn is claimed and acknowledged, and at the end no tenant is held
    while it has a free group."""
    d = h.dispatcher()
    total, tenants = 600, 6
    submitted = threading.Event()
    acked: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def submitter(k: int) -> None:
        try:
            for i in range(k, total, 2):
                d.submit(Submission(kind="echo", tenant=f"t{i % tenants}", job_id=f"j{i}"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def worker(w: int) -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with lock:
                    if len(acked) >= total:
                        return
                got = h.transport.get(f"w{w}:0", visibility_s=600.0, wait_s=0.05 if submitted.is_set() else 0.01)
                if got is None:
                    continue
                assert h.transport.ack(got)
                with lock:
                    acked.append(Envelope.from_json(got.raw).job_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    subs = [threading.Thread(target=submitter, args=(k,)) for k in range(2)]
    workers = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in subs + workers:
        t.start()
    for t in subs:
        t.join()
    submitted.set()
    for t in workers:
        t.join()
    assert errors == []
    assert sorted(acked) == sorted(f"j{i}" for i in range(total))
    stuck = _rows(
        h,
        "SELECT t.tenant_ref FROM dispatch_fair_tenants t WHERE t.held AND EXISTS ("
        "SELECT 1 FROM dispatch_fair_groups g WHERE g.tenant_ref = t.tenant_ref AND g.priority = t.priority"
        " AND g.held_until = 0)",
    )
    assert stuck == []
