"""A group whose head is claimed is held out of the fair claim's scan until
its row is visible again: a claim's work does not grow with the turns in
flight, and every way a head comes back (ack, release, a lapsed claim, a
reaped worker) puts its group back at once."""

from __future__ import annotations

import time
from typing import Any

import pytest

from agentdispatch.dispatch import Submission
from agentdispatch.envelope import Envelope
from backends import Harness
from pg import admin, rows_read_by_a_claim


@pytest.fixture
def h(pg: Harness) -> Harness:
    return pg


def _holds(h: Harness) -> dict[str, float]:
    """held_until of every fairness group, by its session (group) reference."""
    with admin() as conn:
        rows = conn.execute(f"SELECT group_ref, held_until FROM {h.pg_schema}.dispatch_fair_groups").fetchall()
    return {str(g): float(u) for g, u in rows}


def _claim_all(h: Harness, owner: str, n: int) -> list[Any]:
    out = []
    while len(out) < n:
        d = h.transport.get(owner, visibility_s=600.0, wait_s=0.0)
        assert d is not None
        out.append(d)
    return out


def test_a_short_claim_reads_no_more_rows_with_turns_in_flight(h: Harness) -> None:
    d = h.dispatcher()
    d.submit(Submission(kind="echo", tenant="a"))
    # A claim of two with one queued: it comes up short.
    alone = rows_read_by_a_claim(h.env["STATE_DB_URI"], "agent_dispatch_queue", 2)
    # 300 turns of the same tenant in flight (claimed, not finished), one more queued.
    d.submit_many([Submission(kind="echo", tenant="a") for _ in range(300)])
    _claim_all(h, "w:0", 301)
    d.submit(Submission(kind="echo", tenant="a"))
    busy = rows_read_by_a_claim(h.env["STATE_DB_URI"], "agent_dispatch_queue", 2)
    # Each held group used to cost a probe of its claimed head (300 here).
    assert busy <= alone + 10, (alone, busy)


def test_acked_head_puts_its_group_back_with_the_next_turn_ready(h: Harness) -> None:
    d = h.dispatcher()
    d.submit_many([Submission(kind="echo", tenant="a", session_id="s", payload=i) for i in range(2)])
    first = h.transport.get("w:0", visibility_s=600.0, wait_s=0.0)
    assert first is not None
    assert [u > 0 for u in _holds(h).values()] == [True]
    assert h.transport.get("w:0", visibility_s=600.0, wait_s=0.0) is None  # the session's next waits
    assert h.transport.ack(first)
    assert list(_holds(h).values()) == [0.0]
    second = h.transport.get("w:0", visibility_s=600.0, wait_s=0.0)
    assert second is not None
    assert Envelope.from_json(second.raw).job_id != Envelope.from_json(first.raw).job_id


def test_release_without_delay_puts_the_group_back_and_with_one_holds_it(h: Harness) -> None:
    h.dispatcher().submit(Submission(kind="echo", tenant="a"))
    dl = h.transport.get("w:0", visibility_s=600.0, wait_s=0.0)
    assert dl is not None
    h.transport.release(dl, 0.0)
    assert list(_holds(h).values()) == [0.0]
    again = h.transport.get("w:0", visibility_s=600.0, wait_s=0.0)
    assert again is not None and again.raw == dl.raw
    before = time.time()
    h.transport.release(again, 60.0)
    (held,) = _holds(h).values()
    assert before + 55 < held < time.time() + 65  # until the row is visible again
    assert h.transport.get("w:0", visibility_s=600.0, wait_s=0.0) is None


def test_a_lapsed_claim_is_claimable_again_as_soon_as_its_row_is(h: Harness) -> None:
    h.dispatcher().submit(Submission(kind="echo", job_id="j1", tenant="a"))
    first = h.transport.get("w1:0", visibility_s=0.3, wait_s=0.0)
    assert first is not None
    assert [u > 0 for u in _holds(h).values()] == [True]
    # Its worker is gone: no release, no ack. The next claim after the row's
    # visibility ran out finds it (the claim puts the lapsed hold back first).
    second = h.transport.get("w2:0", visibility_s=30.0, wait_s=5.0)
    assert second is not None and second.deliveries == 2
    assert Envelope.from_json(second.raw).job_id == "j1"


def test_reaping_a_workers_claims_puts_their_groups_back(h: Harness) -> None:
    h.dispatcher().submit_many([Submission(kind="echo", tenant="a") for _ in range(3)])
    _claim_all(h, "dead:0", 3)
    assert all(u > 0 for u in _holds(h).values())
    with h.store.transaction() as tx:
        tx.release_claims("dead:", time.time())
    assert set(_holds(h).values()) == {0.0}
    assert len(_claim_all(h, "w:0", 3)) == 3
