"""Long async turns in one process: the async runtime (``--concurrency``)
against the thread worker (``--workers``), in one run on one machine.

Each turn awaits ``--sleep`` seconds (a model call) and then makes one
``guard.side_effect_async``, one session per turn. Prints the wall time of
draining ``--turns`` turns, the ideal (turns / in-flight x sleep), the ratio
ideal / wall, the worst lease-renewal lateness and the renewal calls of the
async runtime. No assertion on time: the figures are the output.

    python benchmarks/bench_runtime.py --turns 1000 --sleep 2 --concurrency 1000 --threads 256
    python benchmarks/bench_runtime.py --backend postgres
    python benchmarks/bench_runtime.py --cancels 100 --concurrency 2000   # cancel p50/p99
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from agentdispatch import Dispatcher, Registry, Status, Submission, Worker, WorkerOptions, load_settings, open_backends
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.transports.flow import TurnEnd

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def registry(sleep_s: float) -> Registry:
    reg = Registry()

    @reg.register("agent")
    async def agent(turn: Any, guard: Any) -> str:
        await asyncio.sleep(sleep_s)

        async def send() -> str:
            return str(turn.job_id)

        return str(await guard.side_effect_async(f"send:{turn.job_id}", send))

    return reg


@contextlib.contextmanager
def environment(backend: str) -> Iterator[dict[str, Any]]:
    """Settings overrides of a fresh store of ``backend``."""
    common = {"AGENT_DISPATCH_CLAIM_TTL_S": 10.0, "AGENT_DISPATCH_RENEW_INTERVAL_S": 0.5}
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as d:
            yield {**common, "AGENT_DISPATCH_DATA_DIR": d, "TASK_QUEUE_BACKEND": "sqlite"}
        return
    name = f"bench_rt_{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {name}")
    try:
        yield {**common, "STATE_DB_URI": f"{BASE}?options=-csearch_path%3D{name}"}
    finally:
        with psycopg.connect(BASE, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {name} CASCADE")


def drain(backend: str, mode: str, turns: int, sleep_s: float, inflight: int) -> dict[str, float]:
    with environment(backend) as env:
        settings = load_settings(**env)
        store, transport = open_backends(settings)
        store.migrate()
        Dispatcher(store, transport, settings).submit_many([Submission(kind="agent", tenant="t") for _ in range(turns)])
        reg = registry(sleep_s)
        t0 = time.monotonic()
        extra: dict[str, float] = {}
        if mode == "async":
            worker = AsyncWorker(
                settings, store, transport, reg, options=RuntimeOptions(concurrency=inflight, get_wait_s=0.05)
            )
            thread = threading.Thread(target=worker.run_forever, daemon=True)
            thread.start()
            while worker.ended[TurnEnd.COMPLETED] < turns:
                time.sleep(0.05)
            wall = time.monotonic() - t0
            worker.request_stop()
            thread.join()
            extra = {"renew_late_s": worker.renewer.worst_lateness_s, "renew_calls": worker.renewer.calls}
        else:
            tw = Worker(settings, store, transport, reg, options=WorkerOptions(threads=inflight, get_wait_s=0.05))
            tw.start()
            while store.counts(None).get(Status.SUCCEEDED.value, 0) < turns:
                time.sleep(0.05)
            wall = time.monotonic() - t0
            tw.stop()
        done = store.counts(None).get(Status.SUCCEEDED.value, 0)
        transport.close()
        store.close()
    ideal = math.ceil(turns / inflight) * sleep_s if mode == "threads" else turns / inflight * sleep_s
    return {"wall_s": wall, "ideal_s": ideal, "ratio": ideal / wall, "succeeded": done, **extra}


def cancel_latency(backend: str, inflight: int, cancels: int) -> dict[str, float]:
    """``inflight`` turns awaiting forever (renewals at the default interval);
    ``cancels`` of them cancelled one by one through the Dispatcher: the time
    from each cancel's return to its task's cancellation."""
    stopped: dict[str, float] = {}
    reg = Registry()

    @reg.register("agent")
    async def agent(turn: Any, guard: Any) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopped[turn.job_id] = time.monotonic()
            raise

    with environment(backend) as env:
        env = {k: v for k, v in env.items() if "CLAIM_TTL" not in k and "RENEW" not in k}
        settings = load_settings(**env)
        store, transport = open_backends(settings)
        store.migrate()
        d = Dispatcher(store, transport, settings)
        jobs = [h.job_id for h in d.submit_many([Submission(kind="agent", tenant="t") for _ in range(inflight)])]
        worker = AsyncWorker(settings, store, transport, reg, options=RuntimeOptions(concurrency=inflight, grace_s=1))
        thread = threading.Thread(target=worker.run_forever, daemon=True)
        thread.start()
        while len(worker.running) < inflight:
            time.sleep(0.05)
        asked: dict[str, float] = {}
        for job in jobs[:cancels]:
            d.cancel(job, "t")
            asked[job] = time.monotonic()
            time.sleep(0.05)
        while len(stopped) < cancels:
            time.sleep(0.05)
        worker.request_stop()
        thread.join()
        transport.close()
        store.close()
    lat = sorted(stopped[j] - asked[j] for j in asked)
    return {
        "renew_interval_s": settings.renew_interval_s,
        "cancel_p50_s": lat[len(lat) // 2],
        "cancel_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--turns", type=int, default=1000)
    p.add_argument("--sleep", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--threads", type=int, default=256)
    p.add_argument("--modes", default="async,threads", help="which workers to run: async, threads or both")
    p.add_argument("--cancels", type=int, default=0, help="instead: cancel this many of --concurrency running turns")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    for backend in backends:
        if args.cancels:
            r = cancel_latency(backend, args.concurrency, args.cancels)
            print(f"{backend:8} cancel in-flight={args.concurrency} " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
            continue
        modes = [m.strip() for m in args.modes.split(",")]
        for mode, n in (("async", args.concurrency), ("threads", args.threads)):
            if mode not in modes:
                continue
            r = drain(backend, mode, args.turns, args.sleep, n)
            figures = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
            print(f"{backend:8} {mode:7} in-flight={n:<5} {figures}", flush=True)


if __name__ == "__main__":
    main()
