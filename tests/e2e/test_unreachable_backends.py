"""An explicitly chosen backend that cannot be reached stops the worker (or
a CLI command) with exit code 69 and one clear line that names the setting and
the cause and echoes no endpoint and no credential; a STATE_DB_URI that is not
a PostgreSQL URI is a settings error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from pg import fresh_schema
from ports import free_port

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"TASK_QUEUE_BACKEND": "kafka", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}, "KAFKA_BOOTSTRAP_SERVERS"),
        ({"STATE_DB_URI": f"postgresql://admin:{SECRET}@127.0.0.1:1/nowhere?connect_timeout=1"}, "STATE_DB_URI"),
    ],
    ids=["kafka", "postgres"],
)
def test_worker_preflight_fails_loudly_without_echoing_endpoints(
    tmp_path: Path, env: dict[str, str], names: str
) -> None:
    full = {**os.environ, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), "XDG_DATA_HOME": str(tmp_path), **env}
    proc = subprocess.run(
        ["agent-dispatch-worker", "--workers", "1"], env=full, capture_output=True, text=True, timeout=120, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out  # SPEC section 7
    assert names in out
    assert "Traceback" not in out
    assert "127.0.0.1:1" not in out and SECRET not in out and "admin" not in out


def _missing_database() -> str:
    base = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
    return base.rsplit("/", 1)[0] + "/agentdispatch_no_such_database_" + uuid.uuid4().hex[:8]


@pytest.mark.parametrize(
    ("uri", "line", "code"),
    [
        (
            lambda: f"postgresql://admin:{SECRET}@127.0.0.1:{free_port()}/nowhere",
            "error: cannot connect to PostgreSQL at STATE_DB_URI: connection refused",
            69,  # EX_UNAVAILABLE
        ),
        (_missing_database, "error: cannot connect to PostgreSQL at STATE_DB_URI: no such database", 69),
        (lambda: f"mysql://admin:{SECRET}@127.0.0.1/db", "error: STATE_DB_URI must be a postgresql:// URI", 1),
    ],
    ids=["refused", "no-database", "bad-scheme"],
)
@pytest.mark.parametrize("command", [["jobs"], ["migrate"]])
def test_cli_names_the_setting_and_the_cause_in_one_line(
    tmp_path: Path, uri: Callable[[], str], line: str, code: int, command: list[str]
) -> None:
    """Before: 20-30 s of retries, about ten pool warnings, then a timeout or
    a wrong "no schema; run migrate". Now one line with the real cause."""
    env = {**os.environ, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), "STATE_DB_URI": uri()}
    env.pop("TASK_QUEUE_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-m", "agentdispatch", *command], env=env, capture_output=True, text=True, timeout=120
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == code, out
    assert out.splitlines() == [out] and out.startswith(line), out  # one line, no pool warnings
    assert "pool" not in out.lower() and "schema" not in out
    assert SECRET not in out and "admin" not in out


def test_doctor_blames_an_unreachable_broker_on_the_transport_not_the_store(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path),
        "TASK_QUEUE_BACKEND": "kafka",
        "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
    }
    env.pop("STATE_DB_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "agentdispatch", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The store (SQLite here) is fine and says so; only the transport fails.
    assert "OK   store: sqlite reachable" in lines and "OK   schema: version" in proc.stdout
    assert [ln for ln in lines if ln.startswith("FAIL")] == [
        "FAIL transport: Kafka is unreachable: check KAFKA_BOOTSTRAP_SERVERS and that the broker is running"
    ]
    assert "OK   workers: 0 live" in lines


def test_a_server_that_is_not_postgresql_is_named_as_such(tmp_path: Path) -> None:
    """An HTTP server at STATE_DB_URI used to give a bare ``OperationalError``."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_http() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    env = {
        **os.environ,
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path),
        "STATE_DB_URI": f"postgresql://u@127.0.0.1:{port}/db",
    }
    env.pop("TASK_QUEUE_BACKEND", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "jobs"], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        listener.close()
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 69, out
    assert out == (
        "error: cannot connect to PostgreSQL at STATE_DB_URI: the server there does not speak the PostgreSQL protocol"
    ), out


def test_commands_that_need_only_the_store_work_while_the_broker_is_down(tmp_path: Path) -> None:
    """An operator looks at and cancels jobs during a Kafka outage: the
    WorkItems live in the store. Only a submission needs the broker."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        full = {**os.environ, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), **env}
        full.pop("STATE_DB_URI", None)
        return subprocess.run(
            [sys.executable, "-m", "agentdispatch", *args], env=full, capture_output=True, text=True, timeout=120
        )

    job = run("submit", "echo", TASK_QUEUE_BACKEND="sqlite").stdout.strip()
    assert job.startswith("dispatch-"), job
    down = {"TASK_QUEUE_BACKEND": "kafka", "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"}
    for args in (["status", job], ["jobs"], ["dlq", "list"], ["cancel", job], ["token", "create", "--tenant", "t"]):
        proc = run(*args, "--json", **down) if args[0] != "token" else run(*args, **down)
        assert proc.returncode == 0, (args, proc.stdout + proc.stderr)
    assert json.loads(run("status", job, "--json", **down).stdout)["status"] == "cancelled"
    refused = run("submit", "echo", **down)
    assert refused.returncode == 69 and "KAFKA_BOOTSTRAP_SERVERS" in refused.stderr, refused.stderr


@pytest.mark.parametrize("command", [["jobs"], ["status", "dispatch-x"], ["dlq", "list"], ["schedule", "list"]])
def test_a_store_never_migrated_says_to_run_migrate(tmp_path: Path, command: list[str]) -> None:
    """A new operator who skipped `agentdispatch migrate` read "PostgreSQL read
    failed (UndefinedTable, SQLSTATE 42P01); see the PostgreSQL server's log"
    from every read command (a submission already said what to do)."""
    with fresh_schema() as uri:
        env = {**os.environ, "AGENT_DISPATCH_DATA_DIR": str(tmp_path), "STATE_DB_URI": uri}
        env.pop("TASK_QUEUE_BACKEND", None)
        proc = subprocess.run(
            [sys.executable, "-m", "agentdispatch", *command], env=env, capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 69, proc.stdout + proc.stderr
    assert "run `agentdispatch migrate`" in proc.stderr, proc.stderr
