"""Reliability scenario 15: a transaction left open on PostgreSQL keeps vacuum
from cleaning the queue. It shows in the fleet gauge, a worker warns of it,
the worker itself never keeps a transaction open across a model call, and
once it ended a worker gives the small hot tables back their size."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from agentdispatch import Registry, Status, Submission
from agentdispatch.backends.postgres import compact
from agentdispatch.horizon import CHECK_EVERY_S, COMPACT_EVERY_S, HorizonWatch
from agentdispatch.metrics import FleetCollector
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from backends import Harness
from contract.helpers import wait_until

GAUGE = "agent_utilities_dispatch_oldest_xmin_age_seconds"


@pytest.fixture
def pg(pg_own_db: Harness) -> Harness:
    """A database of its own: the horizon is the whole database's, and other
    tests' sessions share the default one."""
    return pg_own_db


def _gauge(pg) -> float:
    collector = FleetCollector(lambda: (pg.store, pg.transport))
    values = {s.name: s.value for f in collector.collect() for s in f.samples}
    return values[GAUGE]


@contextmanager
def repeatable_read(uri: str) -> Iterator[int]:
    """A REPEATABLE READ transaction holding its snapshot: its backend's pid."""
    with psycopg.connect(uri) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        yield int(row[0])
        conn.rollback()


def _age_of(pg, pid: int) -> float:
    with psycopg.connect(pg.settings.state_db_uri) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8 FROM pg_stat_activity WHERE pid = %s",
            (pid,),
        ).fetchone()
    assert row is not None
    return float(row[0])


def test_the_gauge_shows_how_long_a_transaction_has_held_the_horizon(pg) -> None:
    assert _gauge(pg) == 0.0
    with repeatable_read(pg.settings.state_db_uri) as pid:
        before = _age_of(pg, pid)
        held = _gauge(pg)
        after = _age_of(pg, pid)
        assert before <= held <= after
        snapshot = pg.store.oldest_snapshot()
        assert snapshot is not None and snapshot.pid == pid and snapshot.state == "idle in transaction"
    assert pg.store.oldest_snapshot() is None
    assert _gauge(pg) == 0.0


def test_a_worker_warns_once_while_it_lasts_and_says_when_it_ended(pg, caplog) -> None:
    now = [0.0]
    watch = HorizonWatch(pg.store, alert_s=0.001, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="agentdispatch.horizon")
    with repeatable_read(pg.settings.state_db_uri) as pid:
        wait_until(lambda: _age_of(pg, pid) > 0.001)
        watch.check()
        now[0] += CHECK_EVERY_S
        watch.check()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"pid {pid}" in warnings[0].getMessage()
    watch.check()  # not due yet: no read
    assert not [r for r in caplog.records if "ended" in r.getMessage()]
    now[0] += CHECK_EVERY_S
    watch.check()
    assert [r.levelno for r in caplog.records if "ended" in r.getMessage()] == [logging.INFO]


def test_no_alert_reads_the_store_when_turned_off_or_on_sqlite(pg, tmp_path) -> None:
    from backends import sqlite_harness

    assert HorizonWatch(pg.store, alert_s=0.0).store is None
    h = sqlite_harness(tmp_path / "s")
    try:
        assert HorizonWatch(h.store, alert_s=60.0).store is None
        families = {f.name for f in FleetCollector(lambda: (h.store, h.transport)).collect()}
        assert GAUGE.removesuffix("_seconds") not in families and "agent_utilities_dispatch_workers" in families
    finally:
        h.close()


