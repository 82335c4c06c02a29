"""Tenants and bearer tokens over real HTTP: the auth matrix, revocation,
hashed storage and the loopback rule."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentdispatch.dispatch import Submission
from backends import Harness, sqlite_harness
from e2e.gatewayproc import Gateway, cli, start_gateway
from ports import free_port


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gw-auth")


@pytest.fixture(scope="module")
def gw(base: Path) -> Iterator[Gateway]:
    g = start_gateway(base / "data")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def harness(base: Path, gw: Gateway) -> Iterator[Harness]:
    h = sqlite_harness(base)
    yield h
    h.close()


def _snapshot(h: Harness) -> dict[str, object]:
    return {
        "all": h.store.counts(None),
        "jobs": [i.view() for i in h.store.list_jobs(tenant=None, status=None, limit=1000, offset=0)],
    }


def _requests(job_id: str) -> list[tuple[str, str, dict[str, object] | None]]:
    """Every data route, with a body where it takes one."""
    return [
        ("POST", "/api/graph/jobs", {"action": "dispatch", "kind": "echo"}),
        ("POST", "/api/graph/jobs", {"action": "status", "job_id": job_id}),
        ("POST", "/api/graph/jobs", {"action": "cancel", "job_id": job_id}),
        ("POST", "/v1/jobs", {"kind": "echo"}),
        ("GET", f"/v1/jobs/{job_id}", None),
        ("GET", f"/v1/jobs/{job_id}/history", None),
        ("POST", f"/v1/jobs/{job_id}/cancel", None),
        ("POST", f"/v1/jobs/{job_id}/replay", None),
        ("GET", "/v1/jobs", None),
        ("GET", "/api/fleet/topology", None),
        ("GET", "/api/overview", None),
        ("GET", "/metrics", None),
    ]


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer",
        "Bearer not-a-token",
        "Basic YWRtaW46YWRtaW4=",
        "Bearer adt_000000000000_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    ],
    ids=["none", "empty", "garbage", "basic", "unknown"],
)
def test_missing_or_bad_token_is_401_and_changes_nothing(gw: Gateway, harness: Harness, header: str | None) -> None:
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="acme"))
    before = _snapshot(harness)
    headers = {"Authorization": header} if header else {}
    with httpx.Client(base_url=gw.url, headers=headers) as c:
        for method, path, body in _requests(job.job_id):
            r = c.request(method, path, json=body)
            assert r.status_code == 401, (method, path)
            assert r.json()["error"] == "unauthorized"
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert _snapshot(harness) == before


def test_revoked_token_is_401_at_once(gw: Gateway, harness: Harness) -> None:
    minted = gw.mint("acme")
    auth = {"Authorization": f"Bearer {minted['token']}"}
    job = httpx.post(f"{gw.url}/v1/jobs", json={"kind": "echo"}, headers=auth).json()
    assert httpx.get(f"{gw.url}/v1/jobs/{job['job_id']}", headers=auth).status_code == 200

    out = cli(gw.data_dir, "token", "revoke", minted["token_id"])
    assert out.returncode == 0 and minted["token"] not in out.stdout + out.stderr
    before = _snapshot(harness)
    for method, path, body in _requests(job["job_id"]):
        r = httpx.request(method, f"{gw.url}{path}", json=body, headers=auth)
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    assert _snapshot(harness) == before
    again = cli(gw.data_dir, "token", "revoke", minted["token_id"])
    assert again.returncode == 1 and "no live token" in again.stderr


def test_another_tenants_job_is_404_like_a_missing_one(gw: Gateway, harness: Harness) -> None:
    with gw.client("acme") as acme:
        job = acme.post("/v1/jobs", json={"kind": "echo"}).json()["job_id"]
        harness_job = _dead(harness, "acme")
    before = _snapshot(harness)
    with gw.client("globex") as globex:
        for target in (job, harness_job):
            for method, path, body in _requests(target):
                if "job_id" not in (body or {}) and target not in path:
                    continue
                r = globex.request(method, path, json=body)
                assert r.status_code == 404, (method, path)
                assert r.json() == {"status": "not_found", "error": f"Job {target} not found"}
        listing = globex.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
        assert all(j["tenant"] == "globex" for j in listing)
        assert globex.get("/api/overview").json()["counts"]["dead_letter"] == 0
        theirs = globex.post("/v1/jobs", json={"kind": "echo", "job_id": job})
    # A caller-chosen id already taken by another tenant is refused, never shared.
    assert theirs.status_code == 400 and theirs.json()["error"] == "invalid_input"
    assert _snapshot(harness) == before
    assert harness.store.get(job, "acme").tenant == "acme"
    assert harness.store.get(harness_job, "acme").status.value == "dead_letter"


def test_a_token_submits_only_as_its_tenant(gw: Gateway, harness: Harness) -> None:
    with gw.client("acme") as acme:
        handle = acme.post("/v1/jobs", json={"kind": "echo"}).json()
        assert harness.store.get(handle["job_id"], None).tenant == "acme"
        same = acme.post("/v1/jobs", json={"kind": "echo", "tenant": "acme"})
        assert same.status_code == 202
        before = _snapshot(harness)
        other = acme.post("/api/graph/jobs", json={"action": "dispatch", "kind": "echo", "tenant": "globex"})
        assert other.status_code == 403 and other.json()["error"] == "tenant_forbidden"
        assert _snapshot(harness) == before


def test_tokens_are_stored_hashed_and_printed_once(gw: Gateway) -> None:
    out = cli(gw.data_dir, "token", "create", "--tenant", "acme", "--label", "ci")
    assert out.returncode == 0
    token = out.stdout.strip()
    assert token.startswith("adt_") and token not in out.stderr
    raw = (gw.data_dir / "agent_dispatch_queue.db").read_bytes()
    assert token.encode() not in raw
    with sqlite3.connect(gw.data_dir / "agent_dispatch_queue.db") as db:
        hashes = {r[0] for r in db.execute("SELECT token_hash FROM api_tokens")}
    assert token not in hashes and len(hashes) >= 1
    assert httpx.get(f"{gw.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    bad = cli(gw.data_dir, "token", "create", "--tenant", "no spaces")
    assert bad.returncode != 0


def test_no_auth_refuses_a_non_loopback_address(tmp_path: Path) -> None:
    out = cli(tmp_path / "data", "gateway", "--host", "0.0.0.0", "--port", str(free_port()), "--no-auth")
    assert out.returncode == 2 and "refusing" in out.stderr
    out = cli(tmp_path / "data", "mcp", "--transport", "streamable-http", "--host", "0.0.0.0")
    assert out.returncode == 2 and "refusing" in out.stderr


def test_no_auth_on_loopback_serves_as_operator(tmp_path: Path) -> None:
    g = start_gateway(tmp_path / "data", "--no-auth")
    try:
        job = httpx.post(f"{g.url}/v1/jobs", json={"kind": "echo", "tenant": "t1"}).json()
        view = httpx.get(f"{g.url}/v1/jobs/{job['job_id']}").json()
        assert view["tenant"] == "t1"
        assert httpx.get(f"{g.url}/api/overview").json()["tenant"] is None
    finally:
        g.stop()


def _dead(h: Harness, tenant: str) -> str:
    from agentdispatch.workitem import Outcome

    handle = h.dispatcher().submit(Submission(kind="boom", tenant=tenant))
    claim = h.store.claim(handle.job_id, tenant, owner="t", ttl_s=30)
    assert claim.lease is not None
    h.store.commit(claim.lease, Outcome(ok=False, error="x", dead_letter_reason="handler_error"))
    return handle.job_id


def test_invalid_body_without_a_valid_token_is_401_not_422(gw: Gateway, harness: Harness) -> None:
    # FastAPI validates bodies before dependencies run: the gateway must still
    # authenticate first, so an outsider learns nothing about the schema.
    before = _snapshot(harness)
    for header in (None, "Bearer not-a-token", "Bearer adt_000000000000_" + "A" * 43):
        headers = {"Authorization": header} if header else {}
        with httpx.Client(base_url=gw.url, headers=headers) as c:
            bad_json = c.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
            bad_field = c.post("/v1/jobs", json={"kind": 42})
            bad_query = c.get("/v1/jobs", params={"limit": "many"})
        for r in (bad_json, bad_field, bad_query):
            assert r.status_code == 401, (header, r.status_code, r.text)
            assert r.json()["error"] == "unauthorized"
    with gw.client("acme") as c:  # a valid token still gets the precise 422
        r = c.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    assert _snapshot(harness) == before
