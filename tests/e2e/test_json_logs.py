"""AGENT_DISPATCH_LOG_FORMAT=json: a real worker process writes one JSON
object per line, with the turn's fields on the lines logged inside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .gatewayproc import cli, cli_env

ROOT = Path(__file__).resolve().parents[2]


def test_json_log_lines_carry_the_turn(tmp_path: Path) -> None:
    env = {"AGENT_DISPATCH_LOG_FORMAT": "json", "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT / 'src'}"}
    submitted = cli(tmp_path, "submit", "ok", "--tenant", "acme", "--app", "apps.ops_app:registry", **env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "worker", "--app", "apps.ops_app:registry"],
            env=cli_env(tmp_path, **env),
            stdout=out,
            stderr=out,
        )
    try:
        done = cli(tmp_path, "status", job_id, "--tenant", "acme", "--wait", "30", "--json", **env)
        assert done.returncode == 0, done.stderr + log.read_text()
        assert json.loads(done.stdout)["status"] == "succeeded", log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    # Every line the logging system wrote is JSON (the start/stop banners are click's, not logs).
    assert all(line.startswith("{") or line.startswith("worker ") for line in log.read_text().splitlines())
    turn = [r for r in records if r["message"] == "handling a turn"]
    assert len(turn) == 1
    assert turn[0]["job_id"] == job_id and turn[0]["tenant"] == "acme"
    assert turn[0]["attempt"] == 1 and turn[0]["epoch"] >= 1 and turn[0]["session_id"]
    assert turn[0]["level"] == "INFO" and turn[0]["logger"] == "ops_app"
