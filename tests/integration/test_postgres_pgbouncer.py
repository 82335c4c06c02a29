"""Through a real PgBouncer in transaction mode: server-side prepared
statements get lost between transactions; the store notices, turns them off,
and no operation fails or is lost (the whole contract suite also runs there:
the ``pgbouncer`` backend of ``tests/contract``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from agentdispatch import Dispatcher, Submission, load_settings
from agentdispatch.stores.postgres import PostgresStore
from agentdispatch.transports.postgres import PostgresTransport
from backends import fresh_pg_database
from pgbouncer import bouncer

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _through_bouncer(cleanup: list[Callable[[], None]]) -> str:
    direct = fresh_pg_database(cleanup)
    PostgresStore(direct).migrate()
    return bouncer(BASE).uri(direct.rsplit("/", 1)[1])


def test_lost_prepared_statements_turn_them_off_and_lose_nothing() -> None:
    cleanup: list[Callable[[], None]] = []
    try:
        uri = _through_bouncer(cleanup)
        store = PostgresStore(uri, prepared=True, pool_size=8)
        transport = PostgresTransport(store)
        try:
            d = Dispatcher(store, transport, load_settings(STATE_DB_URI=uri))
            # Past psycopg's prepare threshold (5), on connections PgBouncer reshuffles.
            handles = [d.submit(Submission(kind="echo", tenant="t", payload=i)) for i in range(40)]
            views = [d.status(h.job_id, "t") for h in handles]
            assert [v["status"] for v in views] == ["ready"] * 40
            assert store.db.prepared is False, "PgBouncer never lost a prepared statement: the test proved nothing"
            assert store.counts("t") == {"ready": 40}
        finally:
            transport.close()
            store.close()
    finally:
        for fn in cleanup:
            fn()


def test_with_prepared_statements_off_nothing_is_prepared() -> None:
    cleanup: list[Callable[[], None]] = []
    try:
        uri = _through_bouncer(cleanup)
        store = PostgresStore(uri, prepared=False, pool_size=8)
        transport = PostgresTransport(store)
        try:
            d = Dispatcher(store, transport, load_settings(STATE_DB_URI=uri, AGENT_DISPATCH_PG_PREPARED_STATEMENTS="0"))
            for i in range(30):
                d.submit(Submission(kind="echo", tenant="t", payload=i))
            assert store.counts("t") == {"ready": 30}
            with store.db.pool.connection() as conn:
                assert conn.prepare_threshold is None
        finally:
            transport.close()
            store.close()
    finally:
        for fn in cleanup:
            fn()