def _file(conn: psycopg.Connection, table: str) -> tuple[int, int]:
    """The table's file and its pages."""
    row = conn.execute(
        "SELECT pg_relation_filenode(%s::regclass), pg_relation_size(%s::regclass) / 8192", (table, table)
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _bloat_counters(conn: psycopg.Connection) -> None:
    """Update every admission counter in place (value unchanged) until the
    table is far past what its rows need: a held snapshot keeps each version."""
    while _file(conn, "dispatch_depth")[1] < 4 * compact.MIN_PAGES:
        conn.execute("UPDATE dispatch_depth SET n = n")


def _snapshots_before(conn: psycopg.Connection, xid: int) -> int:
    """Sessions anywhere in the cluster whose transaction or snapshot is older
    than ``xid``. A snapshot's xmin is the oldest transaction running in any
    database (another test's migration, say), so each such session can keep
    a rewrite here from removing versions that ``xid`` made dead."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        " AND (age(backend_xid) > age(%(x)s::text::xid) OR age(backend_xmin) > age(%(x)s::text::xid))",
        {"x": xid % 2**32},
    ).fetchone()
    return 0 if row is None else int(row[0])


def test_a_worker_compacts_the_counters_once_the_long_transaction_ended(pg) -> None:
    now = [0.0]
    watch = HorizonWatch(pg.store, alert_s=3600.0, clock=lambda: now[0], quiet_s=0.001)
    uri = pg.settings.state_db_uri
    with psycopg.connect(uri, autocommit=True) as conn:
        small = _file(conn, "dispatch_depth")
        with repeatable_read(uri) as pid:
            _bloat_counters(conn)
            wait_until(lambda: _age_of(pg, pid) > 0.001)
            bloated = _file(conn, "dispatch_depth")
            watch.check()  # the transaction is still open: the rewrite could remove nothing
            assert _file(conn, "dispatch_depth") == bloated
        watch.check()  # not due yet
        assert _file(conn, "dispatch_depth") == bloated
        now[0] += COMPACT_EVERY_S
        after = int(conn.execute("SELECT txid_current()").fetchone()[0])  # type: ignore[index]
        wait_until(lambda: _snapshots_before(conn, after) == 0)
        watch.check()
        file, pages = _file(conn, "dispatch_depth")
        assert file != bloated[0] and pages <= max(small[1], 1)
        assert int(conn.execute("SELECT count(*) FROM dispatch_depth").fetchone()[0]) == 64  # type: ignore[index]
        now[0] += COMPACT_EVERY_S
        watch.check()  # small now: left alone
        assert _file(conn, "dispatch_depth") == (file, pages)


def test_a_busy_table_is_left_to_the_next_pass_without_waiting_for_it(pg) -> None:
    now = [0.0]
    watch = HorizonWatch(pg.store, alert_s=3600.0, clock=lambda: now[0])
    uri = pg.settings.state_db_uri
    with psycopg.connect(uri, autocommit=True) as conn:
        with repeatable_read(uri):
            _bloat_counters(conn)
        bloated = _file(conn, "dispatch_depth")
        with psycopg.connect(uri) as writer:
            writer.execute("UPDATE dispatch_depth SET n = n WHERE slot = 0")  # a submission's, uncommitted
            watch.check()  # returns although the writer holds on: the rewrite never waited in line
            assert _file(conn, "dispatch_depth") == bloated
            writer.rollback()
        now[0] += COMPACT_EVERY_S
        watch.check()
        assert _file(conn, "dispatch_depth")[1] < compact.MIN_PAGES


def test_a_table_its_live_rows_fill_is_left_alone(pg) -> None:
    watch = HorizonWatch(pg.store, alert_s=3600.0, clock=lambda: 0.0)
    with psycopg.connect(pg.settings.state_db_uri, autocommit=True) as conn:
        while _file(conn, "dispatch_waiting")[1] < 2 * compact.MIN_PAGES:  # a large idle fleet's marks
            conn.execute(
                "INSERT INTO dispatch_waiting (owner, listener, until) SELECT md5(random()::text), 1, now() "
                "FROM generate_series(1, 500)"
            )
        full = _file(conn, "dispatch_waiting")
        watch.check()
        assert _file(conn, "dispatch_waiting") == full


@pytest.mark.parametrize("effect_first", [True, False])
def test_no_transaction_stays_open_across_a_model_call(pg, effect_first: bool) -> None:
    in_call, answer = threading.Event(), threading.Event()
    reg = Registry()

    async def send() -> str:
        return "sent"

    @reg.register("agent")
    async def agent(turn, guard):
        if effect_first:
            await guard.side_effect_async("tool", send)
        guard.checkpoint({"step": 1})
        in_call.set()
        while not answer.is_set():  # the model's answer, seconds away
            await asyncio.sleep(0.01)
        await guard.side_effect_async("reply", send)
        return "done"

    job = pg.dispatcher().submit(Submission(kind="agent", tenant="t")).job_id
    opts = RuntimeOptions(get_wait_s=0.05, heartbeat_s=0.2, cancel_poll_s=0.05)
    worker = AsyncWorker(pg.settings, pg.store, pg.transport, reg, options=opts)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        assert in_call.wait(30)
        with psycopg.connect(pg.settings.state_db_uri, autocommit=True) as conn:
            row = conn.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            call_began = row[0]
            # The worker keeps polling, renewing and beating meanwhile: each of
            # those transactions must have begun after the call did.
            answer.wait(0.5)
            held = conn.execute(
                "SELECT pid, state, query FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND xact_start < %s",
                (call_began,),
            ).fetchall()
        assert held == []
        answer.set()
        wait_until(lambda: pg.store.get(job, "t").status.terminal)
        assert pg.store.get(job, "t").status is Status.SUCCEEDED, pg.store.get(job, "t")
    finally:
        answer.set()
        worker.request_stop()
        thread.join(timeout=60)
    assert not thread.is_alive()


def _doctor(pg, alert_s: str) -> tuple[int, dict[str, dict[str, object]]]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "STATE_DB", "TASK_QUEUE"))},
        "STATE_DB_URI": pg.settings.state_db_uri,
        "TASK_QUEUE_BACKEND": "postgres",
        "AGENT_DISPATCH_PG_XMIN_ALERT_S": alert_s,
    }
    out = subprocess.run(
        [sys.executable, "-m", "agentdispatch", "doctor", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    return out.returncode, {c["name"]: c for c in json.loads(out.stdout)}


def test_doctor_fails_while_a_transaction_is_open_too_long(pg) -> None:
    code, checks = _doctor(pg, "0.001")
    assert code == 0 and checks["oldest_transaction"]["detail"] == "none open"
    with repeatable_read(pg.settings.state_db_uri) as pid:
        wait_until(lambda: _age_of(pg, pid) > 0.001)
        code, checks = _doctor(pg, "0.001")
        assert code == 1 and not checks["oldest_transaction"]["ok"]
        assert f"backend pid {pid} (idle in transaction)" in str(checks["oldest_transaction"]["detail"])
        code, checks = _doctor(pg, "3600")
        assert code == 0 and checks["oldest_transaction"]["ok"]
