"""A turn whose worker died (its lease expired) is claimed again at its place
in the fair order, not behind every session not yet served: its session's
served stamp came from a claim that served nothing (reliability scenarios 4
and 5: an orphan is re-leased within TTL plus a sweep, even under a backlog).
So does a suspect deferred because its process already runs enough of them
(scenario 9: else it, and the poison among them, ran after the backlog)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentdispatch.dispatch import Submission
from agentdispatch.envelope import Envelope
from agentdispatch.factory import open_flow
from agentdispatch.stores.base import ClaimKind
from agentdispatch.stores.engine import SUSPECT_WAIT_S
from agentdispatch.transports.flow import TurnEnd
from backends import Harness, postgres_harness, sqlite_harness
from contract.helpers import wait_until


@pytest.fixture(params=[sqlite_harness, postgres_harness], ids=["sqlite", "postgres"])
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    make: Callable[..., Harness] = request.param
    harness = make(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def test_an_orphan_is_claimed_before_the_sessions_never_served(h: Harness) -> None:
    d = h.dispatcher()
    first = d.submit(Submission(kind="echo", tenant="t", session_id="orphan"))
    delivery = h.transport.get("w:1", visibility_s=0.3, wait_s=0.0)
    assert delivery is not None and Envelope.from_json(delivery.raw).job_id == first.job_id
    claim = h.store.claim(first.job_id, "t", owner="w:1", ttl_s=0.3)
    assert claim.kind is ClaimKind.CLAIMED
    # A backlog arrives while the worker holding the first turn dies.
    backlog = {d.submit(Submission(kind="echo", tenant="t", session_id=f"s{i}")).job_id for i in range(20)}
    wait_until(lambda: h.store.sweep(redeliver_after_s=h.transport.redeliver_after_s).reclaimed >= 1)
    order = []
    while (got := h.transport.get("w:2", visibility_s=30.0, wait_s=0.0)) is not None:
        order.append(Envelope.from_json(got.raw).job_id)
        assert h.transport.ack(got)
    assert order[0] == first.job_id, order
    assert set(order[1:]) >= backlog


def _exhaust(h: Harness, job_id: str, times: int) -> None:
    """Claim ``job_id`` ``times`` times by processes that die at once."""
    for n in range(times):
        owner = f"gone-{job_id[-6:]}-{n}:0"
        wait_until(lambda o=owner: h.store.claim(job_id, "t", owner=o, ttl_s=0.05).kind is ClaimKind.CLAIMED)
    expires = h.store.get(job_id, "t").lease_expires_at
    assert expires is not None
    wait_until(lambda: time.time() > expires + 0.05)


def test_a_deferred_suspect_keeps_its_place(h: Harness) -> None:
    d = h.dispatcher()
    deferred, held = (d.submit(Submission(kind="echo", tenant="t", session_id=s)).job_id for s in ("a", "b"))
    for job in (held, deferred):
        _exhaust(h, job, 4)  # each on its last attempt: one a process
    assert h.store.claim(held, "t", owner="p1:0", ttl_s=30).kind is ClaimKind.CLAIMED
    backlog = {d.submit(Submission(kind="echo", tenant="t", session_id=f"s{i}")).job_id for i in range(20)}
    # p1 already runs one such suspect: the other is deferred, not served.
    batch = open_flow(h.store, h.transport).claim("p1:1", 1, ttl_s=30)
    assert batch.ends == [TurnEnd.BUSY] and not batch.claimed
    deferred_at = time.time()
    wait_until(lambda: time.time() > deferred_at + SUSPECT_WAIT_S + 0.05)
    order = []
    while (got := h.transport.get("p2:0", visibility_s=30.0, wait_s=0.0)) is not None:
        order.append(Envelope.from_json(got.raw).job_id)
        assert h.transport.ack(got)
    assert order[0] == deferred, order
    assert set(order[1:]) == backlog | {held}
