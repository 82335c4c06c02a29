"""Through a real PgBouncer in transaction mode: server-side prepared
statements get lost between transactions; the store notices, turns them off,
and no operation fails or is lost (the whole contract suite also runs there:
the ``pgbouncer`` backend of ``tests/contract``)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from agentdispatch import Dispatcher, Submission, load_settings
from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.postgres.transport import PostgresTransport
from backends import fresh_pg_database
from contract.helpers import wait_until
from pgbouncer import bouncer

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")

Open = Callable[[bool], tuple[PostgresStore, Dispatcher]]


def _open_servers(uri: str, n: int) -> None:
    """Make PgBouncer open ``n`` server connections to the database: ``n``
    clients each hold a transaction at once. With one server only, every
    transaction would find its prepared statements."""
    conns = [psycopg.connect(uri, autocommit=True) for _ in range(n)]
    try:
        for c in conns:
            c.execute("BEGIN")
            c.execute("SELECT 1")
        for c in conns:
            c.execute("COMMIT")
    finally:
        for c in conns:
            c.close()


@pytest.fixture
def through_bouncer() -> Iterator[Open]:
    """Opens a store (prepared statements on or off) on a fresh database
    reached through PgBouncer; everything is closed and dropped afterwards."""
    cleanup: list[Callable[[], None]] = []

    def open_(prepared: bool) -> tuple[PostgresStore, Dispatcher]:
        direct = fresh_pg_database(cleanup)
        PostgresStore(direct).migrate()
        uri = bouncer(BASE).uri(direct.rsplit("/", 1)[1])
        _open_servers(uri, 3)
        store = PostgresStore(uri, prepared=prepared, pool_size=8)
        transport = PostgresTransport(store)
        cleanup[:0] = [transport.close, store.close]
        return store, Dispatcher(store, transport, load_settings(STATE_DB_URI=uri))

    yield open_
    for fn in cleanup:
        fn()


def test_lost_prepared_statements_turn_them_off_and_lose_nothing(through_bouncer: Open) -> None:
    store, d = through_bouncer(True)
    # Past psycopg's prepare threshold (5), on connections PgBouncer reshuffles.
    handles = [d.submit(Submission(kind="echo", tenant="t", payload=i)) for i in range(40)]
    assert [d.status(h.job_id, "t")["status"] for h in handles] == ["ready"] * 40
    assert store.db.prepared is False, "PgBouncer never lost a prepared statement: the test proved nothing"
    assert store.counts("t") == {"ready": 40}


def test_with_prepared_statements_off_nothing_is_prepared(through_bouncer: Open) -> None:
    store, d = through_bouncer(False)
    for i in range(30):
        d.submit(Submission(kind="echo", tenant="t", payload=i))
    assert store.counts("t") == {"ready": 30}
    with store.db.pool.connection() as conn:
        assert conn.prepare_threshold is None


def test_behind_the_bouncer_the_listener_says_it_polls(caplog: pytest.LogCaptureFixture) -> None:
    # The LISTEN stays on the pooled server connection that ran it, so
    # pg_listening_channels() lists the channel there: that probe took
    # PgBouncer for a working listener, never warned, and polled slowly.
    # Directly on PostgreSQL the same listener must hear its own probe.
    cleanup: list[Callable[[], None]] = []
    direct = fresh_pg_database(cleanup)
    with contextlib.closing(PostgresStore(direct)) as schema:
        schema.migrate()
    pooled = bouncer(BASE).uri(direct.rsplit("/", 1)[1])
    stores = {uri: PostgresStore(uri, prepared=False, pool_size=2) for uri in (direct, pooled)}
    transports = {uri: PostgresTransport(store) for uri, store in stores.items()}
    cleanup[:0] = [t.close for t in transports.values()] + [s.close for s in stores.values()]
    try:
        with caplog.at_level(logging.WARNING, logger="agentdispatch.backends.postgres.transport"):
            for t in transports.values():
                t.wait(0)  # starts the listener
            listener = transports[direct]._listener
            assert listener is not None
            wait_until(lambda: listener.healthy, timeout=30)
            wait_until(lambda: "polling only" in caplog.text, timeout=30)
        assert caplog.text.count("polling only") == 1
        t = transports[pooled]
        assert t._listener is not None and not t._listener.healthy and t._listener.pid is None
        assert t.arrival_poll_s() == t.fallback_poll_s < transports[direct].arrival_poll_s()
    finally:
        for fn in cleanup:
            fn()
