"""Enqueuers notify only while a claimer waits for news (scenario 18): each
notifying commit takes a database-wide lock. A claim that runs dry marks its
claimer waiting for a while; claims that keep running dry renew the mark, and
a busy claimer's lapses. Each test observes the channel with a
LISTEN of its own and ends what it reads with a notification of its own
(delivered in commit order), so "no notification" needs no timeout."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from agentdispatch.backends.postgres.transport import CHANNEL, PostgresTransport
from agentdispatch.dispatch import Submission
from agentdispatch.handlers import Registry
from agentdispatch.runtime.options import RuntimeOptions
from agentdispatch.transports.flow import Batch
from backends import Harness
from contract.helpers import wait_until
from contract.test_runtime import running

#: A channel of the test's own: its notification ends a read of the queue's
#: (one queue for all channels, in commit order), and no listener of the
#: transport hears it.
FENCE = "agent_dispatch_test_fence"


@pytest.fixture
def h(pg_own_db: Harness) -> Harness:
    """A database of its own: notifications reach every listener of a
    database, so tests beside it would add theirs."""
    return pg_own_db


@pytest.fixture
def channel(h: Harness) -> Iterator[Callable[[], list[str]]]:
    """What the queue's channel carried since the last call (payloads)."""
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    with (
        psycopg.connect(transport.db.uri, autocommit=True) as listen,
        psycopg.connect(transport.db.uri, autocommit=True) as fence,
    ):
        listen.execute(f"LISTEN {CHANNEL}")
        listen.execute(f"LISTEN {FENCE}")

        def heard() -> list[str]:
            fence.execute(f"NOTIFY {FENCE}")
            got: list[str] = []
            while not got or got[-1].channel != FENCE:
                got += listen.notifies(timeout=30.0, stop_after=1)
            return [n.payload for n in got[:-1]]

        yield heard


def _listening(transport: PostgresTransport) -> queue.Queue[int | None]:
    """Start the transport's listener; what it tells of, as it comes."""
    told: queue.Queue[int | None] = queue.Queue()
    transport.on_arrival(told.put)
    wait_until(lambda: transport._listener is not None and transport._listener.pid is not None, timeout=30)
    told.get(timeout=30)  # the news of its connecting
    return told


def _marks(transport: PostgresTransport) -> list[str]:
    rows = transport.db.read(lambda c: c.execute("SELECT owner FROM dispatch_waiting").fetchall())
    return [r["owner"] for r in rows]


def test_a_submission_notifies_only_while_a_claimer_waits(h: Harness, channel: Callable[[], list[str]]) -> None:
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    d = h.dispatcher()
    d.submit(Submission(kind="note", tenant="t"))
    d.submit_many([Submission(kind="note", tenant="t")] * 3)
    assert channel() == []  # nobody waits: no commit took the notification lock

    told = _listening(transport)
    assert len(transport.get_many("w:0", 4, visibility_s=30.0)) == 4
    assert transport.get_many("w:0", 1, visibility_s=30.0) == []  # dry: marked waiting
    d.submit(Submission(kind="note", tenant="t"))
    assert channel() == [""]
    assert told.get(timeout=30) == 1
    d.submit(Submission(kind="note", tenant="t"))
    assert channel() == [""]  # still marked: every submission wakes it
    assert _marks(transport) == ["w:0"]
    # Busy: its claims find all they ask for, and its mark lapses.
    assert len(transport.get_many("w:0", 2, visibility_s=30.0)) == 2
    transport.db.run(lambda c: c.execute("UPDATE dispatch_waiting SET until = now()"), single=True)
    d.submit(Submission(kind="note", tenant="t"))
    assert channel() == []
    assert transport.get_many("w:0", 4, visibility_s=30.0) != []
    assert transport.get_many("w:0", 1, visibility_s=30.0) == []  # dry: marked again
    d.submit(Submission(kind="note", tenant="t"))
    assert channel() == [""]


def test_a_statement_adding_several_rows_also_says_how_many(h: Harness, channel: Callable[[], list[str]]) -> None:
    """While a claimer waits, a submission of one turn notifies "" and one of
    several also notifies their number, after it (as many idle waiters wake)."""
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    d = h.dispatcher()
    d.submit_many([Submission(kind="note", tenant="t")] * 3)
    assert channel() == []
    _listening(transport)
    assert len(transport.get_many("w:0", 4, visibility_s=30.0)) == 3  # dry: marked waiting
    d.submit_many([Submission(kind="note", tenant="t")] * 3)
    assert channel() == ["", "3"]
    d.submit(Submission(kind="note", tenant="t"))
    assert channel() == [""]


