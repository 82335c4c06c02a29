"""Round trips per dispatch step on PostgreSQL, against the real server.

Light-load dispatch latency is a sum of round trips and the server work each
carries: these tests pin how many a step takes, so a change that adds one
shows up here instead of as a slower benchmark. A round trip is one
statement message sent and answered (``Cursor.execute``; what rides with it,
a BEGIN or deferred writes, travels in the same message)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from agentdispatch import Status, Submission
from agentdispatch.factory import open_flow
from agentdispatch.stores.base import LedgerOp
from agentdispatch.transports.flow import Finished, Flow, TurnEnd
from agentdispatch.workitem import Outcome
from backends import Harness


class RoundTrips:
    """Statement messages this process sends while :meth:`counting`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n: int | None = None
        real = psycopg.Cursor.execute

        def counted(cur: psycopg.Cursor[object], *a: object, **kw: object) -> psycopg.Cursor[object]:
            if self.n is not None:
                self.n += 1
            return real(cur, *a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(psycopg.Cursor, "execute", counted)
        monkeypatch.setattr(psycopg.Cursor, "executemany", _refused)

    @contextmanager
    def counting(self) -> Iterator[list[int]]:
        """Count inside the block; the count is the list's only member after it."""
        out: list[int] = []
        self.n = 0
        try:
            yield out
        finally:
            out.append(self.n)
            self.n = None


def _refused(*_a: object, **_kw: object) -> None:
    # Pipelined statements would escape the count: none is expected on these paths.
    raise AssertionError("executemany on a dispatch step: the round trip count would miss it")


@pytest.fixture
def trips(pg: Harness, monkeypatch: pytest.MonkeyPatch) -> RoundTrips:
    pg.store._key()  # type: ignore[attr-defined]  # the store's key, read once per process
    return RoundTrips(monkeypatch)


def _submit(h: Harness, trips: RoundTrips, payload: int) -> tuple[str, int]:
    with trips.counting() as n:
        handle = h.dispatcher().submit(Submission(kind="note", tenant=f"t{payload}", payload=payload))
    return handle.job_id, n[0]


def _flow(h: Harness) -> Flow:
    flow = open_flow(h.store, h.transport)
    assert flow is not None
    return flow


def test_a_submission_is_one_round_trip(pg: Harness, trips: RoundTrips) -> None:
    job_id, n = _submit(pg, trips, 1)
    assert n == 1
    assert pg.store.get(job_id, None).status is Status.READY


def test_a_claim_is_two_round_trips_and_a_finish_two(pg: Harness, trips: RoundTrips) -> None:
    """The claim: its get (with the BEGIN) and its write (with the COMMIT).
    The finish: the read of the item (with the BEGIN) and the write, the
    acknowledgement and the COMMIT in one message."""
    job_id, _ = _submit(pg, trips, 1)
    flow = _flow(pg)
    with trips.counting() as n:
        (c,) = flow.claim("w:0", 1, ttl_s=30.0).claimed
    assert n == [2]
    assert c.claim.lease is not None
    with trips.counting() as n:
        ends, _ = flow.finish([Finished(c.delivery, c.claim.lease, Outcome(ok=True, result=1))])
    assert n == [2]
    assert ends == [TurnEnd.COMPLETED]
    assert pg.store.get(job_id, None).status is Status.SUCCEEDED
    assert pg.transport.depth() == 0  # the acknowledgement was made


def test_a_finish_that_claims_the_next_turn_is_three_round_trips(pg: Harness, trips: RoundTrips) -> None:
    first, _ = _submit(pg, trips, 1)
    flow = _flow(pg)
    (c,) = flow.claim("w:0", 1, ttl_s=30.0).claimed
    assert c.claim.lease is not None
    second, _ = _submit(pg, trips, 2)
    with trips.counting() as n:
        ends, rode = flow.finish(
            [Finished(c.delivery, c.claim.lease, Outcome(ok=True, result=1))], then=1, owner="w:0", ttl_s=30.0
        )
    assert n == [3]
    assert ends == [TurnEnd.COMPLETED]
    assert [x.envelope.job_id for x in rode.claimed] == [second]
    assert pg.store.get(first, None).status is Status.SUCCEEDED
    assert pg.store.get(second, None).status is Status.RUNNING
    # The first turn's queue row is gone, the second's is held.
    with psycopg.connect(pg.transport.db.uri, autocommit=True) as conn:  # type: ignore[attr-defined]
        rows = conn.execute("SELECT job_id FROM agent_dispatch_queue").fetchall()
    assert rows == [(second,)]


def test_a_batch_finish_acknowledges_every_turn(pg: Harness, trips: RoundTrips) -> None:
    """A batch's acknowledgements are one statement (binary arrays, not bound
    in the client); each is still fenced by its receipt, and a fenced turn's
    delivery is given back."""
    ids = [_submit(pg, trips, i)[0] for i in range(3)]
    flow = _flow(pg)
    claimed = flow.claim("w:0", 3, ttl_s=30.0).claimed
    assert len(claimed) == 3
    pg.dispatcher().cancel(claimed[1].envelope.job_id, None)  # fences its lease
    done = [Finished(c.delivery, c.claim.lease, Outcome(ok=True, result=1)) for c in claimed]  # type: ignore[arg-type]
    with trips.counting() as n:
        ends, _ = flow.finish(done)
    # The reads; the writes with the fenced one's release; the acknowledgements; the COMMIT.
    assert n == [4]
    assert ends == [TurnEnd.COMPLETED, TurnEnd.FENCED, TurnEnd.COMPLETED]
    assert sorted(pg.store.get(i, None).status.value for i in ids) == ["cancelled", "succeeded", "succeeded"]
    with psycopg.connect(pg.transport.db.uri, autocommit=True) as conn:  # type: ignore[attr-defined]
        left = conn.execute("SELECT job_id, claimed_by FROM agent_dispatch_queue").fetchall()
    assert left == [(claimed[1].envelope.job_id, None)]  # given back, not acknowledged


def test_a_ledger_batch_is_two_round_trips(pg: Harness, trips: RoundTrips) -> None:
    """The items and their ledger rows read and locked (with the BEGIN), then
    the lease renewals and the ledger writes with the COMMIT: for begins and
    settlements of several turns alike."""
    ids = [_submit(pg, trips, i)[0] for i in range(3)]
    leases = [pg.store.claim(i, f"t{n}", owner="w:0", ttl_s=30.0).lease for n, i in enumerate(ids)]
    assert all(lease is not None for lease in leases)
    begins = [LedgerOp(lease, f"send-{n}", ttl_s=30.0) for n, lease in enumerate(leases)]  # type: ignore[arg-type]
    with trips.counting() as n:
        assert pg.store.ledger_many(begins) == [None, None, None]
    assert n == [2]
    settle = [LedgerOp(op.lease, op.key, "committed", {"n": i}) for i, op in enumerate(begins)]
    with trips.counting() as n:
        assert pg.store.ledger_many([*settle[:2], LedgerOp(leases[2], "next-2", ttl_s=30.0)]) == [True, True, None]
    assert n == [2]
    effects = {e["key"]: e["state"] for i in ids for e in pg.store.history(i, None)["side_effects"]}
    assert effects == {"send-0": "committed", "send-1": "committed", "send-2": "intended", "next-2": "intended"}
