"""The PostgreSQL schema has the expected tables, indexes, triggers and plans;
failures never echo the connection URI (the runner's steps: test_schema_steps)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.postgres.transport import PostgresTransport
from agentdispatch.errors import DepthUnavailable, TaskQueueUnavailable
from agentdispatch.stores import schema as schema_steps
from pg import admin, create_schema

EXPECTED: dict[str, list[str]] = {
    "dispatch_meta": ["key", "value"],
    "work_items": [
        "seq", "id", "tenant", "session_id", "session_ref", "kind", "agent_name", "payload", "priority",
        "status", "reason", "attempts", "max_attempts", "dependencies", "deadline_unix", "created_at",
        "ready_at", "updated_at", "completed_at", "lease_owner", "lease_epoch", "lease_token",
        "lease_expires_at", "result", "error", "run_id",
        # The intake design's operator queries run as written.
        "agent_id", "intake_attempts", "turn_attempts",
        # A turn's checkpoint.
        "checkpoint",
        # A submission's own execution timeout.
        "timeout_s",
    ],
    "dispatch_depth": ["slot", "n"],
    "work_dependencies": ["depends_on", "job_id"],
    "work_events": ["id", "job_id", "at", "event", "status", "attempt", "epoch", "detail"],
    "side_effects": ["tenant", "key", "job_id", "state", "epoch", "result", "created_at", "updated_at"],
    "poison_envelopes": ["digest", "raw", "reason", "created_at"],
    "dispatch_workers": [
        "worker_id", "host", "capacity", "active_sessions", "queue_backend", "started_at", "last_heartbeat",
        "process", "counters",
    ],
    "dispatch_fleet_counters": ["name", "value"],
    "agent_dispatch_queue": [
        "id", "job_id", "item_seq", "session_ref", "tenant_ref", "group_ref", "priority", "deadline_unix",
        "envelope", "enqueued_at", "visible_at", "claimed_by", "claimed_at", "deliveries",
    ],
    "dispatch_fair_tenants": ["priority", "tenant_ref", "since", "last_served", "held"],
    "dispatch_fair_wakes": ["id", "priority", "tenant_ref"],
    "dispatch_fair_groups": [
        "priority", "group_ref", "tenant_ref", "deadline_key", "since", "last_served", "held_until",
    ],
    "dispatch_waiting": ["owner", "listener", "until"],
    "api_tokens": ["token_id", "token_hash", "tenant", "label", "created_at", "revoked_at"],
}  # fmt: skip


LATEST = schema_steps.latest("agentdispatch.backends.postgres.sql")


@pytest.fixture
def schema() -> Iterator[tuple[str, str]]:
    name, uri, drop = create_schema()
    try:
        yield name, uri
    finally:
        drop()


def _columns(schema: str) -> dict[str, list[str]]:
    with admin() as conn:
        rows = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = %s ORDER BY table_name, ordinal_position",
            (schema,),
        ).fetchall()
    out: dict[str, list[str]] = {}
    for table, column in rows:
        out.setdefault(str(table), []).append(str(column))
    return out


def test_migrate_produces_the_expected_schema(schema: tuple[str, str]) -> None:
    name, uri = schema
    store = PostgresStore(uri)
    try:
        assert store.schema_version() == 0
        store.migrate()
        store.migrate()  # idempotent
        assert store.schema_version() == LATEST
        store.ping()
    finally:
        store.close()
    found = _columns(name)
    # Exactly these columns in these tables (other features have tables of
    # their own).
    assert {t: found.get(t) for t in EXPECTED} == EXPECTED
    with admin() as conn:
        indexes = {
            r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = %s", (name,)).fetchall()
        }
        triggers = {
            r[0]
            for r in conn.execute(
                "SELECT DISTINCT trigger_name FROM information_schema.triggers WHERE trigger_schema = %s", (name,)
            ).fetchall()
        }
        slots = conn.execute(f"SELECT count(*) FROM {name}.dispatch_depth").fetchone()
        # The hot functions whose array or many-tenant statements the planner
        # would otherwise re-plan at every call keep their generic plans.
        generic = {
            r[0]
            for r in conn.execute(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = %s AND 'plan_cache_mode=force_generic_plan' = ANY(p.proconfig)",
                (name,),
            ).fetchall()
        }
    assert {"queue_group_head", "queue_session", "queue_deadline", "fair_tenants_order", "fair_groups_order"} <= indexes
    assert triggers == {
        "work_items_inserted",
        "work_items_status",
        "work_items_deleted",
        "queue_added",
        "queue_removed",
    }
    assert slots == (64,)
    assert generic == {
        "dispatch_claim_fair",
        "dispatch_fair_clear",
        "dispatch_fair_prune",
        "dispatch_fair_unhold",
        "dispatch_fair_wake",
        "dispatch_items_read",
        "dispatch_submit_read",
        "dispatch_submit_new",
    }


def test_work_items_answer_plain_sql(schema: tuple[str, str]) -> None:
    from agentdispatch.dispatch import Dispatcher, Submission
    from agentdispatch.settings import load_settings

    name, uri = schema
    store = PostgresStore(uri)
    store.migrate()
    transport = PostgresTransport(store, listen=False)
    try:
        d = Dispatcher(store, transport, load_settings(STATE_DB_URI=uri))
        handle = d.submit(Submission(kind="echo", payload={"text": "secret body"}, tenant="acme"))
        d.cancel(handle.job_id, "acme", reason="operator")
    finally:
        transport.close()
        store.close()
    with admin() as conn:
        row = conn.execute(
            f"SELECT status, reason, created_at, ready_at, attempts, run_id, completed_at "
            f"FROM {name}.work_items WHERE id = %s",
            (handle.job_id,),
        ).fetchone()
        refs = conn.execute(f"SELECT count(*) FROM {name}.dispatch_fair_tenants WHERE tenant_ref = 'acme'").fetchone()
    assert row is not None
    status, reason, created_at, ready_at, attempts, run_id, completed_at = row
    assert (status, reason, attempts, run_id) == ("cancelled", "operator", 0, None)
    assert completed_at >= ready_at >= created_at > 1e9
    assert refs == (0,)  # scheduling tables hold opaque refs, never tenant names


def test_unreachable_database_fails_loudly_without_echoing_the_uri() -> None:
    uri = "postgresql://someuser:hunter2secret@127.0.0.1:1/nodb"
    store = PostgresStore(uri, pool_timeout_s=0.5)
    transport = PostgresTransport(store, listen=False)
    try:
        for call in (store.ping, transport.ping, transport.depth):
            with pytest.raises(TaskQueueUnavailable) as info:
                call()
            text = str(info.value)
            assert "hunter2secret" not in text and "someuser" not in text and "127.0.0.1" not in text
        with pytest.raises(DepthUnavailable):
            transport.depth()
    finally:
        transport.close()
        store.close()
