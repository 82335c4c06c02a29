"""The operator's CLI through real subprocesses: 80-column tables, human
times, --all-tenants, exit codes and the intake key checked at start."""

from __future__ import annotations

import json
from pathlib import Path

from .gatewayproc import cli


def test_tables_fit_80_columns_and_show_whole_ids(tmp_path: Path) -> None:
    ids = [cli(tmp_path, "submit", "echo", "--tenant", t).stdout.strip() for t in ("acme", "globex")]
    out = cli(tmp_path, "jobs", "--all-tenants").stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    for job_id in ids:
        assert job_id in out
    assert "globex" in out and "…" not in out.split("\n")[1]  # the header reads whole
    mine = cli(tmp_path, "jobs", "--tenant", "acme").stdout
    assert ids[0] in mine and ids[1] not in mine


def test_status_shows_iso_times_and_json_keeps_numbers(tmp_path: Path) -> None:
    job_id = cli(tmp_path, "submit", "echo").stdout.strip()
    human = cli(tmp_path, "status", job_id, "--history").stdout
    created = next(line for line in human.splitlines() if "created_at:" in line)
    assert created.strip().endswith("Z") and "T" in created
    assert "None" not in human and "[]" not in human and "{'" not in human
    raw = json.loads(cli(tmp_path, "status", job_id, "--json").stdout)
    assert isinstance(raw["created_at"], float)


def test_dlq_list_points_at_other_tenants(tmp_path: Path) -> None:
    out = cli(tmp_path, "dlq", "list")
    assert out.returncode == 0 and "other tenants" not in out.stdout  # nothing dead anywhere


def test_exit_codes_tell_usage_from_unreachable(tmp_path: Path) -> None:
    assert cli(tmp_path, "jobs", "--no-such-flag").returncode == 2
    garbage = tmp_path / "agent_dispatch_queue.db"
    garbage.write_bytes(b"not a database" * 100)
    assert cli(tmp_path, "jobs").returncode != 2


def test_a_short_intake_key_fails_doctor_and_start(tmp_path: Path) -> None:
    doctor = cli(tmp_path, "doctor", AGENT_DISPATCH_INTAKE_KEY="short")
    assert doctor.returncode == 1
    assert "FAIL settings: AGENT_DISPATCH_INTAKE_KEY must be 64 hex characters" in doctor.stdout
    assert "short" not in doctor.stdout  # the key itself is never echoed
    start = cli(tmp_path, "gateway", "--port", "0", AGENT_DISPATCH_INTAKE_KEY="short")
    assert start.returncode == 1 and "AGENT_DISPATCH_INTAKE_KEY" in start.stderr
    good = cli(tmp_path, "doctor", AGENT_DISPATCH_INTAKE_KEY="ab" * 32)
    assert "FAIL settings" not in good.stdout
