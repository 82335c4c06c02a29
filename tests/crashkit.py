"""Shared machinery of the multi-process crash tests: worker processes that
can be SIGKILLed/SIGSTOPped, and the sink analysis (lost, duplicates, overlaps)."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

APPS = Path(__file__).parent / "apps"


@dataclass
class Fleet:
    """Worker processes sharing one environment."""

    env: dict[str, str]
    threads: int = 4
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    killed_at: dict[int, float] = field(default_factory=dict)

    def spawn(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.env, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentdispatch",
                "worker",
                "--workers",
                str(self.threads),
                "--app",
                "crash_app:registry",
                "--grace",
                "5",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(p)
        return p

    def kill(self, p: subprocess.Popen[bytes]) -> None:
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.killed_at[p.pid] = time.time()

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def stop_all(self) -> None:
        for p in self.live():
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@dataclass
class SinkReport:
    """What the handlers logged."""

    starts: int
    effects: dict[str, int]
    overlaps: list[str]
    out_of_order: list[str]
    takeovers: list[str] = field(default_factory=list)

    @property
    def duplicate_effects(self) -> int:
        return sum(n - 1 for n in self.effects.values() if n > 1)


def analyse(sink: Path, killed_at: dict[int, float]) -> SinkReport:
    """Rebuild each turn's execution interval; a turn whose process was killed
    ends at the kill time."""
    open_: dict[tuple[int, str], tuple[str, int, float]] = {}
    spans: dict[str, list[tuple[float, float, int, str]]] = defaultdict(list)
    effects: dict[str, int] = defaultdict(int)
    starts = 0
    for log in sink.glob("*.log"):
        for line in log.read_text().splitlines():
            parts = line.split()
            kind, pid = parts[0], int(parts[1])
            if kind == "effect":
                effects[parts[2]] += 1
            elif kind == "start":
                starts += 1
                open_[(pid, parts[3])] = (parts[2], int(parts[4]), float(parts[5]))
            elif kind == "end":
                session, i, t0 = open_.pop((pid, parts[3]))
                spans[session].append((t0, float(parts[5]), i, parts[3]))
    for (pid, job), (session, i, t0) in open_.items():
        spans[session].append((t0, killed_at.get(pid, t0), i, job))
    overlaps, disorder, takeovers = [], [], []
    for session, items in spans.items():
        items.sort()
        for a, b in itertools.pairwise(items):
            if b[0] < a[1]:
                # A turn re-run while its stalled first run still sat in the handler
                # is the lease doing its job (the fence and the ledger keep the effect
                # single); two different turns of a session at once would be a bug.
                (takeovers if a[3] == b[3] else overlaps).append(f"{session}: {a[3]} and {b[3]}")
            if b[2] < a[2]:
                disorder.append(f"{session}: {a[2]} before {b[2]}")
    return SinkReport(starts, dict(effects), overlaps, disorder, takeovers)


def pause_between_writes(p: subprocess.Popen[bytes], sqlite_path: Path | None) -> None:
    """SIGSTOP ``p``; on SQLite (``sqlite_path``) only at a moment it holds no
    write lock: a process paused inside a write transaction keeps every other
    writer out for as long as it stays paused (on PostgreSQL it holds only
    its own rows, which the server's timeouts end)."""
    for _ in range(100):
        p.send_signal(signal.SIGSTOP)
        if sqlite_path is None:
            return
        probe = sqlite3.connect(sqlite_path, timeout=1.0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # paused mid-write: let it finish, then again
            p.send_signal(signal.SIGCONT)
        finally:
            probe.close()
    raise AssertionError("the process never paused between writes")
