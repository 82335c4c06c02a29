"""Intake time-to-200 at a fixed webhook rate while every worker is busy.

For each backend (SQLite file; PostgreSQL on a fresh database) this starts a
real gateway subprocess and a real worker process whose threads are all held
by long ``sleep`` turns, then sends signed Telegram updates open-loop at
``--rate`` per second for ``--seconds`` and prints p50/p90/p99/max of the time
from the update's due time to the end of the answer, p99 against the 1 s bound
and the 50 ms target, and at the end both backends side by side.

    python benchmarks/bench_intake.py --rate 200 --seconds 10 [--backends sqlite,postgres]
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


async def _load(url: str, rate: float, seconds: float) -> tuple[list[float], dict[int, int]]:
    """Open loop: update i is due at ``i / rate``; its latency runs from then
    (a late send counts against us) to the end of the answer."""
    host, port = url.removeprefix("http://").split(":")
    n = int(rate * seconds)
    path = f"/intake/telegram/{TG_BOT}"
    requests = []
    for i in range(n):
        body = tg_update(100_000 + i, text=f"m{i}", chat=i % 50)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-Telegram-Bot-Api-Secret-Token: {TG_SECRET}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        requests.append(head.encode() + body)
    latencies: list[float] = []
    codes: dict[int, int] = {}
    idle: list[_Conn] = []

    async def one(i: int, due: float) -> None:
        conn = idle.pop() if idle else _Conn(*await asyncio.open_connection(host, int(port)))
        try:
            status = await asyncio.wait_for(conn.post(requests[i]), 30)
            idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            status = 0
            conn.writer.close()
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


def _busy_workers(data: Path, env: dict[str, str], threads: int) -> subprocess.Popen[bytes]:
    """A worker process whose every thread runs a long sleep turn."""
    for i in range(threads * 2):
        cli(data, "submit", "sleep", "--payload", '{"seconds": 120}', "--session", f"busy{i}", **env)
    return subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "worker", "--workers", str(threads)],
        env=env_for(data, env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _pct(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000


def run(name: str, env: dict[str, str], rate: float, seconds: float, threads: int) -> tuple[str, float]:
    """One backend's line and its p99 (ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        if "STATE_DB_URI" in env:
            cli(data, "migrate", **env)
        install_all(data, **env)
        worker = _busy_workers(data, env, threads)
        try:
            gw = gateway(data, **env)
            try:
                time.sleep(2.0)  # let the worker claim its sleep turns
                lat, codes = asyncio.run(_load(gw.url, rate, seconds))
            finally:
                gw.stop()
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    p99 = _pct(lat, 0.99)
    line = (
        f"{name:9s} n={len(lat)} codes={codes} p50={_pct(lat, 0.50):.1f}ms p90={_pct(lat, 0.90):.1f}ms "
        f"p99={p99:.1f}ms max={max(lat) * 1000:.1f}ms mean={statistics.mean(lat) * 1000:.1f}ms | "
        f"p99/1s={p99 / 1000:.3f} p99/50ms={p99 / 50:.2f}"
    )
    print(line, flush=True)
    return line, p99


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--worker-threads", type=int, default=2)
    ap.add_argument("--backends", default="sqlite,postgres")
    args = ap.parse_args()
    cleanup: list[Callable[[], None]] = []
    results: dict[str, tuple[str, float]] = {}
    try:
        for name in args.backends.split(","):
            env: dict[str, str] = {}
            if name == "postgres":
                os.environ.setdefault("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
                env = {"STATE_DB_URI": fresh_pg_database(cleanup), "TASK_QUEUE_BACKEND": "postgres"}
            results[name] = run(name, env, args.rate, args.seconds, args.worker_threads)
        print(f"\ntime-to-200 at {args.rate:g}/s, {args.worker_threads} busy worker threads, side by side:")
        for line, _p99 in results.values():
            print("  " + line)
        if "sqlite" in results and "postgres" in results:
            print(f"  p99 postgres / sqlite = {results['postgres'][1] / results['sqlite'][1]:.2f}")
    finally:
        for fn in cleanup:
            fn()


if __name__ == "__main__":
    main()