def test_a_claim_that_finds_fewer_than_asked_marks_its_claimer(h: Harness, channel: Callable[[], list[str]]) -> None:
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    _listening(transport)
    d = h.dispatcher()
    d.submit(Submission(kind="note", tenant="t"))
    assert len(transport.get_many("w:0", 1, visibility_s=30.0)) == 1
    assert _marks(transport) == []  # found what it asked for: it claims again
    d.submit(Submission(kind="note", tenant="t"))
    assert len(transport.get_many("w:0", 2, visibility_s=30.0)) == 1  # ran dry: it waits next
    d.submit(Submission(kind="note", tenant="t"))
    assert channel() == [""]


def test_an_expired_mark_does_not_notify(h: Harness, channel: Callable[[], list[str]]) -> None:
    # A killed process's marks: nobody renews them, they expire.
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    transport.db.run(
        lambda c: c.execute("INSERT INTO dispatch_waiting VALUES ('gone:0', 0, now() - interval '1 second')"),
        single=True,
        idempotent=True,
    )
    h.dispatcher().submit(Submission(kind="note", tenant="t"))
    assert channel() == []


def test_without_listen_claims_mark_nobody(h: Harness, channel: Callable[[], list[str]]) -> None:
    # Behind a transaction-mode pooler nothing would hear a notification.
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    assert transport.get_many("w:0", 1, visibility_s=30.0) == []
    assert _marks(transport) == []
    h.dispatcher().submit(Submission(kind="note", tenant="t"))
    assert channel() == []


def test_a_claimer_marked_before_its_listener_was_lost_is_woken_after_it_reconnects(
    h: Harness, channel: Callable[[], list[str]]
) -> None:
    # Scenario 17: the listener's backend is killed. Its reconnect wakes every
    # claimer (news of unknown size); each claims and marks itself with the new
    # listener, whose notifications then wake it as before.
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    told = _listening(transport)
    assert transport.get_many("w:0", 1, visibility_s=30.0) == []
    listener = transport._listener
    assert listener is not None and listener.pid is not None
    lost = listener.pid
    transport.db.run(lambda c: c.execute("SELECT pg_terminate_backend(%s)", (lost,)), single=True, idempotent=True)
    assert told.get(timeout=30) is None  # reconnected: news of unknown size
    assert listener.pid not in (None, lost)
    assert transport.get_many("w:0", 1, visibility_s=30.0) == []
    h.dispatcher().submit(Submission(kind="note", tenant="t"))
    assert told.get(timeout=30) == 1
    assert channel() == [""]


def test_a_turn_that_came_unannounced_while_the_worker_was_woken_does_not_wait_for_the_poll(h: Harness) -> None:
    # A submission that commits while the woken claimer's mark has lapsed
    # (after a busy spell) notifies nobody. The claimer's next news then tells of fewer
    # turns than are queued: it claims one more than told, and claims again
    # while that one more came, instead of leaving a turn to the poll (the
    # poll's claim asks for a full batch: none may come before both started).
    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    transport.poll_s = transport.fallback_poll_s = 600.0
    events: list[str] = []
    reg = Registry()

    @reg.register("note")
    async def note(turn: Any, guard: Any) -> None:
        events.append(turn.job_id)

    def set_marks(until: str) -> None:
        transport.db.run(lambda c: c.execute(f"UPDATE dispatch_waiting SET until = {until}"), single=True)

    with running(h, reg, get_wait_s=600.0) as worker:
        real = worker._claim

        def claim(n: int) -> Batch:
            events.append(f"claim {n}")
            return real(n)

        worker._claim = claim  # type: ignore[method-assign]
        wait_until(lambda: len(_marks(transport)) == 1, timeout=30)  # idle, waiting for news
        d = h.dispatcher()
        set_marks("now() - interval '1 second'")  # as if it had lapsed
        unannounced = d.submit(Submission(kind="note", tenant="t")).job_id
        set_marks("now() + interval '1 hour'")
        announced = d.submit(Submission(kind="note", tenant="t")).job_id
        wait_until(lambda: announced in events and unannounced in events, timeout=60)
    before = events[: events.index(announced)]
    assert f"claim {RuntimeOptions().claim_batch}" not in before, events


def test_long_expired_marks_are_cleared_and_live_ones_kept(h: Harness) -> None:
    from agentdispatch.backends.postgres.transport import Q

    transport = h.transport
    assert isinstance(transport, PostgresTransport)
    marks = {"gone:0": "now() - interval '2 minutes'", "late:0": "now() - interval '1 second'"}
    for owner, until in marks.items():
        transport.db.run(
            lambda c, o=owner, u=until: c.execute(f"INSERT INTO dispatch_waiting VALUES ('{o}', 0, {u})"), single=True
        )
    assert transport.get_many("w:0", 1, visibility_s=30.0) == []
    transport.db.run(lambda c: c.execute(Q["forget_marks"]), single=True)
    assert sorted(_marks(transport)) == ["late:0"]  # w:0 has no listener here: not marked
