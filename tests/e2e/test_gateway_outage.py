"""A store outage over real HTTP: 503 with Retry-After, nothing leaked,
nothing accepted lost. The gateway runs under uvicorn in this process so the
test can swap in a store whose database cannot be opened, then swap back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.sqlite.db import SqliteDb
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.backends.sqlite.transport import SqliteTransport
from agentdispatch.gateway import Services, create_app, ops
from agentdispatch.gateway.auth import mint
from backends import Harness, sqlite_harness
from ports import free_port


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[Harness, Services, str]]:
    h = sqlite_harness(tmp_path)
    services = Services.of(h.settings, h.store, h.transport)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(services), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield h, services, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        h.close()


def _break(services: Services, tmp_path: Path) -> None:
    """Point the gateway at a database that cannot be opened (its parent is a file)."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    broken_store = SqliteStore(blocker / "agent_dispatch_queue.db")
    services.store = services.dispatcher.store = broken_store
    services.transport = services.dispatcher.transport = SqliteTransport(SqliteDb(blocker / "agent_dispatch_queue.db"))


def test_store_outage_is_503_with_retry_after_and_loses_nothing(
    served: tuple[Harness, Services, str], tmp_path: Path
) -> None:
    h, services, url = served
    store, transport = h.store, h.transport
    _, token = mint(store, "acme")
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=auth) as c:
        accepted = c.post("/v1/jobs", json={"kind": "echo"}).json()["job_id"]
        before = store.counts(None)

        _break(services, tmp_path)
        for method, path, body in [
            ("POST", "/v1/jobs", {"kind": "echo"}),
            ("POST", "/api/graph/jobs", {"action": "dispatch", "kind": "echo"}),
            ("GET", f"/v1/jobs/{accepted}", None),
            ("POST", f"/v1/jobs/{accepted}/cancel", None),
            ("GET", "/v1/jobs", None),
            ("GET", "/metrics", None),
            ("GET", "/api/overview", None),
        ]:
            r = c.request(method, path, json=body)
            # An unreadable token table is an outage, never "bad token".
            assert r.status_code == 503, (method, path, r.text)
            assert r.headers["Retry-After"].isdigit()
            assert r.json()["error"] == "unavailable"
            assert str(tmp_path) not in r.text and "sqlite3" not in r.text
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 503 and ready.headers["Retry-After"]
        assert ready.json()["checks"]["store"] == "unreachable"
        assert httpx.get(f"{url}/healthz").status_code == 200  # the process itself is up

        services.auth = False  # reach the registry read itself, past the token check
        topo = httpx.get(f"{url}/api/fleet/topology")
        assert topo.status_code == 503 and topo.json()["partial"] is True
        assert topo.headers["Retry-After"].isdigit()
        services.auth = True

        services.store = services.dispatcher.store = store
        services.transport = services.dispatcher.transport = transport
        assert store.counts(None) == before
        assert c.get(f"/v1/jobs/{accepted}").json()["status"] == "ready"
        assert c.post("/v1/jobs", json={"kind": "echo"}).status_code == 202


def test_liveness_answers_at_once_while_requests_wait_on_a_database_that_is_down(
    served: tuple[Harness, Services, str],
) -> None:
    # A PostgreSQL store whose server is down: every request that reads it
    # holds a worker thread while the pool waits for a connection. /healthz
    # says whether the process serves; it must not queue behind them, or a
    # liveness probe restarts every gateway during a database outage.
    _, services, url = served
    down = PostgresStore(f"postgresql://postgres@127.0.0.1:{free_port()}/test", pool_timeout_s=2.0)
    services.store = services.dispatcher.store = down
    services.auth = False
    try:
        with httpx.Client(base_url=url, timeout=60) as c, ThreadPoolExecutor(80) as pool:
            waiting = [pool.submit(c.get, "/v1/jobs/dispatch-x") for _ in range(80)]
            time.sleep(0.5)  # let them take the gateway's worker threads
            assert c.get("/healthz", timeout=30).status_code == 200
            # Answered while every request before it still waits for the database.
            assert not any(f.done() for f in waiting)
            assert {f.result().status_code for f in waiting} == {503}
    finally:
        down.close()


def test_readiness_answers_in_its_own_time_while_the_database_is_down(
    served: tuple[Harness, Services, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PostgreSQL store whose pool would wait 30 s for a connection, twice: a
    # readiness probe gives up long before, so /readyz says 503 at its own
    # deadline instead, and a second probe waits on the same ping.
    _, services, url = served
    down = PostgresStore(f"postgresql://postgres@127.0.0.1:{free_port()}/test", pool_timeout_s=30.0)
    services.store = services.dispatcher.store = down
    monkeypatch.setattr(ops, "READY_TIMEOUT_S", 0.5)
    try:
        with httpx.Client(base_url=url, timeout=20) as c:
            for _ in range(2):
                r = c.get("/readyz")
                assert r.status_code == 503 and r.headers["retry-after"]
                assert r.json()["checks"] == {"store": "unreachable", "transport": "ok"}
        assert sum(t.name == "probe-store" for t in threading.enumerate()) == 1
    finally:
        down.close()
