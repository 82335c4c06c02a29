"""Items by id on PostgreSQL: the functions that read or lock work_items by
id probe its id index once per id, with the generic plans PL/pgSQL keeps
(planning those statements again at every call cost more than running them)."""

from __future__ import annotations

import psycopg
import pytest

from agentdispatch.backends.postgres.db import explain_nested
from backends import Harness
from pg import admin


def _items(conn: psycopg.Connection[tuple[object, ...]], n: int) -> None:
    """``n`` finished items, analysed (a few hundred: the generic plans of
    "id = ANY(ids)" read all of them instead of probing the index)."""
    conn.execute(
        "INSERT INTO work_items (id, tenant, session_id, session_ref, kind, payload, status, max_attempts, "
        "created_at, ready_at, updated_at) "
        "SELECT 'w' || i, 't', 's' || i, 's' || i, 'echo', '{}', 'succeeded', 3, 0, 0, 0 "
        "FROM generate_series(1, %s) AS i",
        (n,),
    )
    conn.execute("ANALYZE work_items")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM dispatch_items_read(%(ids)s::text[])",
        "SELECT * FROM dispatch_submit_read(%(ids)s::text[], 1, NULL)",
    ],
)
def test_items_by_id_are_index_probes_in_generic_plans(pg: Harness, sql: str) -> None:
    with admin() as conn:
        conn.execute(f"SET search_path = {pg.pg_schema}")
        _items(conn, 300)
        conn.execute("SET plan_cache_mode = force_generic_plan")
        plan = explain_nested(conn, sql, {"ids": ["w7", "w9", "nope"]})
    assert "work_items_id_key" in plan, plan
    assert "Seq Scan on work_items" not in plan, plan


def test_items_read_locks_each_item_once_and_skips_unknown_ids(pg: Harness) -> None:
    with admin() as conn:
        conn.execute(f"SET search_path = {pg.pg_schema}")
        _items(conn, 10)
        with conn.transaction(force_rollback=True):
            rows = conn.execute("SELECT item FROM dispatch_items_read(ARRAY['w3', 'w1', 'w3', 'nope'])").fetchall()
            ids = sorted(r[0]["id"] for r in rows)  # type: ignore[index]
            locked = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND pid = pg_backend_pid()"
            ).fetchone()
            got = conn.execute("SELECT items FROM dispatch_submit_read(ARRAY['w2', 'w2', 'nope'], 1, NULL)").fetchone()
    assert ids == ["w1", "w3"]
    assert locked is not None and locked[0] == 1  # rows were locked: the transaction has an id
    assert got is not None and [i["id"] for i in got[0]] == ["w2"]  # type: ignore[index,union-attr]
