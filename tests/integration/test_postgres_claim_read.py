"""The get that delivers an item inside a claim transaction also reads the
item (one round trip fewer per claim), and the claim of the same transaction
uses that read; a claim made apart from its get reads the item itself."""

from __future__ import annotations

import psycopg
import pytest

from agentdispatch.backends.postgres.tx import PostgresTx
from agentdispatch.dispatch import Submission
from agentdispatch.envelope import Envelope
from agentdispatch.factory import open_flow
from agentdispatch.stores.base import ClaimKind
from agentdispatch.transports.flow import TurnEnd
from backends import Harness


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


def test_a_claim_uses_the_read_of_the_get_that_delivered_it(h: Harness, reads: list[str]) -> None:
    handle = h.dispatcher().submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    batch = open_flow(h.store, h.transport).claim("w:0", 1, ttl_s=30.0)
    (c,) = batch.claimed
    assert c.claim.kind is ClaimKind.CLAIMED and c.claim.lease is not None
    assert reads == []  # no second read
    assert h.store.get(handle.job_id, None).status.value == "running"
    assert h.store.get(handle.job_id, None).lease_epoch == c.claim.lease.epoch


def test_the_read_of_the_get_sees_the_session_blocker(h: Harness, reads: list[str]) -> None:
    d = h.dispatcher()
    first = d.submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    second = d.submit(Submission(kind="note", tenant="t1", session_id="s", payload=2))
    got = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
    assert got is not None and Envelope.from_json(got.raw).job_id == first.job_id
    assert h.store.claim(first.job_id, "t1", owner="w:0", ttl_s=30.0).kind is ClaimKind.CLAIMED
    assert h.transport.ack(got)
    # The second turn's queue row is the session head now, but the first runs.
    batch = open_flow(h.store, h.transport).claim("w:1", 1, ttl_s=30.0)
    assert batch.got == 1 and batch.claimed == [] and batch.ends == [TurnEnd.BUSY]
    assert h.store.get(second.job_id, None).status.value == "ready"
    assert second.job_id not in reads


def test_a_claim_apart_from_its_get_reads_the_item_itself(h: Harness, reads: list[str]) -> None:
    handle = h.dispatcher().submit(Submission(kind="note", tenant="t1", session_id="s", payload=1))
    d = h.transport.get("w:0", visibility_s=30.0, wait_s=0.0)
    assert d is not None
    claim = h.store.claim(handle.job_id, "t1", owner="w:0", ttl_s=30.0)
    assert claim.kind is ClaimKind.CLAIMED
    assert reads == [handle.job_id]  # autocommit: its locks are gone, read again


def test_a_notification_says_how_many_rows_came(pg_own_db: Harness) -> None:
    """Idle workers wake one waiter per row: a single submission notifies with
    no count (one waiter), a batch also with its size (that many waiters)."""
    h = pg_own_db
    import psycopg

    from agentdispatch.backends.postgres.transport import CHANNEL, PostgresTransport

    assert isinstance(h.transport, PostgresTransport)
    with psycopg.connect(h.transport.db.uri, autocommit=True) as listen:
        listen.execute(f"LISTEN {CHANNEL}")
        # A claimer waits.
        listen.execute("INSERT INTO dispatch_waiting VALUES ('w:0', pg_backend_pid(), now() + interval '1 hour')")
        d = h.dispatcher()
        d.submit(Submission(kind="note", tenant="t1", payload=1))
        d.submit_many([Submission(kind="note", tenant=f"t{i}", payload=i) for i in range(5)])
        got = [n.payload for n in listen.notifies(timeout=2.0, stop_after=3)]
    assert got == ["", "", "5"]


def test_both_workers_hand_the_read_of_the_get_to_the_claim(h: Harness, reads: list[str]) -> None:
    """The runtime's batch claim and the thread worker's claim both go
    through the flow: no claim reads its item again."""
    from agentdispatch.handlers import Registry
    from agentdispatch.runtime.worker import AsyncWorker

    d = h.dispatcher()
    jobs = [d.submit(Submission(kind="note", tenant=f"t{i}", payload=i)).job_id for i in range(3)]
    claimed = AsyncWorker(h.settings, h.store, h.transport, Registry())._claim(2).claimed
    claimed += h.worker(Registry()).flow.claim("w:1", 1, ttl_s=30.0).claimed
    assert sorted(c.claim.item.id for c in claimed if c.claim.item is not None) == sorted(jobs)
    assert reads == []


def test_a_batch_claim_reads_its_items_in_id_order_and_a_repeat_again(h: Harness, reads: list[str]) -> None:
    """Read in delivery order (a Kafka batch), claims of the same items in
    other orders deadlocked one another; every batch locks rows in id order."""
    d = h.dispatcher()
    ids = [f"job-{c}" for c in "dcab"]
    d.submit_many([Submission(kind="note", tenant="t1", job_id=j, payload=j) for j in ids])
    jobs = [(j, "t1") for j in ids] + [("job-c", "t1")]  # a repeated delivery of one item
    claims = h.store.claim_many(jobs, owner="w:0", ttl_s=30.0)
    assert reads == ["job-a", "job-b", "job-c", "job-d"]
    assert [c.kind for c in claims] == [ClaimKind.CLAIMED] * 4 + [ClaimKind.BUSY]
    assert [c.item.id for c in claims if c.item is not None] == [j for j, _ in jobs]  # in the order asked


def test_a_claim_does_not_wait_for_a_session_lock_another_claim_holds(h: Harness) -> None:
    """Another transaction claiming a turn of the session holds its lock: the
    read answers at once that the session is busy instead of waiting for it."""
    d = h.dispatcher()
    d.submit_many([Submission(kind="note", tenant="t1", session_id="s", job_id=f"j{i}") for i in range(2)])
    uri = h.env["STATE_DB_URI"]
    with psycopg.connect(uri) as holder, psycopg.connect(uri, autocommit=True) as other:
        holder.execute("SELECT * FROM dispatch_item_read('j0', true)").fetchone()  # its transaction stays open
        other.execute("SET statement_timeout = '3s'")  # waiting for the lock would fail the read
        row = other.execute("SELECT blocker_status, item FROM dispatch_item_read('j1', true)").fetchone()
        holder.rollback()
    assert row is not None and row[0] == "leased" and row[1] is not None
