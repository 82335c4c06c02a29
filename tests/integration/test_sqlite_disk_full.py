"""A full disk under a real SQLite worker process: its claim threads back off,
report, and resume once space comes back; an unrecoverable error (a database
file that is no longer one) ends the process non-zero for its supervisor."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agentdispatch import Status, Submission
from agentdispatch.settings import SQLITE_FILE
from backends import sqlite_harness
from diskkit import fill, metric, small_disk, spawn_worker, stopped_cleanly, until
from e2e.gatewayproc import start_gateway
from ports import free_port

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="mounts a size-limited tmpfs (Linux, root)",
)


def test_claim_threads_survive_a_full_disk_and_run_the_accepted_turns(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        h = sqlite_harness(disk)
        try:
            handles = h.dispatcher().submit_many(
                [Submission(kind="echo", tenant="t", session_id=f"s{i % 10}", payload={"i": i}) for i in range(100)]
            )
            filler = fill(disk)
            log, port = tmp_path / "worker.log", free_port()
            with stopped_cleanly(spawn_worker(h.env, log, port), log) as worker:
                errors = 'agent_utilities_dispatch_worker_errors_total{error="TaskQueueUnavailable"}'
                until(lambda: "disk is full" in log.read_text(), "the worker never met the full disk", 30)
                until(lambda: metric(port, errors) >= 2, "the failures were not counted", 30)
                assert worker.poll() is None, "the worker died of a full disk"
                # Nothing fails for want of space; a WAL that starts over in the
                # room it holds may even run a few turns meanwhile.
                bad = {Status.FAILED, Status.DEAD_LETTER, Status.CANCELLED}
                assert not {h.store.get(x.job_id, "t").status for x in handles} & bad
                filler.unlink()
                until(
                    lambda: all(h.store.get(x.job_id, "t").status is Status.SUCCEEDED for x in handles),
                    "accepted turns stayed queued after space came back",
                    60,
                    log,
                )
                assert "resumed after" in log.read_text()
        finally:
            h.close()


def test_a_database_that_is_no_longer_one_exits_the_worker_non_zero(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path / "h")
    try:
        job = h.dispatcher().submit(Submission(kind="echo", tenant="t"))
        log, port = tmp_path / "worker.log", free_port()
        worker = spawn_worker(h.env, log, port)
        try:
            until(lambda: h.store.get(job.job_id, "t").status is Status.SUCCEEDED, "the worker never ran", 30)
            h.close()
            # Overwrite every file of the database in place: the worker's open
            # connections now read garbage (an operator's mistake, a bad disk).
            # Never truncated first: an mmapped WAL index cut short is a SIGBUS.
            data = Path(h.env["AGENT_DISPATCH_DATA_DIR"])
            for f in data.iterdir():
                if f.is_file():
                    with f.open("r+b") as out:
                        out.write(os.urandom(max(f.stat().st_size, 65536)))
            code = worker.wait(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert code == 3, log.read_text()[-2000:]
        assert "unrecoverable error" in log.read_text()
    finally:
        h.close()


def test_cli_on_a_full_disk_says_so_in_one_line(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", size="8m") as disk:
        h = sqlite_harness(disk)
        try:
            job = h.dispatcher().submit(Submission(kind="echo")).job_id
        finally:
            h.close()
        env = {**os.environ, **h.env}
        filler = fill(disk)
        for args in (["status", job], ["jobs"], ["submit", "echo"]):
            proc = subprocess.run(
                [sys.executable, "-m", "agentdispatch", *args], env=env, capture_output=True, text=True, timeout=60
            )
            out = (proc.stdout + proc.stderr).strip()
            assert proc.returncode == 69, out
            assert out.splitlines() == [out] and "the disk is full" in out, out
            assert out.count("AGENT_DISPATCH_DATA_DIR") == 1, out
        # The worker's preflight says so too, without a guess at the other backends' settings.
        proc = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "worker"], env=env, capture_output=True, text=True, timeout=60
        )
        out = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == 2 and "the disk is full" in out, out
        assert "STATE_DB_URI" not in out and "KAFKA_BOOTSTRAP_SERVERS" not in out, out
        filler.unlink()
        proc = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "status", job], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr


def test_cli_whose_commit_meets_a_full_disk_says_so_in_one_line(tmp_path: Path) -> None:
    # The file opens (another process keeps its WAL), the write starts, and
    # the commit is what runs out of space: the same plain answer as at open.
    with small_disk(tmp_path / "disk", size="8m") as disk:
        h = sqlite_harness(disk)
        reader = sqlite3.connect(Path(h.env["AGENT_DISPATCH_DATA_DIR"]) / SQLITE_FILE, isolation_level=None)
        try:
            h.dispatcher().submit(Submission(kind="echo"))
            # A read snapshot held open keeps the WAL from starting over: the
            # next commit must grow it.
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM work_items").fetchone()
            filler = fill(disk)
            env = {**os.environ, **h.env}
            proc = subprocess.run(
                [sys.executable, "-m", "agentdispatch", "submit", "echo", "--payload", json.dumps({"pad": "x" * 9000})],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            out = (proc.stdout + proc.stderr).strip()
            assert proc.returncode == 69, out
            assert out.splitlines() == [out] and "the disk is full" in out, out
            assert out.count("AGENT_DISPATCH_DATA_DIR") == 1, out
            filler.unlink()
        finally:
            reader.close()
            h.close()


def test_gateway_on_a_full_disk_answers_503_and_logs_why(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", size="8m") as disk:
        data = disk / "data"
        gw = start_gateway(data, "--no-auth")
        try:
            with httpx.Client(base_url=gw.url, timeout=30) as c:
                assert c.post("/v1/jobs", json={"kind": "echo"}).status_code == 202
                filler = fill(disk)
                pad = "x" * 20_000
                answers = [c.post("/v1/jobs", json={"kind": "echo", "payload": {"pad": pad}}) for _ in range(5)]
                refused = [r for r in answers if r.status_code != 202]
                assert refused, "every submission was answered 202 on a full disk"
                for r in refused:
                    assert r.status_code == 503 and r.json()["error"] == "unavailable", r.text
                    assert r.headers["retry-after"]
                # The operator reads why in the gateway's log (one line per burst).
                until(lambda: "the disk is full" in gw.log(), "the gateway's log never said why it answered 503", 10)
                assert gw.log().count("answered 503") == 1, gw.log()
                assert str(disk) not in gw.log()
                filler.unlink()
                assert c.post("/v1/jobs", json={"kind": "echo"}).status_code == 202
        finally:
            gw.stop()


def test_a_wal_that_filled_the_disk_gives_its_room_back(tmp_path: Path) -> None:
    # A WAL grown while checkpoints were rare (plenty of room then, or an
    # older version) fills the disk. Once a little space is back, the room its
    # dead frames hold must go back to the database file, or the turns' own
    # rows never fit.
    with small_disk(tmp_path / "disk", size="4m") as disk:
        h = sqlite_harness(disk)
        try:
            pad = "x" * 2000
            handles = h.dispatcher().submit_many(
                [Submission(kind="echo", tenant="t", payload={"pad": pad}) for _ in range(250)]
            )
            filler = disk / "filler"  # less room than the turns' rows need
            filler.write_bytes(b"\xff" * (256 << 10))
            grow = sqlite3.connect(Path(h.env["AGENT_DISPATCH_DATA_DIR"]) / SQLITE_FILE, isolation_level=None)
            try:
                grow.execute("PRAGMA wal_autocheckpoint = 0")
                grow.execute("CREATE TABLE ballast (b BLOB)")
                grow.execute("INSERT INTO ballast VALUES (zeroblob(65536))")
                with pytest.raises(sqlite3.OperationalError, match="full"):
                    while True:  # each commit appends its pages to the WAL
                        grow.execute("UPDATE ballast SET b = randomblob(65536)")
            finally:
                grow.close()
            log, port = tmp_path / "worker.log", free_port()
            with stopped_cleanly(spawn_worker(h.env, log, port, ("--concurrency", "16")), log) as worker:
                until(lambda: "disk is full" in log.read_text(), "the worker never met the full disk", 30)
                filler.unlink()
                until(
                    lambda: all(h.store.get(x.job_id, "t").status is Status.SUCCEEDED for x in handles),
                    "accepted turns stayed queued after space came back",
                    60,
                    log,
                )
                assert worker.poll() is None
        finally:
            h.close()
