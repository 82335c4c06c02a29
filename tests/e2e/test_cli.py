"""The ``agentdispatch`` and ``agent-dispatch-worker`` commands as real processes.

Every process gets ``AGENT_DISPATCH_DATA_DIR`` / ``XDG_DATA_HOME`` / ``HOME`` under
``tmp_path`` so nothing touches the real home directory.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CONFIG_VARS = (
    "TASK_QUEUE_BACKEND",
    "STATE_DB_URI",
    "KAFKA_BOOTSTRAP_SERVERS",
    "AGENT_TURNS_PARTITIONS",
    "AGENT_DISPATCH_MAX_DEPTH",
    "AGENT_DISPATCH_CLAIM_TTL_S",
    "AGENT_DISPATCH_RENEW_INTERVAL_S",
    "AGENT_DISPATCH_MAX_ATTEMPTS",
    "AGENT_DISPATCH_APP",
    "MESH_MAX_TURNS_PER_AGENT",
    "MESH_MAX_TURNS",
)
HANDLE_KEYS = {"job_id", "session_id", "kind", "dispatch", "status", "status_url", "status_request"}
TIMEOUT = 60


@dataclass
class Cli:
    """Runs the commands against one data directory."""

    root: Path
    data_dir: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k.upper() not in CONFIG_VARS}
        env.update(
            AGENT_DISPATCH_DATA_DIR=str(self.data_dir),
            XDG_DATA_HOME=str(self.root / "xdg"),
            HOME=str(self.root / "home"),
            PYTHONWARNINGS="error",
        )
        env.update(extra)
        return env

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["agentdispatch", *args],
            env=self.env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

    def ok(self, *args: str, env: dict[str, str] | None = None) -> str:
        proc = self.run(*args, env=env)
        assert proc.returncode == 0, f"{args}: rc={proc.returncode}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr
        return proc.stdout

    def json(self, *args: str, env: dict[str, str] | None = None) -> Any:
        return json.loads(self.ok(*args, "--json", env=env))

    def submit(self, *args: str) -> str:
        return str(self.json("submit", *args)["job_id"])

    def job_count(self, *args: str) -> int:
        return len(self.json("jobs", "--limit", "1000", *args))

    def spawn(self, argv: list[str], log: Path, **extra: str) -> subprocess.Popen[str]:
        with log.open("w") as fh:
            return subprocess.Popen(argv, env=self.env(**extra), stdout=fh, stderr=subprocess.STDOUT, text=True)


def _cli(root: Path) -> Cli:
    for d in ("xdg", "home"):
        (root / d).mkdir(parents=True, exist_ok=True)
    return Cli(root=root, data_dir=root / "data")


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return _cli(tmp_path)


def assert_clean_error(proc: subprocess.CompletedProcess[str], *, mentions: str | None = None) -> str:
    """A user mistake: non-zero exit, one clear line on stderr, no traceback."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].lower().startswith("error"), lines[0]
    if mentions is not None:
        assert mentions in lines[0]
    return lines[0]


