"""A full disk under a real SQLite worker process: its claim threads back off,
report, and resume once space comes back; an unrecoverable error (a database
file that is no longer one) ends the process non-zero for its supervisor."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agentdispatch import Status, Submission
from backends import Harness, sqlite_harness

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="mounts a size-limited tmpfs (Linux, root)",
)


@contextmanager
def small_disk(path: Path, size: str = "64m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (unmounted at exit). Once the
    filler is gone it must hold the WAL at its checkpoint size (10,000 pages,
    40 MB): with less, the turns' own commits fill the disk again."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk``; returns the file to delete."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\xff" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(h: Harness, log: Path, metrics_port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        **h.env,
        "AGENT_DISPATCH_CLAIM_TTL_S": "2",
        "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5",
    }
    cmd = [sys.executable, "-m", "agentdispatch", "worker", "--workers", "2", "--grace", "5"]
    with log.open("wb") as out:
        return subprocess.Popen([*cmd, "--metrics-port", str(metrics_port)], env=env, stdout=out, stderr=out)


def _until(cond: Callable[[], bool], what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what + ("\n" + log.read_text()[-3000:] if log is not None else "")
        time.sleep(0.1)


def _metric(port: int, line_start: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_claim_threads_survive_a_full_disk_and_run_the_accepted_turns(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        h = sqlite_harness(disk)
        try:
            handles = h.dispatcher().submit_many(
                [Submission(kind="echo", tenant="t", session_id=f"s{i % 10}", payload={"i": i}) for i in range(100)]
            )
            filler = fill(disk)
            log, port = tmp_path / "worker.log", _free_port()
            worker = _spawn(h, log, port)
            try:
                errors = 'agent_utilities_dispatch_worker_errors_total{error="TaskQueueUnavailable"}'
                _until(lambda: "disk is full" in log.read_text(), "the worker never met the full disk", 30)
                _until(lambda: _metric(port, errors) >= 2, "the failures were not counted", 30)
                assert worker.poll() is None, "the worker died of a full disk"
                assert {h.store.get(x.job_id, "t").status for x in handles} == {Status.READY}
                filler.unlink()
                _until(
                    lambda: all(h.store.get(x.job_id, "t").status is Status.SUCCEEDED for x in handles),
                    "accepted turns stayed queued after space came back",
                    60,
                    log,
                )
                assert "resumed after" in log.read_text()
            finally:
                worker.send_signal(signal.SIGTERM)
                code = worker.wait(timeout=30)
            assert code == 0, log.read_text()[-2000:]
        finally:
            h.close()


def test_a_database_that_is_no_longer_one_exits_the_worker_non_zero(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path / "h")
    try:
        job = h.dispatcher().submit(Submission(kind="echo", tenant="t"))
        log, port = tmp_path / "worker.log", _free_port()
        worker = _spawn(h, log, port)
        try:
            _until(lambda: h.store.get(job.job_id, "t").status is Status.SUCCEEDED, "the worker never ran", 30)
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
        filler.unlink()
        proc = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "status", job], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
