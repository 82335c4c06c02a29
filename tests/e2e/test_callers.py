"""What callers expect of a job system (issue 20), through the public
surfaces: a real gateway subprocess, real workers, the CLI as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from e2e.gatewayproc import Gateway, cli, cli_env, start_gateway


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


def _worker(data: Path, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "worker", "--workers", "2"],
            env=cli_env(data),
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_a_long_poll_answers_when_a_worker_commits(tmp_path: Path) -> None:
    g = start_gateway(tmp_path / "data")
    worker: subprocess.Popen[str] | None = None
    try:
        with g.client("acme") as api:
            job = api.post("/v1/jobs", json={"kind": "echo", "payload": {"v": 7}}).json()["job_id"]
            # No worker yet: the wait ends with the job still ready.
            assert api.get(f"/v1/jobs/{job}", params={"wait": 0.3}).json()["status"] == "ready"
            assert api.get(f"/v1/jobs/{job}", params={"wait": 61}).status_code == 422

            answers: list[dict[str, object]] = []
            in_flight = threading.Event()

            def long_poll() -> None:
                with httpx.Client(base_url=g.url, headers=api.headers, timeout=60) as c:
                    in_flight.set()
                    answers.append(c.get(f"/v1/jobs/{job}", params={"wait": 30}).json())

            poller = threading.Thread(target=long_poll)
            poller.start()
            assert in_flight.wait(10)
            # A waiting request holds no thread the gateway needs: others still answer.
            for _ in range(50):
                assert api.get(f"/v1/jobs/{job}").json()["status"] == "ready"
            assert not answers
            worker = _worker(g.data_dir, tmp_path / "worker.log")
            poller.join(60)
            assert not poller.is_alive()
            assert answers[0]["status"] == "succeeded" and answers[0]["result"] == {"v": 7}
    finally:
        if worker is not None:
            _stop(worker)
        g.stop()


def test_cli_status_wait_returns_once_the_job_ended(tmp_path: Path) -> None:
    data = tmp_path / "data"
    job = json.loads(cli(data, "submit", "echo", "--payload", '{"w": 1}', "--json").stdout)["job_id"]
    assert json.loads(cli(data, "status", job, "--wait", "0.2", "--json").stdout)["status"] == "ready"
    bad = cli(data, "status", job, "--wait", "99")
    assert bad.returncode != 0 and "--wait" in bad.stderr
    waiting = subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "status", job, "--wait", "30", "--json"],
        env=cli_env(data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = _worker(data, tmp_path / "worker.log")
    try:
        out, err = waiting.communicate(timeout=60)
    finally:
        _stop(worker)
    assert waiting.returncode == 0, err
    view = json.loads(out)
    assert view["status"] == "succeeded" and view["result"] == {"w": 1}


def test_delays_over_http(api: httpx.Client) -> None:
    h = api.post("/v1/jobs", json={"kind": "echo", "delay_s": 3600}).json()
    view = api.get(f"/v1/jobs/{h['job_id']}").json()
    assert view["status"] == "ready" and view["ready_at"] >= view["created_at"] + 3600
    when = 4_000_000_000.5
    g = api.post("/api/graph/jobs", json={"action": "dispatch", "kind": "echo", "not_before": when}).json()
    assert api.get(f"/v1/jobs/{g['job_id']}").json()["ready_at"] == when
    for bad in ({"delay_s": -1}, {"not_before": -5}, {"delay_s": 1, "not_before": when}):
        r = api.post("/v1/jobs", json={"kind": "echo", **bad})
        assert r.status_code in (400, 422) and r.json()["status"] == "error"


def test_delays_from_the_cli(tmp_path: Path) -> None:
    data = tmp_path / "data"

    def submit(*args: str) -> dict[str, object]:
        out = cli(data, "submit", "echo", *args, "--json")
        assert out.returncode == 0, out.stderr
        job = json.loads(out.stdout)["job_id"]
        return dict(json.loads(cli(data, "status", job, "--json").stdout))

    view = submit("--delay", "2h")
    assert float(view["ready_at"]) >= float(view["created_at"]) + 7200  # type: ignore[arg-type]
    assert submit("--at", "2096-10-02T07:06:40+00:00")["ready_at"] == 4_000_000_000
    assert submit("--at", "2096-10-02T07:06:40Z")["ready_at"] == 4_000_000_000
    for args in (["--delay", "soon"], ["--at", "tomorrow"], ["--delay", "1s", "--at", "2096-10-02T07:06:40Z"]):
        bad = cli(data, "submit", "echo", *args)
        assert bad.returncode != 0 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


def test_delays_over_mcp(tmp_path: Path) -> None:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    data = tmp_path / "data"
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "agentdispatch", "mcp", "--tenant", "acme"], env=cli_env(data)
    )

    async def session() -> dict[str, object]:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            args = {"action": "dispatch", "kind": "echo", "delay_s": 600}
            handle = (await s.call_tool("graph_orchestrate", args)).structured_content
            assert handle is not None
            status = {"action": "status", "job_id": handle["job_id"]}
            view = (await s.call_tool("graph_jobs", status)).structured_content
            assert view is not None
            return dict(view)

    view = anyio.run(session)
    assert float(view["ready_at"]) >= float(view["created_at"]) + 600  # type: ignore[arg-type]


def test_search_over_http_and_the_cli(tmp_path: Path) -> None:
    g = start_gateway(tmp_path / "data")
    try:
        with g.client("acme") as api:
            wanted = [
                api.post("/v1/jobs", json={"kind": "report", "session_id": "s-q", "agent_name": "ann"}).json()["job_id"]
                for _ in range(2)
            ]
            batch = {"jobs": [{"kind": "echo"} for _ in range(40)]}
            assert api.post("/v1/jobs/batch", json=batch).status_code == 202
            api.post("/v1/jobs", json={"kind": "echo", "job_id": "find-me-7"})

            def ids(**params: object) -> list[str]:
                r = api.get("/v1/jobs", params={"limit": 10, **params})
                assert r.status_code == 200, r.text
                return [j["job_id"] for j in r.json()["jobs"]]

            assert ids(kind="report") == wanted[::-1]
            assert ids(session_id="s-q", agent_name="ann", status="ready") == wanted[::-1]
            assert ids(q="find-me") == ["find-me-7"]
            assert ids(kind="report", created_before=1) == []
            assert len(ids(created_after=1, limit=50)) == 43
            assert api.get("/v1/jobs", params={"created_after": "yesterday"}).status_code == 422
        out = cli(g.data_dir, "jobs", "--tenant", "acme", "--kind", "report", "--since", "1h", "--json")
        assert out.returncode == 0, out.stderr
        assert [j["job_id"] for j in json.loads(out.stdout)] == wanted[::-1]
        out = cli(g.data_dir, "jobs", "--tenant", "acme", "--search", "find-me", "--until", "2999-01-01", "--json")
        assert [j["job_id"] for j in json.loads(out.stdout)] == ["find-me-7"]
        bad = cli(g.data_dir, "jobs", "--since", "last tuesday")
        assert bad.returncode != 0 and bad.stderr.startswith("error: --since")
    finally:
        g.stop()