def stop(proc: subprocess.Popen[str], log: Path) -> int:
    """SIGTERM and wait; kill (and fail) if it does not exit."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("worker ignored SIGTERM:\n" + log.read_text()) from None


@pytest.fixture
def worker_proc(cli: Cli) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(argv: list[str], log: Path, **extra: str) -> subprocess.Popen[str]:
        proc = cli.spawn(argv, log, **extra)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- submit / status / cancel / jobs --------------------------------------------------


def test_submit_prints_a_job_handle(cli: Cli) -> None:
    handle = cli.json("submit", "echo", "--payload", '{"text": "hi"}', "--session", "chat-1")
    assert set(handle) == HANDLE_KEYS
    job_id = handle["job_id"]
    assert re.fullmatch(r"dispatch-[0-9a-f]{32}", job_id)
    assert handle == {
        "job_id": job_id,
        "session_id": "chat-1",
        "kind": "echo",
        "dispatch": "queued",
        "status": "pending",
        "status_url": "/api/graph/jobs",
        "status_request": {"action": "status", "job_id": job_id},
    }
    human = cli.ok("submit", "echo").strip()
    assert re.fullmatch(r"dispatch-[0-9a-f]{32}", human)
    # an idempotency key makes a retried submission return the same job
    a = cli.submit("echo", "--idempotency-key", "order-7")
    assert cli.submit("echo", "--idempotency-key", "order-7") == a
    assert cli.job_count() == 3


def test_status_cancel_and_jobs_filter(cli: Cli) -> None:
    j1 = cli.submit("echo", "--payload", '{"n": 1}', "--session", "s1", "--tenant", "acme")
    j2 = cli.submit("echo", "--payload", '{"n": 2}', "--session", "s1", "--tenant", "acme")
    view = cli.json("status", j1, "--tenant", "acme")
    assert (view["job_id"], view["status"], view["tenant"], view["session_id"]) == (j1, "ready", "acme", "s1")
    assert not any(k.startswith("lease") for k in view)
    assert "status" in cli.ok("status", j1, "--tenant", "acme")

    cancelled = cli.json("cancel", j2, "--tenant", "acme")
    assert (cancelled["status"], cancelled["reason"]) == ("cancelled", "cancelled")
    assert cli.ok("cancel", j2, "--tenant", "acme").strip() == f"{j2}: cancelled"  # terminal: unchanged

    assert [j["job_id"] for j in cli.json("jobs", "--tenant", "acme", "--status", "cancelled")] == [j2]
    assert [j["job_id"] for j in cli.json("jobs", "--tenant", "acme", "--status", "ready")] == [j1]
    assert cli.json("jobs", "--status", "ready") == []  # tenant "default" sees nothing of acme
    assert [j["job_id"] for j in cli.json("jobs", "--tenant", "acme")] == [j2, j1]  # newest first
    history = cli.json("status", j2, "--tenant", "acme", "--history")
    assert [e["event"] for e in history["events"]] == ["submitted", "cancelled"]


def test_cancel_cascades_to_dependants(cli: Cli) -> None:
    parent = cli.submit("echo")
    child = cli.submit("echo", "--depends-on", parent)
    assert cli.json("status", child)["status"] == "submitted"
    cli.ok("cancel", parent)
    child_view = cli.json("status", child)
    assert child_view["status"] == "cancelled"
    assert parent in child_view["reason"]


# -- bad input: a clear error, nothing changed ------------------------------------------


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cli, str]:
    cli = _cli(tmp_path_factory.mktemp("bad-input"))
    return cli, cli.submit("echo", "--payload", '{"keep": true}', "--session", "keep")


BAD_INPUT: list[tuple[str, list[str], dict[str, str], str | None]] = [
    ("malformed-payload", ["submit", "echo", "--payload", '{"a": '], {}, "--payload"),
    ("nan-payload", ["submit", "echo", "--payload", "NaN"], {}, "payload"),
    # Deeper than Python's JSON parser recurses: a clear line, not a traceback.
    ("deep-payload", ["submit", "echo", "--payload", "[" * 5000 + "]" * 5000], {}, "--payload nests too deeply"),
    (
        "deep-schedule-payload",
        ["schedule", "add", "deep", "echo", "--cron", "* * * * *", "--payload", "[" * 5000 + "]" * 5000],
        {},
        "--payload nests too deeply",
    ),
    ("unknown-kind", ["submit", "no_such_kind"], {}, "no_such_kind"),
    ("bad-kind", ["submit", "bad kind!"], {}, "kind"),
    ("bad-tenant", ["submit", "echo", "--tenant", "two words"], {}, "tenant"),
    ("bad-priority", ["submit", "echo", "--priority", "1000"], {}, "priority"),
    ("bad-deadline", ["submit", "echo", "--deadline", "-5"], {}, "deadline"),
    ("missing-dependency", ["submit", "echo", "--depends-on", "dispatch-" + "0" * 32], {}, "dependency"),
    ("unknown-job-status", ["status", "dispatch-" + "f" * 32], {}, "not found"),
    ("unknown-job-cancel", ["cancel", "dispatch-" + "f" * 32], {}, "not found"),
    ("unknown-job-replay", ["dlq", "replay", "dispatch-" + "f" * 32], {}, "not found"),
    ("negative-depth", ["submit", "echo"], {"AGENT_DISPATCH_MAX_DEPTH": "-1"}, "AGENT_DISPATCH_MAX_DEPTH"),
    ("zero-ttl", ["submit", "echo"], {"AGENT_DISPATCH_CLAIM_TTL_S": "0"}, "AGENT_DISPATCH_CLAIM_TTL_S"),
    ("ttl-over-rto", ["submit", "echo"], {"AGENT_DISPATCH_CLAIM_TTL_S": "400"}, "AGENT_DISPATCH_CLAIM_TTL_S"),
    ("text-attempts", ["submit", "echo"], {"AGENT_DISPATCH_MAX_ATTEMPTS": "many"}, "AGENT_DISPATCH_MAX_ATTEMPTS"),
    ("text-renew", ["jobs"], {"AGENT_DISPATCH_RENEW_INTERVAL_S": "soon"}, "AGENT_DISPATCH_RENEW_INTERVAL_S"),
    ("renew-over-ttl", ["jobs"], {"AGENT_DISPATCH_RENEW_INTERVAL_S": "200"}, "AGENT_DISPATCH_RENEW_INTERVAL_S"),
    ("unknown-backend", ["submit", "echo"], {"TASK_QUEUE_BACKEND": "redis"}, "TASK_QUEUE_BACKEND"),
    ("zero-batch", ["worker", "--batch", "0"], {}, "--batch"),
    ("bad-worker-name", ["worker", "--name", "pod:0"], {}, "--name"),
    ("bad-worker-name-env", ["worker"], {"AGENT_DISPATCH_WORKER_NAME": "a@b"}, "AGENT_DISPATCH_WORKER_NAME"),
]


@pytest.mark.parametrize(("args", "env", "mentions"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_clear_line_and_changes_nothing(
    seeded: tuple[Cli, str], args: list[str], env: dict[str, str], mentions: str | None
) -> None:
    cli, kept = seeded
    assert_clean_error(cli.run(*args, env=env), mentions=mentions)
    after = cli.json("jobs", "--limit", "1000")
    assert [(j["job_id"], j["status"], j["attempt"]) for j in after] == [(kept, "ready", 0)]


def test_wrong_tenant_looks_like_a_missing_job(seeded: tuple[Cli, str]) -> None:
    cli, kept = seeded
    line = assert_clean_error(cli.run("status", kept, "--tenant", "other"))
    assert line == f"error: Job {kept} not found"
    missing = assert_clean_error(cli.run("status", "dispatch-" + "e" * 32))
    assert missing == f"error: Job {'dispatch-' + 'e' * 32} not found"
    assert_clean_error(cli.run("cancel", kept, "--tenant", "other"), mentions="not found")
    assert_clean_error(cli.run("dlq", "replay", kept, "--tenant", "other"), mentions="not found")
    assert cli.json("status", kept)["status"] == "ready"  # the cancel did not land


def test_replay_of_a_job_that_is_not_dead_lettered_is_refused(seeded: tuple[Cli, str]) -> None:
    cli, kept = seeded
    assert_clean_error(cli.run("dlq", "replay", kept), mentions="dead_letter")
    assert cli.json("status", kept)["status"] == "ready"


def test_oversized_payload_is_refused_through_the_python_api_of_the_cli_process(cli: Cli) -> None:
    # Linux caps one argv string at 128 KiB, so `submit --payload` cannot carry 1 MiB;
    # run the same entry point the CLI uses in a real process instead.
    code = (
        "import sys\n"
        "from agentdispatch.cli.app import App\n"
        "from agentdispatch import Submission, PayloadTooLarge\n"
        "d = App().dispatcher(check_kinds=True)\n"
        "try:\n"
        "    d.submit(Submission(kind='echo', payload='x' * (1024 * 1024)))\n"
        "except PayloadTooLarge as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    before = cli.job_count()
    proc = subprocess.run(
        ["python", "-c", code], env=cli.env(), capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert proc.returncode == 3, proc.stderr
    assert "1048576" in proc.stdout
    assert cli.job_count() == before


def test_oversized_payload_from_a_file_is_refused(cli: Cli) -> None:
    big = cli.root / "big.json"
    big.write_text(json.dumps({"blob": "x" * (1024 * 1024)}))
    before = cli.job_count()
    assert_clean_error(cli.run("submit", "echo", "--payload", f"@{big}"), mentions="1048576")
    assert cli.job_count() == before


def test_payload_file_that_is_not_utf8_is_refused(cli: Cli) -> None:
    latin1 = cli.root / "latin1.json"
    latin1.write_bytes('{"name": "Zoë"}'.encode("latin-1"))
    before = cli.job_count()
    assert_clean_error(cli.run("submit", "echo", "--payload", f"@{latin1}"), mentions="not UTF-8")
    assert cli.job_count() == before


# -- doctor ---------------------------------------------------------------------------


def _no_private_names(text: str, cli: Cli) -> None:
    assert str(cli.root) not in text
    assert str(cli.data_dir) not in text
    for name in {socket.gethostname(), getpass.getuser()}:
        assert not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), name


def test_doctor_ok(cli: Cli) -> None:
    proc = cli.run("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert all(re.match(r"^(OK  |FAIL) \w+: ", ln) for ln in lines), lines
    names = [ln[5:].split(":")[0] for ln in lines]
    for check in ("settings", "dispatch_lease_recovery", "store", "schema", "transport", "workers"):
        assert check in names
    lease = next(ln for ln in lines if "dispatch_lease_recovery" in ln)
    assert lease.startswith("OK")
    for part in ("claim_ttl_s=120", "renew_interval_s=30", "rto_s=300", "ok=True"):
        assert part in lease
    _no_private_names(proc.stdout + proc.stderr, cli)
    data = cli.json("doctor")
    assert {c["name"] for c in data} >= {"dispatch_lease_recovery", "store"} and all(c["ok"] for c in data)
    _no_private_names(json.dumps(data), cli)


def test_doctor_fails_on_a_bad_setting(cli: Cli) -> None:
    proc = cli.run("doctor", env={"AGENT_DISPATCH_CLAIM_TTL_S": "400"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(r"^FAIL .*AGENT_DISPATCH_CLAIM_TTL_S", proc.stdout, re.MULTILINE), proc.stdout
    _no_private_names(proc.stdout + proc.stderr, cli)


def test_doctor_fails_on_an_unreachable_store_without_printing_the_path(cli: Cli) -> None:
    blocker = cli.root / "regular-file"
    blocker.write_text("not a directory")
    proc = cli.run("doctor", env={"AGENT_DISPATCH_DATA_DIR": str(blocker / "data")})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(r"^FAIL store", proc.stdout, re.MULTILINE), proc.stdout
    _no_private_names(proc.stdout + proc.stderr, cli)
    assert str(blocker) not in proc.stdout + proc.stderr


# -- worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["agentdispatch", "worker"], ["agent-dispatch-worker"]])
@pytest.mark.parametrize("breakage", ["db-is-a-directory", "db-is-garbage"])
def test_worker_preflight_exits_2_when_the_store_is_unreachable(cli: Cli, command: list[str], breakage: str) -> None:
    cli.data_dir.mkdir(parents=True)
    db = cli.data_dir / "agent_dispatch_queue.db"
    if breakage == "db-is-a-directory":
        db.mkdir()
    else:
        db.write_bytes(b"this is not an sqlite database" * 100)
    proc = subprocess.run(command, env=cli.env(), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 2, proc.stderr  # SPEC section 7: the worker's preflight exits 2
    line = assert_clean_error(proc)
    assert "AGENT_DISPATCH_DATA_DIR" in line
    assert str(cli.root) not in line


@pytest.mark.parametrize("command", [["agentdispatch", "worker"], ["agent-dispatch-worker"]])
def test_worker_preflight_exits_2_when_the_data_dir_is_under_a_regular_file(cli: Cli, command: list[str]) -> None:
    blocker = cli.root / "regular-file"
    blocker.write_text("not a directory")
    env = cli.env(AGENT_DISPATCH_DATA_DIR=str(blocker / "data"))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2
    assert_clean_error(proc, mentions="AGENT_DISPATCH_DATA_DIR")


def test_worker_with_a_bad_setting_exits_non_zero_naming_it(cli: Cli) -> None:
    proc = subprocess.run(
        ["agent-dispatch-worker", "--workers", "2"],
        env=cli.env(AGENT_DISPATCH_CLAIM_TTL_S="400"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert_clean_error(proc, mentions="AGENT_DISPATCH_CLAIM_TTL_S")


def test_worker_processes_jobs_and_exits_0_on_sigterm(cli: Cli, worker_proc: Any) -> None:
    jobs = [cli.submit("echo", "--payload", json.dumps({"n": i}), "--session", f"s{i % 2}") for i in range(4)]
    log = cli.root / "worker.log"
    proc = worker_proc(["agent-dispatch-worker", "--workers", "2"], log)
    jobs += [cli.submit("echo", "--payload", json.dumps({"n": i}), "--session", f"s{i % 2}") for i in range(4, 8)]
    for i, job in enumerate(jobs):
        # --wait answers once the job ended: one process per job, not one per poll.
        view = cli.json("status", job, "--wait", "30")
        assert (view["status"], view["result"], view["attempt"]) == ("succeeded", {"n": i}, 1)
    doctor = cli.ok("doctor")
    assert re.search(r"^OK   workers: 1 live", doctor, re.MULTILINE), doctor
    assert stop(proc, log) == 0, log.read_text()
    assert "Traceback" not in log.read_text()
    assert "workers: 0 live" in cli.ok("doctor")  # its heartbeat row is removed on a clean stop


def test_dlq_list_and_replay(cli: Cli, worker_proc: Any) -> None:
    env = {"AGENT_DISPATCH_MAX_ATTEMPTS": "1"}
    # `sleep` with a non-numeric duration raises ValueError: a retryable failure
    bad = cli.json("submit", "sleep", "--payload", '{"seconds": "forever"}', env=env)["job_id"]
    good = cli.submit("echo", "--payload", '"fine"')
    log = cli.root / "worker.log"
    proc = worker_proc(["agentdispatch", "worker", "--workers", "2"], log, **env)
    assert cli.json("status", bad, "--wait", "30")["status"] == "dead_letter"
    assert cli.json("status", good, "--wait", "30")["status"] == "succeeded"
    assert stop(proc, log) == 0, log.read_text()

    dead = cli.json("status", bad)
    assert (dead["reason"], dead["attempt"]) == ("max_attempts", 1)
    assert "ValueError" in dead["error"]
    listed = cli.json("dlq", "list")
    assert [j["job_id"] for j in listed["jobs"]] == [bad]
    assert listed["poison"] == []
    assert bad in cli.ok("dlq", "list", env={"COLUMNS": "250"})  # rich truncates ids at 80 columns

    replayed = cli.json("dlq", "replay", bad, env=env)
    assert (replayed["job"]["status"], replayed["job"]["reason"]) == ("ready", "replayed")
    assert replayed["job"]["max_attempts"] == 2  # a new attempt of the same item
    assert replayed["side_effects"] == []
    assert cli.json("dlq", "list")["jobs"] == []
    assert [e["event"] for e in cli.json("status", bad, "--history")["events"]][-1] == "replayed"
    assert_clean_error(cli.run("dlq", "replay", bad), mentions="dead_letter")  # only once


# -- demo -----------------------------------------------------------------------------


def test_demo_runs_every_turn_to_success(cli: Cli) -> None:
    proc = cli.run("demo", "--turns", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout) == {"turns": 40, "by_status": {"succeeded": 40}}
    assert cli.data_dir.joinpath("agent_dispatch_queue.db").is_file()
    assert not (cli.root / "home" / ".local").exists()  # nothing under the (fake) home
