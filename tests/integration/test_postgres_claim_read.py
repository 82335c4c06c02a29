"""The get that delivers an item inside a claim transaction also reads the
item (one round trip fewer per claim) and carries it on the delivery; that
read serves only the claim it is handed to in the same transaction."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from agentdispatch.backends.postgres.tx import PostgresTx
from agentdispatch.dispatch import Submission
from agentdispatch.envelope import Envelope
from agentdispatch.stores.base import ClaimKind
from backends import Harness, fresh_pg_database, pg_harness_at


@pytest.fixture
def h(pg: Harness) -> Harness:
    return pg


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Job ids read by a separate ``item_read`` statement."""
    seen: list[str] = []
    real = PostgresTx.read_item

    def spy(self: PostgresTx, job_id: str, *, session: bool = False) -> None:
        seen.append(job_id)
        real(self, job_id, session=session)

    monkeypatch.setattr(PostgresTx, "read_item", spy)
    return seen


def test_claim_in_the_get_transaction_uses_the_read_of_the_get(h: Harness, reads: list[str]) -> None:
    handle = h.dispatcher().submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    with h.transport.atomic(durable=False):
        d = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
        assert d is not None
        env = Envelope.from_json(d.raw)
        claim = h.store.claim(env.job_id, env.tenant, owner="w:0", ttl_s=30.0, read=d.read)
    assert claim.kind is ClaimKind.CLAIMED and claim.lease is not None
    assert reads == []  # no second read
    assert h.store.get(handle.job_id, None).status.value == "running"
    assert h.store.get(handle.job_id, None).lease_epoch == claim.lease.epoch


def test_the_read_of_the_get_sees_the_session_blocker(h: Harness, reads: list[str]) -> None:
    d = h.dispatcher()
    first = d.submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    second = d.submit(Submission(kind="note", tenant="t1", session_id="s", payload=2))
    got = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
    assert got is not None and Envelope.from_json(got.raw).job_id == first.job_id
    assert h.store.claim(first.job_id, "t1", owner="w:0", ttl_s=30.0).kind is ClaimKind.CLAIMED
    assert h.transport.ack(got)
    # The second turn's queue row is the session head now, but the first runs.
    with h.transport.atomic(durable=False):
        nxt = h.transport.get("w:1", visibility_s=30.0, wait_s=0.0)
        assert nxt is not None and Envelope.from_json(nxt.raw).job_id == second.job_id
        claim = h.store.claim(second.job_id, "t1", owner="w:1", ttl_s=30.0, read=nxt.read)
    assert claim.kind is ClaimKind.BUSY and claim.retry_after_s > 0
    assert second.job_id not in reads


def test_a_get_outside_a_transaction_leaves_no_read_behind(h: Harness, reads: list[str]) -> None:
    handle = h.dispatcher().submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    d = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
    assert d is not None and d.read is None
    claim = h.store.claim(handle.job_id, "t1", owner="w:0", ttl_s=30.0, read=d.read)
    assert claim.kind is ClaimKind.CLAIMED
    assert reads == [handle.job_id]  # autocommit: its locks are gone, read again


def test_a_read_never_outlives_its_transaction(h: Harness, reads: list[str]) -> None:
    handle = h.dispatcher().submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    with h.transport.atomic(durable=False):
        d = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
        assert d is not None and d.read is not None
    h.store.cancel(handle.job_id, None)
    with h.transport.atomic(durable=False):
        claim = h.store.claim(handle.job_id, "t1", owner="w:0", ttl_s=30.0, read=d.read)
    # A stale read would have claimed the cancelled item.
    assert claim.kind is ClaimKind.SKIPPED
    assert reads == [handle.job_id]


def test_a_read_serves_only_its_own_item(h: Harness, reads: list[str]) -> None:
    d = h.dispatcher()
    first = d.submit(Submission(kind="note", tenant="t1", session_id="a", payload=1))
    other = d.submit(Submission(kind="note", tenant="t1", session_id="b", payload=2))
    with h.transport.atomic(durable=False):
        got = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
        assert got is not None and Envelope.from_json(got.raw).job_id == first.job_id
        claim = h.store.claim(other.job_id, "t1", owner="w:0", ttl_s=30.0, read=got.read)
    assert claim.kind is ClaimKind.CLAIMED
    assert reads == [other.job_id]
    assert h.store.get(first.job_id, None).status.value != "running"


@pytest.fixture
def own_db() -> Iterator[Harness]:
    """A harness on a database of its own: NOTIFY reaches every listener of a
    database, so on a schema of the shared one the count picked up what the
    tests running beside it submitted."""
    cleanup: list[Callable[[], None]] = []
    h = pg_harness_at(fresh_pg_database(cleanup), lambda: [fn() for fn in cleanup])
    try:
        yield h
    finally:
        h.close()


def test_a_notification_says_how_many_rows_came(own_db: Harness) -> None:
    """Idle workers wake one waiter per row: a single submission notifies with
    no count (one waiter), a batch also with its size (that many waiters)."""
    h = own_db
    import psycopg

    from agentdispatch.backends.postgres.transport import CHANNEL, PostgresTransport

    assert isinstance(h.transport, PostgresTransport)
    with psycopg.connect(h.transport.db.uri, autocommit=True) as listen:
        listen.execute(f"LISTEN {CHANNEL}")
        d = h.dispatcher()
        d.submit(Submission(kind="note", tenant="t1", payload=1))
        d.submit_many([Submission(kind="note", tenant=f"t{i}", payload=i) for i in range(5)])
        got = [n.payload for n in listen.notifies(timeout=2.0, stop_after=3)]
    assert got == ["", "", "5"]


def test_both_workers_hand_the_read_of_the_get_to_the_claim(h: Harness, reads: list[str]) -> None:
    """The runtime's batch claim and the thread worker's get-and-claim pass
    each delivery's read on: no claim reads its item again."""
    from agentdispatch.handlers import builtins
    from agentdispatch.metrics import Metrics
    from agentdispatch.runtime.traffic import Traffic

    d = h.dispatcher()
    jobs = [d.submit(Submission(kind="note", tenant=f"t{i}", payload=i)).job_id for i in range(3)]
    traffic = Traffic(h.store, h.transport, owner="w:0", ttl_s=30.0, metrics=Metrics(), count=lambda _: None)
    claimed, _ = traffic.claim(2)
    worker = h.worker(builtins())
    got = worker._get_and_claim("w:1")
    assert got is not None and not isinstance(got[1], str)
    lease = got[1][1].lease
    assert lease is not None
    held = sorted([c.claim.lease.job_id for c in claimed if c.claim.lease] + [lease.job_id])
    assert held == sorted(jobs)
    assert reads == []
