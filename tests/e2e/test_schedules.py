"""Periodic schedules through the public surfaces: HTTP (and the client), the
CLI, and a fleet of two gateways and three workers on one PostgreSQL store
firing exactly one job per tick."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from croniter import croniter

from agentdispatch import Client
from agentdispatch.schedules import ScheduleExists, ScheduleNotFound, tick_job_id
from agentdispatch.stores.base import Schedule
from backends import fresh_pg_database
from e2e.gatewayproc import Gateway, cli, cli_env, start_gateway


def test_schedules_over_http_and_the_client(tmp_path: Path) -> None:
    g = start_gateway(tmp_path / "data")
    try:
        with g.client("acme") as api:
            body = {"name": "digest", "cron": "0 9 * * 1-5", "tz": "Europe/Berlin", "kind": "echo", "payload": {"d": 1}}
            r = api.post("/v1/schedules", json=body)
            assert r.status_code == 201, r.text
            assert r.json()["next_at"] > time.time() and r.json()["tz"] == "Europe/Berlin"
            assert api.post("/v1/schedules", json=body).json()["error"] == "schedule_exists"
            bad = api.post("/v1/schedules", json={**body, "name": "x", "cron": "every day"})
            assert bad.status_code == 400 and bad.json()["error"] == "invalid_input"
            assert api.post("/v1/schedules", json={**body, "name": "no spaces"}).status_code == 422
            assert [s["name"] for s in api.get("/v1/schedules").json()["schedules"]] == ["digest"]
            assert api.post("/v1/schedules/digest/pause").json()["paused"] is True
            assert api.get("/v1/schedules/digest").json()["next_at"] is None
            assert api.post("/v1/schedules/digest/resume").json()["paused"] is False
        with g.client("other") as other:
            assert other.get("/v1/schedules").json()["schedules"] == []
            assert other.get("/v1/schedules/digest").status_code == 404
        with Client(g.url, g.token("acme")) as c:
            assert c.schedule_get("digest")["kind"] == "echo"
            with pytest.raises(ScheduleExists):
                c.schedule_add("digest", "* * * * *", "echo")
            added = c.schedule_add("hourly", "0 * * * *", "echo", {"h": 1}, session_id="hourly")
            assert added["session_id"] == "hourly"
            assert [s["name"] for s in c.schedules()] == ["digest", "hourly"]
            assert c.schedule_pause("hourly")["paused"] is True
            assert c.schedule_delete("hourly")["name"] == "hourly"
            with pytest.raises(ScheduleNotFound):
                c.schedule_resume("hourly")
    finally:
        g.stop()


def test_schedule_commands(tmp_path: Path) -> None:
    data = tmp_path / "data"

    def ok(*args: str) -> Any:
        out = cli(data, "schedule", *args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    view = ok("add", "beat", "echo", "--cron", "*/5 * * * *", "--tz", "Europe/Berlin", "--payload", '{"b": 1}')
    assert view["payload"] == {"b": 1} and view["cron"] == "*/5 * * * *"
    assert [v["name"] for v in ok("list")] == ["beat"]
    assert ok("pause", "beat")["paused"] is True
    assert ok("resume", "beat")["paused"] is False
    human = cli(data, "schedule", "list")
    assert human.returncode == 0 and "beat" in human.stdout
    # People read times as ISO 8601 (UTC); --json keeps the Unix number.
    added = cli(data, "schedule", "add", "yearly", "echo", "--cron", "0 0 1 1 *")
    assert added.returncode == 0, added.stderr
    next_at = {v["name"]: v["next_at"] for v in ok("list")}["yearly"]
    iso = datetime.fromtimestamp(next_at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert f"next at {iso}" in added.stdout, added.stdout
    table = cli(data, "schedule", "list", COLUMNS="200")
    assert iso in table.stdout and str(next_at) not in table.stdout, table.stdout
    assert ok("delete", "yearly")["name"] == "yearly"
    for args, mention in (
        (["add", "x", "echo", "--cron", "61 * * * *"], "cron"),
        (["add", "x", "echo", "--cron", "* * * * *", "--tz", "Mars/Base"], "time zone"),
        (["add", "x", "no-such-kind", "--cron", "* * * * *"], "unknown kind"),
        (["add", "beat", "echo", "--cron", "* * * * *"], "exists"),
        (["pause", "ghost"], "not found"),
    ):
        out = cli(data, "schedule", *args)
        assert out.returncode != 0 and out.stderr.startswith("error: ") and mention in out.stderr, out.stderr
    assert ok("delete", "beat")["name"] == "beat"
    assert ok("list") == []


def _poll(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_job_per_tick_across_two_gateways_and_three_workers(tmp_path: Path) -> None:
    cleanup: list[Callable[[], None]] = []
    env = {"TASK_QUEUE_BACKEND": "postgres", "STATE_DB_URI": fresh_pg_database(cleanup)}
    data = tmp_path / "cli"
    gateways: list[Gateway] = []
    workers: list[subprocess.Popen[str]] = []
    try:
        assert cli(data, "migrate", **env).returncode == 0
        minted = cli(data, "token", "create", "--tenant", "acme", "--json", **env)
        token = json.loads(minted.stdout)["token"]
        gateways = [start_gateway(tmp_path / f"gw{i}", **env) for i in range(2)]
        for i in range(3):
            with (tmp_path / f"worker{i}.log").open("w") as log:
                workers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "agentdispatch", "worker", "--workers", "1"],
                        env=cli_env(tmp_path / f"w{i}", **env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        with Client(gateways[0].url, token) as c:
            view = c.schedule_add("beat", "*/2 * * * * *", "echo", {"beat": True})

            def fired() -> list[dict[str, object]]:
                return list(c.jobs(kind="echo", limit=500)["jobs"])

            _poll(lambda: sum(j["status"] == "succeeded" for j in fired()) >= 4, 90, "four ticks to run")
            out = cli(data, "schedule", "pause", "beat", "--tenant", "acme", **env)
            assert out.returncode == 0, out.stderr
            paused = c.schedule_get("beat")
            jobs = fired()
        # Every job is the job of one tick of the schedule: five firers made
        # no second job for any tick, and fired nothing beside the ticks.
        sched = Schedule("acme", "beat", view["cron"], "UTC", "echo", None, next_at=0.0, created_at=view["created_at"])
        start = datetime.fromtimestamp(view["created_at"], UTC)
        ticks = croniter(view["cron"], start)
        expected: dict[str, float] = {}
        while True:
            tick = float(ticks.get_next(float))
            if tick > paused["last_tick"]:
                break
            expected[tick_job_id(sched, tick)] = tick
        ids = [str(j["job_id"]) for j in jobs]
        assert len(ids) >= 4 and len(set(ids)) == len(ids)
        assert set(ids) <= set(expected), set(ids) - set(expected)
        assert paused["last_job_id"] in ids
        assert all(j["payload_ref"] == j["job_id"] for j in jobs)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        for g in gateways:
            g.stop()
        for fn in cleanup:
            fn()
    for i in range(3):
        assert "Traceback" not in (tmp_path / f"worker{i}.log").read_text()
    for g in gateways:
        assert "Traceback" not in g.log()
