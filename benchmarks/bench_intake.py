"""Intake time-to-200 at a fixed webhook rate while every worker is busy.

For each backend (SQLite file; PostgreSQL on a fresh database) this starts a
real gateway subprocess and a real worker process whose threads are all held
by long ``sleep`` turns, then sends signed Telegram updates open-loop at
``--rate`` per second for ``--seconds`` and prints p50/p90/p99/max of the time
from send to the 200, and p99 against the 1 s bound and the 50 ms target.

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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from backends import fresh_pg_database
from intake.kit import TG_BOT, TG_SECRET, cli, env_for, gateway, install_all, tg_update


async def _load(url: str, rate: float, seconds: float) -> tuple[list[float], dict[int, int]]:
    n = int(rate * seconds)
    latencies: list[float] = []
    codes: dict[int, int] = {}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    headers = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as c:

        async def one(i: int) -> None:
            body = tg_update(100_000 + i, text=f"m{i}", chat=i % 50)
            t0 = time.perf_counter()
            try:
                r = await c.post(f"/intake/telegram/{TG_BOT}", content=body, headers=headers)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            except httpx.HTTPError:
                codes[0] = codes.get(0, 0) + 1
            latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        tasks = []
        for i in range(n):
            # Open loop: send on schedule whether or not earlier answers came back.
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
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


def run(name: str, env: dict[str, str], rate: float, seconds: float, threads: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        if "STATE_DB_URI" in env:
            cli(data, "migrate", **env)
        install_all(data, **env)
        worker = _busy_workers(data, env, threads)
        gw = gateway(data, **env)
        try:
            time.sleep(2.0)  # let the worker claim its sleep turns
            lat, codes = asyncio.run(_load(gw.url, rate, seconds))
        finally:
            gw.stop()
            worker.terminate()
            worker.wait(timeout=60)
    p99 = _pct(lat, 0.99)
    print(
        f"{name:9s} n={len(lat)} codes={codes} p50={_pct(lat, 0.50):.1f}ms p90={_pct(lat, 0.90):.1f}ms "
        f"p99={p99:.1f}ms max={max(lat) * 1000:.1f}ms mean={statistics.mean(lat) * 1000:.1f}ms | "
        f"p99/1s={p99 / 1000:.3f} p99/50ms={p99 / 50:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--worker-threads", type=int, default=2)
    ap.add_argument("--backends", default="sqlite,postgres")
    args = ap.parse_args()
    cleanup: list[Callable[[], None]] = []
    try:
        for name in args.backends.split(","):
            env: dict[str, str] = {}
            if name == "postgres":
                os.environ.setdefault("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
                env = {"STATE_DB_URI": fresh_pg_database(cleanup), "TASK_QUEUE_BACKEND": "postgres"}
            run(name, env, args.rate, args.seconds, args.worker_threads)
    finally:
        for fn in cleanup:
            fn()


if __name__ == "__main__":
    main()
