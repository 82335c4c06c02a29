"""Intake time-to-200 at a fixed webhook rate while every worker is busy.

For each backend (SQLite file; PostgreSQL on a fresh database) this starts a
real gateway subprocess and a real worker process whose threads are all held
by long ``sleep`` turns, then sends Telegram updates open-loop at ``--rate``
per second for ``--seconds`` twice against the same gateway:

- ``bare``: the same updates with a wrong secret token. The gateway reads the
  body, finds the (cached) installation and answers 401: the request path
  without the store, the baseline of this run;
- ``intake``: authenticated updates, each recorded durably (receipt and
  WorkItem) before its 200.

It prints p50/p90/p99/max of the time from the update's due time to the end of
the answer, the gateway process's CPU per request (less noisy than wall time
on a shared machine), intake p99 against the bare p99, the 1 s bound and the 50 ms
target, and at the end both backends side by side. The 50 chats are routed to
``--agents`` agents, so the per-agent backlog bound (256 open items) is not
what is measured (at 200/s one agent's backlog fills in 1.3 s while the
workers are busy, and each update after that is refused with a 503).

With ``--rounds N`` each backend is measured N times, alternating backends,
each round on a new database and gateway with its own bare baseline: on a
shared machine one round's figures say little alone.

    python benchmarks/bench_intake.py --rate 200 --seconds 10 [--backends sqlite,postgres] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from backends import fresh_pg_database
from intake.kit import TG_BOT, TG_SECRET, cli, env_for, gateway, install_all, tg_update

CHATS = 50


class _Conn:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol:
    the load generator must cost far less CPU than the gateway it measures (a
    general-purpose client with hundreds of pending requests spent more CPU
    per request than the gateway and its latency became the client's)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def post(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status


async def _load(
    url: str, rate: float, seconds: float, *, secret: str, first: int
) -> tuple[list[float], dict[int, int]]:
    """Open loop: update i is due at ``i / rate``; its latency runs from then
    (a late send counts against us) to the end of the answer."""
    host, port = url.removeprefix("http://").split(":")
    n = int(rate * seconds)
    path = f"/intake/telegram/{TG_BOT}"
    requests = []
    for i in range(n):
        body = tg_update(first + i, text=f"m{i}", chat=i % CHATS)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-Telegram-Bot-Api-Secret-Token: {secret}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    latencies: list[float] = []
    codes: dict[int, int] = {}
    idle: list[_Conn] = []

    async def one(i: int, due: float) -> None:
        status = 0
        # A kept-alive connection the server closed while it sat idle (past
        # uvicorn's keep-alive timeout) fails at once: like any HTTP client,
        # send again on a new connection (the time counts against us).
        for reused in (True, False) if idle else (False,):
            conn = idle.pop() if reused else _Conn(*await asyncio.open_connection(host, int(port)))
            try:
                status = await asyncio.wait_for(conn.post(requests[i]), 30)
                idle.append(conn)
                break
            except (OSError, asyncio.IncompleteReadError, ValueError):
                conn.writer.close()
            except TimeoutError:
                conn.writer.close()
                break
        codes[status] = codes.get(status, 0) + 1
        latencies.append(time.perf_counter() - due)

    start = time.perf_counter()
    tasks = []
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    for conn in idle:
        conn.writer.close()
    return latencies, codes


_SETUP = """
import sys
from agentdispatch.cli.app import App
from agentdispatch.dispatch import Submission
from agentdispatch.factory import open_intake_store
from agentdispatch.intake.admin import installation_id, set_agent, set_route
agents, chats, busy = (int(a) for a in sys.argv[1:4])
app = App()
ist = open_intake_store(app.store)
inst = installation_id("telegram", sys.argv[4])
for a in range(agents):
    set_agent(ist, f"agent{a}", enabled=True)
set_route(ist, inst, "*", None)
for c in range(chats):
    set_route(ist, inst, str(c), f"agent{c % agents}")
for i in range(busy):
    app.dispatcher().submit(Submission("sleep", {"seconds": 120}, session_id=f"busy{i}"))
"""


def _setup(data: Path, env: dict[str, str], agents: int, busy: int) -> None:
    """Chats routed round-robin to ``agents`` agents, and ``busy`` long sleep
    turns queued (one process: a CLI call per route costs seconds here)."""
    cmd = [sys.executable, "-c", _SETUP, str(agents), str(CHATS), str(busy), TG_BOT]
    subprocess.run(cmd, env=env_for(data, env), check=True, timeout=120)


def _busy_workers(data: Path, env: dict[str, str], threads: int) -> subprocess.Popen[bytes]:
    """A worker process whose every thread runs a long sleep turn."""
    return subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "worker", "--workers", str(threads)],
        env=env_for(data, env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _line(label: str, lat: list[float], codes: dict[int, int], cpu_s: float) -> str:
    return (
        f"{label:21s} n={len(lat)} codes={codes} p50={_pct(lat, 0.50):.1f}ms p90={_pct(lat, 0.90):.1f}ms "
        f"p99={_pct(lat, 0.99):.1f}ms max={max(lat) * 1000:.1f}ms mean={statistics.mean(lat) * 1000:.1f}ms "
        f"cpu/req={cpu_s / len(lat) * 1000:.2f}ms"
    )


def run(name: str, env: dict[str, str], rate: float, seconds: float, threads: int, agents: int) -> list[str]:
    """One backend's lines: the bare request path, then intake against it."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        if "STATE_DB_URI" in env:
            cli(data, "migrate", **env)
        install_all(data, **env)
        _setup(data, env, agents, threads * 2)
        worker = _busy_workers(data, env, threads)
        try:
            gw = gateway(data, **env)
            try:
                time.sleep(2.0)  # let the worker claim its sleep turns
                c0 = _cpu_s(gw.proc.pid)
                bare, bare_codes = asyncio.run(_load(gw.url, rate, seconds, secret="wrong-secret", first=0))
                c1 = _cpu_s(gw.proc.pid)
                lat, codes = asyncio.run(_load(gw.url, rate, seconds, secret=TG_SECRET, first=1_000_000))
                c2 = _cpu_s(gw.proc.pid)
            finally:
                gw.stop()
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    p99, base = _pct(lat, 0.99), _pct(bare, 0.99)
    lines = [
        _line(f"{name} bare (401)", bare, bare_codes, c1 - c0),
        _line(f"{name} intake (200)", lat, codes, c2 - c1)
        + f" | p99/bare p99={p99 / base:.2f} p99/1s={p99 / 1000:.3f} p99/50ms={p99 / 50:.2f}",
    ]
    for line in lines:
        print(line, flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--worker-threads", type=int, default=2)
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    cleanup: list[Callable[[], None]] = []
    results: dict[str, list[str]] = {}
    try:
        for r in range(args.rounds):
            for name in args.backends.split(","):
                env: dict[str, str] = {}
                if name == "postgres":
                    os.environ.setdefault("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
                    env = {"STATE_DB_URI": fresh_pg_database(cleanup), "TASK_QUEUE_BACKEND": "postgres"}
                label = name if args.rounds == 1 else f"{name}#{r + 1}"
                results[label] = run(label, env, args.rate, args.seconds, args.worker_threads, args.agents)
        print(f"\ntime-to-200 at {args.rate:g}/s, {args.worker_threads} busy worker threads, side by side:")
        for label in sorted(results, key=lambda k: (k.split("#")[0], k)):
            for line in results[label]:
                print("  " + line)
    finally:
        for fn in cleanup:
            fn()


if __name__ == "__main__":
    main()
