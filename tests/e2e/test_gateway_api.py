"""The jobs API over real HTTP: a gateway subprocess on a SQLite store."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentdispatch.handlers import Registry, Turn
from agentdispatch.workitem import Status
from backends import Harness, sqlite_harness
from e2e.gatewayproc import Gateway, start_gateway

HANDLE_KEYS = {"job_id", "session_id", "kind", "dispatch", "status", "status_url", "status_request"}
SECRETS = {"lease_token", "lease_owner", "lease_epoch", "lease_expires_at", "token"}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gw-api")


@pytest.fixture(scope="module")
def gw(base: Path) -> Iterator[Gateway]:
    g = start_gateway(base / "data")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def harness(base: Path, gw: Gateway) -> Iterator[Harness]:
    h = sqlite_harness(base)  # the same SQLite file the gateway serves
    yield h
    h.close()


@pytest.fixture()
def api(gw: Gateway) -> Iterator[httpx.Client]:
    with gw.client("acme") as c:
        yield c


def test_graph_dispatch_status_cancel_have_the_spec_shapes(api: httpx.Client) -> None:
    r = api.post("/api/graph/jobs", json={"action": "dispatch", "kind": "echo", "payload": {"q": 1}})
    assert r.status_code == 200
    handle = r.json()
    assert set(handle) == HANDLE_KEYS
    assert handle["dispatch"] == "queued" and handle["status"] == "pending"
    assert handle["job_id"].startswith("dispatch-") and len(handle["job_id"]) == len("dispatch-") + 32
    assert handle["status_url"] == "/api/graph/jobs"
    assert handle["status_request"] == {"action": "status", "job_id": handle["job_id"]}

    view = api.post("/api/graph/jobs", json=handle["status_request"]).json()
    assert view["job_id"] == handle["job_id"] and view["status"] == "ready"
    assert {"kind", "status", "payload_ref", "result_ref", "attempt"} <= set(view)
    assert not SECRETS & set(view)

    cancelled = api.post("/api/graph/jobs", json={"action": "cancel", "job_id": handle["job_id"]}).json()
    assert cancelled["status"] == "cancelled"
    assert api.get(f"/v1/jobs/{handle['job_id']}").json()["status"] == "cancelled"


def test_unknown_job_is_the_exact_404(api: httpx.Client) -> None:
    for r in (
        api.post("/api/graph/jobs", json={"action": "status", "job_id": "dispatch-missing"}),
        api.post("/api/graph/jobs", json={"action": "cancel", "job_id": "dispatch-missing"}),
        api.get("/v1/jobs/dispatch-missing"),
        api.post("/v1/jobs/dispatch-missing/cancel"),
        api.post("/v1/jobs/dispatch-missing/replay"),
    ):
        assert r.status_code == 404
        assert r.json() == {"status": "not_found", "error": "Job dispatch-missing not found"}


def test_rest_create_get_list_paginate_and_filter(api: httpx.Client) -> None:
    session = "sess-list"
    ids = []
    for i in range(5):
        r = api.post("/v1/jobs", json={"kind": "echo", "payload": i, "session_id": session})
        assert r.status_code == 202
        ids.append(r.json()["job_id"])
    api.post(f"/v1/jobs/{ids[0]}/cancel", json={"reason": "not needed"})
    got = api.get(f"/v1/jobs/{ids[0]}").json()
    assert got["status"] == "cancelled" and got["reason"] == "not needed"

    first = api.get("/v1/jobs", params={"limit": 2}).json()
    second = api.get("/v1/jobs", params={"limit": 2, "offset": 2}).json()
    assert [j["job_id"] for j in first["jobs"]] == ids[:-3:-1]  # newest first
    assert [j["job_id"] for j in second["jobs"]] == [ids[2], ids[1]]
    assert first["page"] == {"limit": 2, "offset": 0, "returned": 2, "more": True}

    cancelled = api.get("/v1/jobs", params={"status": "cancelled", "limit": 500}).json()["jobs"]
    assert ids[0] in {j["job_id"] for j in cancelled}
    assert all(j["status"] == "cancelled" for j in cancelled)
    assert api.get("/v1/jobs", params={"status": "nonsense"}).status_code == 422


def test_idempotency_key_returns_the_same_job(api: httpx.Client, harness: Harness) -> None:
    before = sum(harness.store.counts("acme").values())
    a = api.post("/v1/jobs", json={"kind": "echo"}, headers={"Idempotency-Key": "order-17"}).json()
    b = api.post("/v1/jobs", json={"kind": "echo"}, headers={"Idempotency-Key": "order-17"}).json()
    c = api.post("/api/graph/jobs", json={"action": "dispatch", "kind": "echo", "idempotency_key": "order-17"}).json()
    d = api.post("/v1/jobs", json={"kind": "echo", "job_id": "caller-chosen-1"}).json()
    e = api.post("/v1/jobs", json={"kind": "echo", "job_id": "caller-chosen-1"}).json()
    assert a == b == c
    assert d == e and d["job_id"] == "caller-chosen-1"
    assert sum(harness.store.counts("acme").values()) == before + 2


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"kind": "echo", "surprise": 1}, 422, "invalid_request"),
        ({"kind": "no spaces allowed"}, 422, "invalid_request"),
        ({"kind": "echo", "priority": 1000}, 422, "invalid_request"),
        ({"kind": "echo", "job_id": "x", "dependencies": ["x"]}, 400, "invalid_input"),
        ({"kind": "echo", "payload": "x" * (1024 * 1024 + 1)}, 413, "payload_too_large"),
        ({"kind": "echo", "tenant": "someone-else"}, 403, "tenant_forbidden"),
    ],
)
def test_malformed_input_is_4xx_with_a_code_and_changes_nothing(
    api: httpx.Client, harness: Harness, body: dict[str, object], status: int, code: str
) -> None:
    before = harness.store.counts(None)
    r = api.post("/v1/jobs", json=body)
    assert r.status_code == status
    assert r.json()["error"] == code and r.json()["status"] == "error" and r.json()["message"]
    assert harness.store.counts(None) == before


def test_bad_json_and_missing_job_id_are_4xx(api: httpx.Client, harness: Harness) -> None:
    before = harness.store.counts(None)
    r = api.post("/api/graph/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    r = api.post("/api/graph/jobs", json={"action": "status"})
    assert r.status_code == 422 and "job_id" in r.json()["message"]
    r = api.post("/api/graph/jobs", json={"action": "explode", "job_id": "x"})
    assert r.status_code == 422
    assert harness.store.counts(None) == before


def test_replay_moves_a_dead_letter_to_ready_and_refuses_others(
    api: httpx.Client, harness: Harness, tmp_path: Path
) -> None:
    job_id = _dead_letter(harness, "acme")
    r = api.post(f"/v1/jobs/{job_id}/replay")
    assert r.status_code == 200
    assert r.json()["job"]["status"] == "ready" and r.json()["side_effects"] == []
    again = api.post(f"/v1/jobs/{job_id}/replay")
    assert again.status_code == 409 and again.json()["error"] == "invalid_transition"
    history = api.get(f"/v1/jobs/{job_id}/history").json()
    assert [e["event"] for e in history["events"]][-1] == "replayed"


def test_openapi_documents_every_route(gw: Gateway) -> None:
    doc = httpx.get(f"{gw.url}/openapi.json").json()
    for path in ("/api/graph/jobs", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel"):
        assert path in doc["paths"]
    assert "/v1/jobs/{job_id}/replay" in doc["paths"] and "/api/fleet/topology" in doc["paths"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_metrics_expose_the_fleet_series(api: httpx.Client, harness: Harness) -> None:
    api.post("/v1/jobs", json={"kind": "echo"})
    r = api.get("/metrics")
    text = r.text
    depth = harness.transport.depth()
    assert f'agent_utilities_dispatch_queue_depth{{backend="sqlite"}} {float(depth)}' in text
    for name in (
        "agent_utilities_dispatch_workers ",
        "agent_utilities_dispatch_worker_capacity ",
        "agent_utilities_dispatch_store_up 1.0",
        "agent_utilities_dispatch_tenant_depth{",
        "agent_utilities_dispatch_turns_in_flight{",
        "agent_utilities_dispatch_dead_letter{",
        "agent_utilities_dispatch_dead_letter_oldest_age_seconds{",
    ):
        assert name in text
    # Turn counters are each worker's own (tests/e2e/test_fleet_metrics.py).
    assert "agent_utilities_dispatch_turns_total" not in text
    assert r.headers["cache-control"] == "no-store"


def test_readyz_and_topology(api: httpx.Client) -> None:
    ready = api.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"store": "ok", "transport": "ok"}
    assert api.get("/healthz").json() == {"status": "ok"}
    assert api.get("/api/fleet/topology").headers["cache-control"] == "no-store"
    overview = api.get("/api/overview")
    assert overview.headers["cache-control"] == "no-store" and "counts" in overview.json()


def test_topology_shows_live_workers_and_only_the_callers_sessions(gw: Gateway, harness: Harness) -> None:
    d = harness.dispatcher()
    from agentdispatch.dispatch import Submission

    mine = d.submit(Submission(kind="sleep", payload={"seconds": 3}, tenant="acme", session_id="acme-s"))
    theirs = d.submit(Submission(kind="sleep", payload={"seconds": 3}, tenant="other", session_id="other-s"))
    reg = Registry()
    reg.add("sleep", _hold)
    _RELEASE.clear()
    _HELD.update((mine.job_id, theirs.job_id))
    worker = harness.worker(reg, threads=2)
    worker.start()
    try:
        # Started by their handler, not merely claimed: a claimed turn is not
        # yet among the worker's active sessions.
        _wait(lambda: {mine.job_id, theirs.job_id} <= _STARTED)
        worker._beat(force=True)  # publish the active sessions now
        with gw.client("acme") as c:
            doc = c.get("/api/fleet/topology", params={"limit": 10}).json()
        with gw.client("other") as c:
            other = c.get("/api/fleet/topology").json()
    finally:
        _RELEASE.set()
        worker.stop(grace_s=10)
    row = next(w for w in doc["dispatch_workers"] if w["worker_id"] == worker.worker_id)
    assert row["active_sessions"] == ["acme-s"] and row["capacity"] == 2 and row["queue_backend"] == "sqlite"
    assert doc["totals"]["dispatch_workers"] >= 1 and doc["totals"]["sessions"] == 1
    assert doc["page"] == {"limit": 10, "offset": 0, "returned": len(doc["dispatch_workers"])}
    assert doc["partial"] is False
    other_row = next(w for w in other["dispatch_workers"] if w["worker_id"] == worker.worker_id)
    assert other_row["active_sessions"] == ["other-s"]
    assert "host-" in row["host"]  # an opaque label, never the host name


# -- helpers --------------------------------------------------------------


_RELEASE = threading.Event()
_HELD: set[str] = set()
_STARTED: set[str] = set()


def _hold(turn: Turn, guard: object) -> str:
    """Keep this test's turns running until it has read both tenants' views (a slow
    machine may take longer than any fixed sleep between the two requests); turns
    left queued by earlier tests in this module finish at once."""
    _STARTED.add(turn.job_id)
    if turn.job_id in _HELD:
        _RELEASE.wait(timeout=60)
    return "held"


def _wait(cond: object, timeout: float = 15) -> None:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _dead_letter(h: Harness, tenant: str) -> str:
    """Drive one job into the dead-letter queue through the real store API."""
    from agentdispatch.dispatch import Submission
    from agentdispatch.stores.base import ClaimKind
    from agentdispatch.workitem import Outcome

    handle = h.dispatcher().submit(Submission(kind="boom", tenant=tenant))
    claim = h.store.claim(handle.job_id, tenant, owner="test-worker", ttl_s=30)
    assert claim.kind is ClaimKind.CLAIMED and claim.lease is not None
    h.store.commit(claim.lease, Outcome(ok=False, error="always fails", dead_letter_reason="handler_error"))
    assert h.store.get(handle.job_id, tenant).status is Status.DEAD_LETTER
    return handle.job_id


def test_doctor_includes_the_gateway_view_without_paths(gw: Gateway) -> None:
    from e2e.gatewayproc import cli

    out = cli(gw.data_dir, "doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {ln.split(":")[0]: ln for ln in out.stdout.splitlines()}
    assert lines["OK   gateway"].startswith("OK   gateway: app builds")
    assert "dashboard assets present" in lines["OK   gateway"]
    assert lines["OK   gateway_tokens"]
    assert str(gw.data_dir) not in out.stdout and str(Path.home()) not in out.stdout


def test_oversized_bodies_are_413_and_change_nothing(api: httpx.Client, harness: Harness) -> None:
    before = harness.store.counts(None)
    big = b'{"kind": "echo", "payload": "' + b"x" * (3 * 1024 * 1024) + b'"}'
    r = api.post("/v1/jobs", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield big[: 1024 * 1024]
        yield big[1024 * 1024 :]

    r = api.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    assert harness.store.counts(None) == before


def test_sigterm_stops_the_gateway_cleanly_with_exit_0(tmp_path: Path) -> None:
    g = start_gateway(tmp_path / "data")
    try:
        with g.client("acme") as c:
            assert c.post("/v1/jobs", json={"kind": "echo"}).status_code == 202
    finally:
        g.stop()
    # A supervisor reads anything but 0 after its own SIGTERM as a crash.
    assert g.proc.returncode == 0, g.log()
    assert "Traceback" not in g.log()


def test_a_body_trickled_without_a_token_is_cut_at_the_deadline(tmp_path: Path) -> None:
    # The request head has a deadline, and a webhook body too; an API body had
    # none: a caller without a token that sent a head and then one byte held
    # its connection (a file descriptor) for as long as it liked.
    g = start_gateway(tmp_path / "data", AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S="1")
    try:
        for path in ("/v1/jobs", "/api/graph/jobs"):
            with socket.create_connection(("127.0.0.1", g.port), timeout=15) as s:
                head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                s.sendall(head.encode() + b"Content-Length: 100\r\n\r\n{")
                got = b""
                while chunk := s.recv(65536):  # b"" once the gateway closes; a timeout if it never does
                    got += chunk
                assert got.startswith(b"HTTP/1.1 408"), got
                assert b'"error":"body_timeout"' in got, got
        # A long-poll reads no body past its end: the deadline never cuts it.
        with g.client("acme") as c:
            job = c.post("/v1/jobs", json={"kind": "echo"}).json()["job_id"]
            r = c.get(f"/v1/jobs/{job}", params={"wait": 2}, timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "ready"
    finally:
        g.stop()
