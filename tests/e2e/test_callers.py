"""What callers expect of a job system (issue 20), through the public
surfaces: a real gateway subprocess, real workers, the CLI as a subprocess."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.gatewayproc import Gateway, cli, start_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("callers") / "data")
    yield g
    g.stop()


@pytest.fixture()
def api(gw: Gateway) -> Iterator[httpx.Client]:
    with gw.client("acme") as c:
        yield c


def test_a_reused_idempotency_key_with_another_body_is_409(api: httpx.Client) -> None:
    key = {"Idempotency-Key": "conflict-1"}
    a = api.post("/v1/jobs", json={"kind": "echo", "payload": {"n": 1}}, headers=key)
    assert a.status_code == 202
    same = api.post("/v1/jobs", json={"kind": "echo", "payload": {"n": 1}}, headers=key)
    assert same.status_code == 202 and same.json() == a.json()
    other = api.post("/v1/jobs", json={"kind": "echo", "payload": {"n": 2}}, headers=key)
    assert other.status_code == 409
    body = other.json()
    assert body["error"] == "idempotency_conflict" and body["job_id"] == a.json()["job_id"]
    assert "payload" in body["message"]
    # The caller-chosen job id and the graph endpoint answer the same way.
    assert api.post("/v1/jobs", json={"kind": "echo", "job_id": "mine-1"}).status_code == 202
    r = api.post("/api/graph/jobs", json={"action": "dispatch", "kind": "echo", "job_id": "mine-1", "priority": 5})
    assert r.status_code == 409 and r.json()["error"] == "idempotency_conflict"
    # Nothing changed.
    assert api.get(f"/v1/jobs/{a.json()['job_id']}").json()["result"] is None
    assert api.get("/v1/jobs/mine-1").json()["priority"] == 0


def test_the_cli_refuses_a_conflicting_resubmission(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = cli(data, "submit", "echo", "--job-id", "cli-1", "--payload", '{"a": 1}', "--json")
    assert first.returncode == 0, first.stderr
    again = cli(data, "submit", "echo", "--job-id", "cli-1", "--payload", '{"a": 1}', "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["job_id"] == "cli-1"
    clash = cli(data, "submit", "echo", "--job-id", "cli-1", "--payload", '{"a": 2}')
    assert clash.returncode != 0
    assert "Traceback" not in clash.stderr
    assert clash.stderr.startswith("error: job cli-1 already exists with a different payload")
