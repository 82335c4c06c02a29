"""Full-disk test kit: a size-limited tmpfs, a filler that takes every free
byte of it, and a worker process watched through its log and metrics."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def small_disk(path: Path, size: str = "64m", mode: str = "0700") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (unmounted at exit)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(path)], check=True)
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


def spawn_worker(
    env: Mapping[str, str], log: Path, metrics_port: int, args: Sequence[str] = ("--workers", "2")
) -> subprocess.Popen[bytes]:
    """``agentdispatch worker`` with a 2 s TTL, its output to ``log``."""
    full = {
        **os.environ,
        **env,
        "AGENT_DISPATCH_CLAIM_TTL_S": "2",
        "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5",
    }
    cmd = [sys.executable, "-m", "agentdispatch", "worker", *args, "--grace", "5"]
    with log.open("wb") as out:
        return subprocess.Popen([*cmd, "--metrics-port", str(metrics_port)], env=full, stdout=out, stderr=out)


@contextmanager
def stopped_cleanly(worker: subprocess.Popen[bytes], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """SIGTERM ``worker`` at the end of the block; after a block that went
    through, it must exit 0 (its log says why not)."""
    try:
        yield worker
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    assert code == 0, log.read_text()[-2000:]


def until(cond: Callable[[], bool], what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what + ("\n" + log.read_text()[-3000:] if log is not None else "")
        time.sleep(0.1)


def metric(port: int, line_start: str) -> float:
    """The sum of the worker's samples whose line starts so (0 while it does not answer)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))
