"""The request path on PostgreSQL: concurrent copies of one delivery, a
store that stalls past the commit timeout (503, nothing written, retry
admitted), an intake near the backlog bound that waits for no other, and
recovery soon after a long database outage."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.intake.admit import BACKLOG_PER_AGENT
from backends import fresh_pg_database
from e2e.gatewayproc import Gateway
from intake.kit import (
    APP,
    TG_BOT,
    cli,
    env_for,
    gateway,
    install_all,
    migrate,
    pg_gateway_on,
    post_slack,
    post_tg,
    slack_event,
    tg_update,
)
from pg import PrivateCluster


@pytest.fixture(scope="module")
def pg_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    with pg_gateway_on(tmp_path_factory.mktemp("pg") / "data", commit_timeout_s="1") as gw:
        yield gw


def _count(uri: str, sql: str, *args: object) -> int:
    with psycopg.connect(uri) as conn:
        row = conn.execute(sql, args).fetchone()
        assert row is not None
        return int(row[0])


def test_concurrent_copies_one_receipt_one_item(pg_gateway: tuple[Gateway, str]) -> None:
    gw, uri = pg_gateway
    for n in range(5):
        body = slack_event(f"EvPg{n}")
        codes: list[int] = []
        barrier = threading.Barrier(3)

        def send(
            retry: str, body: bytes = body, codes: list[int] = codes, barrier: threading.Barrier = barrier
        ) -> None:
            with httpx.Client(base_url=gw.url, timeout=10) as c:
                barrier.wait()
                codes.append(post_slack(c, body, **{"X-Slack-Retry-Num": retry}).status_code)

        threads = [threading.Thread(target=send, args=(str(r),)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [200, 200, 200], gw.log()[-4000:]
        source = f"{APP}:T0TEAM:EvPg{n}"
        assert _count(uri, "SELECT count(*) FROM intake_receipts WHERE source_id = %s", source) == 1
        joined = "SELECT count(*) FROM work_items w JOIN intake_receipts r ON r.job_id = w.id WHERE r.source_id = %s"
        assert _count(uri, joined, source) == 1


def test_stalled_store_is_503_then_retry_admitted(pg_gateway: tuple[Gateway, str]) -> None:
    gw, uri = pg_gateway
    body = tg_update(31337)
    with psycopg.connect(uri) as blocker, gw.client() as c:
        blocker.execute("LOCK TABLE intake_receipts IN ACCESS EXCLUSIVE MODE")
        r = post_tg(c, body)
        assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
        blocker.rollback()
    source = f"{TG_BOT}:31337"
    with gw.client() as c:
        import time

        time.sleep(0.5)  # the abandoned transaction rolled back rather than committing late
        assert _count(uri, "SELECT count(*) FROM intake_receipts WHERE source_id = %s", source) == 0
        assert post_tg(c, body).status_code == 200
    assert _count(uri, "SELECT count(*) FROM intake_receipts WHERE source_id = %s", source) == 1
    assert _count(uri, "SELECT count(*) FROM work_items w JOIN intake_receipts r ON r.job_id = w.id "
                       "WHERE r.source_id = %s", source) == 1  # fmt: skip


def test_intake_near_the_backlog_bound_does_not_wait_for_another_intake(tmp_path: Path) -> None:
    """Near the 256-item bound, an intake used to take every backlog token and
    hold them through its commit, so the next webhook waited for it (past the
    commit timeout: 503). Here another intake's transaction is held open right
    after its backlog step, with a real worker busy on long turns: the webhook
    must still be recorded and answered while that transaction stays open."""
    cleanup: list[Callable[[], None]] = []
    uri = fresh_pg_database(cleanup)
    env = {"STATE_DB_URI": uri, "TASK_QUEUE_BACKEND": "postgres"}
    data = tmp_path / "data"
    worker: subprocess.Popen[bytes] | None = None
    gw: Gateway | None = None
    try:
        migrate(data, **env)
        install_all(data, **env)
        for i in range(2):
            cli(data, "submit", "sleep", "--payload", '{"seconds": 120}', "--session", f"busy{i}", **env)
        # Its turns never end by themselves: a short grace lets it stop when
        # the test is done instead of holding them through the default 30 s.
        worker = subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "worker", "--workers", "1", "--grace", "0.5"],
            env=env_for(data, env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with psycopg.connect(uri, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO work_items (id, tenant, session_id, session_ref, kind, agent_name, payload, status,"
                " max_attempts, created_at, ready_at, updated_at)"
                " SELECT 'fill-' || g, 'acme', 's' || g, 'r' || g, 'intake_turn', 'helper', '{}', 'ready', 5, 0, 0, 0"
                " FROM generate_series(1, 240) g"
            )
        gw = gateway(data, AGENT_DISPATCH_INTAKE_COMMIT_TIMEOUT_S="5", **env)
        with gw.client() as c:
            assert post_tg(c, tg_update(4241)).status_code == 200  # the agent's first intake
        with psycopg.connect(uri) as other:
            # What a concurrent intake of the same agent runs first, 16 below the bound.
            params = {"agent": "helper", "bound": BACKLOG_PER_AGENT, "job": "intake-in-flight"}
            other.execute("SELECT dispatch_intake_backlog(%(agent)s, %(bound)s, %(job)s)", params)
            with gw.client() as c:
                r = post_tg(c, tg_update(4242))
            assert other.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # still open
            assert r.status_code == 200, gw.log()[-2000:]
            state = "SELECT count(*) FROM intake_receipts WHERE source_id = %s AND state = 'accepted'"
            assert _count(uri, state, f"{TG_BOT}:4242") == 1
            other.rollback()
    finally:
        if gw is not None:
            gw.stop()
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
        for fn in cleanup:
            fn()


def test_backlog_slots_of_ended_items_are_taken_again() -> None:
    """The backlog bound counts open items only: once some of an agent's items
    end, that many new intakes are admitted (whichever slots they held), and
    the next one is refused again."""
    cleanup: list[Callable[[], None]] = []
    uri = fresh_pg_database(cleanup)
    try:
        store = PostgresStore(uri)
        store.migrate()
        store.close()
        bound = 6
        with psycopg.connect(uri, autocommit=True) as conn:

            def intake(job: str) -> bool:
                with conn.transaction():
                    row = conn.execute("SELECT dispatch_intake_backlog('helper', %s, %s)", (bound, job)).fetchone()
                    assert row is not None
                    if int(row[0]) >= bound:
                        return False
                    conn.execute(
                        "INSERT INTO work_items (id, tenant, session_id, session_ref, kind, agent_name, payload,"
                        " status, max_attempts, created_at, ready_at, updated_at)"
                        " VALUES (%s, 'acme', %s, %s, 'intake_turn', 'helper', '{}', 'ready', 5, 0, 0, 0)",
                        (job, job, job),
                    )
                    return True

            assert [intake(f"a{i}") for i in range(bound + 1)] == [True] * bound + [False]
            conn.execute("UPDATE work_items SET status = 'succeeded' WHERE id IN ('a1', 'a4')")
            assert [intake(f"b{i}") for i in range(3)] == [True, True, False]
            held = conn.execute("SELECT job_id FROM intake_backlog_slots WHERE agent = 'helper' ORDER BY job_id")
            assert [r[0] for r in held] == ["a0", "a2", "a3", "a5", "b0", "b1"]
    finally:
        for fn in cleanup:
            fn()


@pytest.mark.slow
def test_intake_answers_again_soon_after_a_long_database_outage(tmp_path: Path) -> None:
    # A provider retries through the outage; once the database is back the
    # next retry must be taken within seconds, however long it was down.
    cluster = PrivateCluster().start()
    try:
        env = {"STATE_DB_URI": cluster.uri(), "TASK_QUEUE_BACKEND": "postgres"}
        data = tmp_path / "data"
        migrate(data, **env)
        install_all(data, **env)
        gw = gateway(data, AGENT_DISPATCH_INTAKE_COMMIT_TIMEOUT_S="1", **env)
        try:
            with gw.client() as c:
                assert post_tg(c, tg_update(1)).status_code == 200
                cluster.stop()
                down_until = time.monotonic() + 16  # long enough for the pool's retry delay to double past 10 s
                while time.monotonic() < down_until:
                    r = post_tg(c, tg_update(2))
                    assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
                    time.sleep(0.5)  # the provider's retry interval
                cluster.start()
                back = time.monotonic()
                while (r := post_tg(c, tg_update(2))).status_code != 200:
                    assert r.status_code == 503 and time.monotonic() - back < 6
                    time.sleep(0.2)
        finally:
            gw.stop()
        assert _count(cluster.uri(), "SELECT count(*) FROM intake_receipts WHERE source_id = %s", f"{TG_BOT}:2") == 1
    finally:
        cluster.destroy()
