"""The gateway's fleet-wide turn counters (SPEC section 8), on SQLite and on
PostgreSQL: a real gateway and real worker processes, turns of several
outcomes, and the gateway's operator scrape counts them under
``scope="fleet"``; the counts stay when a worker stops (its row goes) and
when one is killed and a peer reaps it, never going down in between;
promtool accepts every scrape; a tenant's token sees none of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from backends import fresh_pg_database

from .gatewayproc import Gateway, cli, cli_env, start_gateway
from .test_fleet_metrics import PROMTOOL, samples

ROOT = Path(__file__).resolve().parents[2]
METRICS_TOKEN = "f" * 40
FLEET = (("scope", "fleet"),)
TURNS = "agent_utilities_dispatch_turns_total"


def _turns(outcome: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (TURNS, (("outcome", outcome), *FLEET))


QUEUED = ("agent_utilities_dispatch_time_in_queue_seconds_count", FLEET)
ATTEMPTS = ("agent_utilities_dispatch_attempts_count", FLEET)
WORKERS = ("agent_utilities_dispatch_workers", ())


class Fleet:
    """A gateway on one store, the workers started on it, and every
    operator scrape taken (to check that no fleet counter went down)."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = env
        self.data = tmp / "data"
        self.gw: Gateway | None = None
        self.workers: list[subprocess.Popen[str]] = []
        self.scrapes: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]] = []

    def start(self) -> Fleet:
        assert cli(self.data, "migrate", **self.env).returncode == 0
        minted = cli(self.data, "token", "create", "--tenant", "acme", "--json", **self.env)
        assert minted.returncode == 0, minted.stderr
        self.gw = start_gateway(self.data, **self.env)
        self.gw.tokens["acme"] = json.loads(minted.stdout)["token"]
        return self

    def worker(self) -> subprocess.Popen[str]:
        n = len(self.workers)
        env = cli_env(self.data, **self.env, PYTHONPATH=f"{ROOT / 'tests'}:{ROOT / 'src'}")
        with (self.tmp / f"worker{n}.log").open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentdispatch", "worker", "--app", "apps.ops_app:registry"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        self.workers.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join((self.tmp / f"worker{i}.log").read_text() for i in range(len(self.workers)))

    def run(self, *jobs: dict[str, object]) -> None:
        """Submit ``jobs`` as acme and wait until each has ended."""
        assert self.gw is not None
        with self.gw.client("acme") as c:
            ids = [c.post("/v1/jobs", json=job).json()["job_id"] for job in jobs]
            for job_id in ids:
                status = c.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()["status"]
                assert status in ("succeeded", "dead_letter", "cancelled"), (job_id, status, self.logs())

    def scrape(self, token: str = METRICS_TOKEN) -> str:
        assert self.gw is not None
        got = httpx.get(f"{self.gw.url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert got.status_code == 200, got.text
        if token == METRICS_TOKEN:
            self.scrapes.append(samples(got.text))
        return got.text

    def until(self, what: str, check: Callable[[dict[tuple[str, tuple[tuple[str, str], ...]], float]], bool]) -> None:
        """Scrape until ``check`` holds for a scrape (a worker publishes
        within a second or so of its turns ending)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.scrape()
            if check(self.scrapes[-1]):
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}: {self.scrapes[-1]}\n{self.logs()}")

    def stop(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        if self.gw is not None:
            self.gw.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    cleanup: list[Callable[[], None]] = []
    env = {"AGENT_DISPATCH_METRICS_TOKEN": METRICS_TOKEN, "AGENT_DISPATCH_MAX_ATTEMPTS": "1"}
    if request.param == "postgres":
        env.update(TASK_QUEUE_BACKEND="postgres", STATE_DB_URI=fresh_pg_database(cleanup))
    f = Fleet(tmp_path, env)
    try:
        yield f.start()
    finally:
        f.stop()
        for drop in cleanup:
            drop()


def test_the_gateway_counts_every_workers_turns_and_never_goes_down(fleet: Fleet) -> None:
    assert PROMTOOL is not None, "install promtool: apt-get install prometheus"
    first = samples(fleet.scrape())
    # Before any worker: the series are there, at zero.
    assert first[_turns("completed")] == 0 and first[_turns("dead_letter")] == 0 and first[QUEUED] == 0

    one = fleet.worker()
    fleet.run(
        {"kind": "ok", "session_id": "a"},
        {"kind": "ok", "session_id": "b"},
        {"kind": "boom", "session_id": "c"},
        # Its deadline passed before any worker could claim it: expired.
        {"kind": "ok", "session_id": "d", "deadline_unix": time.time() - 1},
    )
    fleet.until(
        "the first worker's turns",
        lambda s: (s[_turns("completed")], s[_turns("dead_letter")], s[_turns("expired")]) == (2, 1, 1),
    )
    now = fleet.scrapes[-1]
    assert (now[QUEUED], now[ATTEMPTS], now[_turns("failed")], now[_turns("poison")]) == (3, 3, 0, 0)
    assert now[("agent_utilities_dispatch_time_in_queue_seconds_bucket", (("le", "+Inf"), *FLEET))] == 3

    # A clean stop removes the worker's row: its counts stay in the fleet's.
    one.send_signal(signal.SIGTERM)
    assert one.wait(timeout=60) == 0, fleet.logs()
    stopped = samples(fleet.scrape())
    assert stopped[WORKERS] == 0
    assert (stopped[_turns("completed")], stopped[_turns("dead_letter")], stopped[QUEUED]) == (2, 1, 3)

    # A worker killed once its turn is published; a peer on this host reaps its row.
    two = fleet.worker()
    fleet.run({"kind": "ok", "session_id": "e"})
    fleet.until("the second worker's turn", lambda s: s[_turns("completed")] == 3)
    os.kill(two.pid, signal.SIGKILL)
    two.wait(timeout=30)
    fleet.worker()
    fleet.until("the killed worker's row reaped", lambda s: s[WORKERS] == 1)
    fleet.run({"kind": "ok", "session_id": "f"})
    fleet.until("the third worker's turn", lambda s: s[_turns("completed")] == 4)
    assert fleet.scrapes[-1][QUEUED] == 5

    # No fleet counter ever went down, over every scrape taken.
    for before, after in zip(fleet.scrapes, fleet.scrapes[1:], strict=False):
        for key, value in before.items():
            if dict(key[1]).get("scope") == "fleet":
                assert after[key] >= value, (key, value, after[key])
    # Only the operator's scrape has them: they are not per tenant.
    mine = samples(fleet.scrape(fleet.gw.token("acme") if fleet.gw else ""))
    assert not [k for k in mine if dict(k[1]).get("scope") == "fleet"]
    assert ("agent_utilities_dispatch_dead_letter", (("tenant", "acme"),)) in mine
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=fleet.scrape(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
