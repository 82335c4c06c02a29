"""Compare-and-admit on PostgreSQL under 16 concurrent submitting connections,
and the trigger-kept depth counter staying equal to the real count."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.postgres.transport import PostgresTransport
from agentdispatch.dispatch import Dispatcher, Submission
from agentdispatch.errors import QueueFull
from agentdispatch.settings import load_settings
from agentdispatch.stores.base import NewJob
from pg import admin, create_schema

ACTIVE = "status IN ('submitted', 'ready', 'leased', 'running')"


@pytest.fixture
def schema() -> Iterator[tuple[str, str]]:
    name, uri, drop = create_schema()
    try:
        store = PostgresStore(uri)
        store.migrate()
        store.close()
        yield name, uri
    finally:
        drop()


@pytest.mark.parametrize(
    ("bound", "per_writer"),
    [
        (150, 20),  # always near the bound: every submission takes every admission token
        (600, 40),  # far from it first (one token each, no global lock), then near it
    ],
)
def test_depth_bound_holds_under_16_concurrent_connections(
    schema: tuple[str, str], bound: int, per_writer: int
) -> None:
    name, uri = schema
    writers = 16
    settings = load_settings(STATE_DB_URI=uri, AGENT_DISPATCH_MAX_DEPTH=bound)
    stores = [PostgresStore(uri, pool_size=2) for _ in range(writers)]
    accepted: list[str] = []
    rejected: list[str] = []
    peak = [0]
    lock = threading.Lock()
    start = threading.Barrier(writers + 1)
    done = threading.Event()

    def submit(store: PostgresStore, k: int) -> None:
        d = Dispatcher(store, PostgresTransport(store, listen=False), settings)
        start.wait()
        for i in range(per_writer):
            # Single items and small batches, so batches straddle the bound too.
            subs = [Submission(kind="echo", tenant=f"t{k % 4}") for _ in range(1 + i % 3)]
            try:
                handles = d.submit_many(subs)
            except QueueFull as exc:
                assert "AGENT_DISPATCH_MAX_DEPTH" in str(exc)
                with lock:
                    rejected.extend(["x"] * len(subs))
            else:
                with lock:
                    accepted.extend(h.job_id for h in handles)

    def watch() -> None:
        with admin() as conn:
            while not done.is_set():
                row = conn.execute(f"SELECT count(*) FROM {name}.work_items WHERE {ACTIVE}").fetchone()
                assert row is not None
                peak[0] = max(peak[0], int(row[0]))

    threads = [threading.Thread(target=submit, args=(s, k)) for k, s in enumerate(stores)]
    watcher = threading.Thread(target=watch)
    for t in threads:
        t.start()
    watcher.start()
    start.wait()
    for t in threads:
        t.join(60)
    done.set()
    watcher.join(10)
    for s in stores:
        s.close()
    with admin() as conn:
        active = conn.execute(f"SELECT count(*) FROM {name}.work_items WHERE {ACTIVE}").fetchone()
        queued = conn.execute(f"SELECT count(*) FROM {name}.agent_dispatch_queue").fetchone()
        counter = conn.execute(f"SELECT sum(n) FROM {name}.dispatch_depth").fetchone()
    attempted = sum(1 + i % 3 for i in range(per_writer)) * writers
    print(
        f"\nadmission: bound={bound} attempted={attempted} accepted={len(accepted)} "
        f"rejected={len(rejected)} peak={peak[0]}"
    )
    assert len(set(accepted)) == len(accepted)
    assert len(accepted) + len(rejected) == attempted
    assert peak[0] <= bound
    assert active is not None and active[0] == len(accepted) <= bound
    # The bound was reached: no batch that would fit was refused.
    assert bound - 2 <= len(accepted)
    assert queued == active
    assert counter == active


def test_depth_counter_follows_every_transition(schema: tuple[str, str]) -> None:
    from agentdispatch.workitem import Outcome

    name, uri = schema
    store = PostgresStore(uri)
    transport = PostgresTransport(store, listen=False)
    try:
        d = Dispatcher(store, transport, load_settings(STATE_DB_URI=uri, AGENT_DISPATCH_MAX_DEPTH=1000))
        parent = d.submit(Submission(kind="echo", tenant="a"))
        child = d.submit(Submission(kind="echo", tenant="a", dependencies=(parent.job_id,)))
        others = d.submit_many([Submission(kind="echo", tenant="b") for _ in range(5)])
        d.cancel(others[0].job_id, "b")
        claim = store.claim(parent.job_id, "a", owner="w:0", ttl_s=30)
        assert claim.lease is not None
        store.commit(claim.lease, Outcome(ok=False, error="boom", retryable=False))  # cancels the child
        for h in others[1:3]:
            c = store.claim(h.job_id, "b", owner="w:0", ttl_s=30)
            assert c.lease is not None
            store.commit(c.lease, Outcome(ok=False, error="x", dead_letter_reason="manual"))
        d.replay(others[1].job_id, "b")
        assert store.get(child.job_id, "a").status.value == "cancelled"
    finally:
        transport.close()
        store.close()
    with admin() as conn:
        active = conn.execute(f"SELECT count(*) FROM {name}.work_items WHERE {ACTIVE}").fetchone()
        counter = conn.execute(f"SELECT sum(n) FROM {name}.dispatch_depth").fetchone()
    assert active == (3,)  # two never claimed + one replayed
    assert counter == active


@pytest.mark.parametrize("bound", [20, 100])  # near the bound throughout; far from it first
def test_intake_backlog_bound_holds_under_16_concurrent_connections(schema: tuple[str, str], bound: int) -> None:
    name, _uri = schema
    writers, per_writer = 16, 12
    admitted: list[int] = []
    refused = [0]
    lock = threading.Lock()
    start = threading.Barrier(writers)

    def intake(k: int) -> None:
        with admin() as conn:
            conn.execute(f"SET search_path = {name}")
            start.wait()
            for i in range(per_writer):
                try:
                    added = attempt(conn, k, i)
                except psycopg.errors.SerializationFailure:
                    added = attempt(conn, k, i)  # the rare retry (intake answers 503; the provider retries)
                with lock:
                    if added:
                        admitted.append(k)
                    else:
                        refused[0] += 1

    def attempt(conn: psycopg.Connection[tuple[object, ...]], k: int, i: int) -> bool:
        with conn.transaction():
            row = conn.execute("SELECT dispatch_intake_backlog('helper', %s, %s)", (bound, f"i-{k}-{i}")).fetchone()
            assert row is not None
            if int(row[0]) >= bound:
                return False
            conn.execute(
                "INSERT INTO work_items (id, tenant, session_id, session_ref, kind, agent_name, payload,"
                " status, max_attempts, created_at, ready_at, updated_at)"
                " VALUES (%s, 'acme', %s, %s, 'intake_turn', 'helper', '{}', 'ready', 5, 0, 0, 0)",
                (f"i-{k}-{i}", f"s{k}", f"r{k}"),
            )
            return True

    threads = [threading.Thread(target=intake, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with admin() as conn:
        row = conn.execute(f"SELECT count(*) FROM {name}.work_items WHERE agent_name = 'helper'").fetchone()
    assert row is not None
    assert len(admitted) + refused[0] == writers * per_writer
    assert int(row[0]) == len(admitted) == bound  # never above it, and filled to it


def _job(job_id: str) -> NewJob:
    return NewJob(job_id=job_id, tenant="default", session_id=job_id, kind="echo", payload=None, max_attempts=3)


def test_one_statement_submit_keeps_database_time_order_and_idempotency(
    schema: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual submission is one statement planned in the client: its times
    still come from the database clock (a client an hour ahead changes
    nothing), sequence numbers follow submission order, a repeated id in the
    batch answers with the first, and a known id takes the general path and
    answers with the stored item, writing nothing."""
    import json
    import time

    from agentdispatch.backends.postgres import store as pg_store

    name, uri = schema
    store = PostgresStore(uri)
    d = Dispatcher(store, PostgresTransport(store, listen=False), load_settings(STATE_DB_URI=uri))
    real = time.time
    monkeypatch.setattr(pg_store.time, "time", lambda: real() + 3600.0)
    try:
        jobs = [_job(f"j{i}") for i in range(3)] + [_job("j1")]
        accepted = store.submit(jobs, max_depth=100)
        assert [a.created for a in accepted] == [True, True, True, False]
        assert accepted[3].item is accepted[1].item
        with admin() as conn:
            db_now = float(conn.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0])
            rows = conn.execute(
                f"SELECT w.id, w.seq, w.created_at, w.ready_at, q.item_seq, q.enqueued_at, q.visible_at, q.envelope "
                f"FROM {name}.work_items w JOIN {name}.agent_dispatch_queue q ON q.job_id = w.id ORDER BY w.seq"
            ).fetchall()
            events = conn.execute(f"SELECT job_id, at FROM {name}.work_events ORDER BY id").fetchall()
        assert [r[0] for r in rows] == ["j0", "j1", "j2"]
        for (_job_id, seq, created, ready, item_seq, enqueued, visible, envelope), a in zip(
            rows, accepted, strict=False
        ):
            assert abs(created - db_now) < 30, "times come from the database clock"
            assert (a.item.seq, a.item.created_at, a.item.ready_at) == (seq, created, ready)
            assert item_seq == seq and enqueued == created and visible == created
            assert json.loads(envelope)["enqueued_at"] == enqueued
        assert [e[0] for e in events] == ["j0", "j1", "j2"] and all(abs(e[1] - db_now) < 30 for e in events)

        again = d.submit(Submission(kind="echo", job_id="j1", tenant="default"))
        assert again.job_id == "j1"
        again_many = store.submit([_job("j2"), _job("j9")], max_depth=100)
        assert [a.created for a in again_many] == [False, True]
        assert again_many[0].item.seq == rows[2][1]
        with admin() as conn:
            counts = conn.execute(
                f"SELECT (SELECT count(*) FROM {name}.work_items), (SELECT count(*) FROM {name}.agent_dispatch_queue)"
            ).fetchone()
        assert counts == (4, 4)
        with pytest.raises(QueueFull, match="4 active turns"):
            store.submit([_job("j10")], max_depth=4)
    finally:
        store.close()
