"""The request path on PostgreSQL: concurrent copies of one delivery, and a
store that stalls past the commit timeout (503, nothing written, retry admitted)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import psycopg
import pytest

from backends import fresh_pg_database
from e2e.gatewayproc import Gateway
from intake.kit import APP, TG_BOT, cli, gateway, install_all, post_slack, post_tg, slack_event, tg_update


@pytest.fixture(scope="module")
def pg_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, str]]:
    cleanup: list[Callable[[], None]] = []
    uri = fresh_pg_database(cleanup)
    env = {"STATE_DB_URI": uri, "TASK_QUEUE_BACKEND": "postgres"}
    data = tmp_path_factory.mktemp("pg") / "data"
    cli(data, "migrate", **env)
    install_all(data, **env)
    gw = gateway(data, AGENT_DISPATCH_INTAKE_COMMIT_TIMEOUT_S="1", **env)
    try:
        yield gw, uri
    finally:
        gw.stop()
        for fn in cleanup:
            fn()


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
