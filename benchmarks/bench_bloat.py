"""Reliability scenario 15: what a transaction left open does to dispatch.

A steady ``--rate`` turns/s (default 50) through an async worker on a fresh
PostgreSQL database, in three phases: ``--before`` s as a baseline, ``--hold``
s with a REPEATABLE READ session holding its snapshot (vacuum can remove no
dead row meanwhile), and ``--after`` s once it ended. Every ``--window`` s it
prints submit-to-start p50/p99, the queue's dead rows, and the fleet gauge
``oldest_xmin_age_seconds``; at the end, each phase's p99 as a ratio of the
baseline's and when the gauge first passed the alert rule's 120 s. The
scenario asks for the alert within 5 min and claim p99 back to baseline within
5 min after the transaction ends. No assertions.

    python benchmarks/bench_bloat.py --before 60 --hold 600 --after 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from agentdispatch import Registry, Submission
from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.postgres.transport import PostgresTransport
from agentdispatch.dispatch import Dispatcher
from agentdispatch.metrics import FleetCollector
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.settings import load_settings

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
ALERT_S = 120.0


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


class Probe:
    """Windows of submit-to-start latencies, with the database's state."""

    def __init__(self, uri: str, gauge: Callable[[], float]) -> None:
        self.uri = uri
        self.gauge = gauge
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.rows: list[tuple[str, float, float, float, int, float]] = []

    def started(self, latency_s: float) -> None:
        with self.lock:
            self.latencies.append(latency_s)

    def close_window(self, phase: str, t: float) -> None:
        with self.lock:
            window, self.latencies = self.latencies, []
        with psycopg.connect(self.uri, autocommit=True) as c:
            row = c.execute(
                "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
                "WHERE relname IN ('agent_dispatch_queue', 'work_items', 'work_events')"
            ).fetchone()
        dead = int(row[0]) if row else 0
        p50, p99 = pct(window, 0.5) * 1000, pct(window, 0.99) * 1000
        age = self.gauge()
        self.rows.append((phase, t, p50, p99, dead, age))
        print(
            f"{phase:>7} t={t:6.0f} s  turns={len(window):5d}  p50={p50:7.1f} ms  p99={p99:7.1f} ms  "
            f"dead rows={dead:8d}  oldest xact={age:6.0f} s",
            flush=True,
        )


def fresh_database() -> str:
    name = f"bench_bloat_{os.getpid()}"
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    return BASE.rsplit("/", 1)[0] + "/" + name


def drop_database(uri: str) -> None:
    name = uri.rsplit("/", 1)[1]
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--before", type=float, default=60.0)
    ap.add_argument("--hold", type=float, default=300.0)
    ap.add_argument("--after", type=float, default=300.0)
    ap.add_argument("--window", type=float, default=30.0)
    args = ap.parse_args()

    uri = fresh_database()
    with psycopg.connect(uri, autocommit=True) as c:
        row = c.execute("SELECT current_setting('autovacuum'), current_setting('autovacuum_naptime')").fetchone()
    # Without autovacuum only pruning on access removes dead rows after the hold.
    print(f"autovacuum {row[0] if row else '?'} (naptime {row[1] if row else '?'})", flush=True)
    store = PostgresStore(uri)
    store.migrate()
    transport = PostgresTransport(store)
    settings = load_settings(STATE_DB_URI=uri, TASK_QUEUE_BACKEND="postgres")
    collector = FleetCollector(lambda: (store, transport))

    def gauge() -> float:
        for family in collector.collect():
            for s in family.samples:
                if s.name.endswith("oldest_xmin_age_seconds"):
                    return float(s.value)
        return float("nan")

    probe = Probe(uri, gauge)
    reg = Registry()

    @reg.register("turn")
    async def turn(t: Any, guard: Any) -> None:
        probe.started(time.time() - float(t.payload))
        await asyncio.sleep(0.05)

    worker = AsyncWorker(settings, store, transport, reg, options=RuntimeOptions(concurrency=64))
    runner = threading.Thread(target=worker.run_forever, daemon=True)
    runner.start()
    d = Dispatcher(store, transport, settings)
    holder: psycopg.Connection[Any] | None = None
    phases = [("before", args.before), ("hold", args.hold), ("after", args.after)]
    t0 = time.monotonic()
    next_window = t0 + args.window
    alert_at: float | None = None
    hold_began = 0.0
    try:
        for phase, seconds in phases:
            if phase == "hold":
                holder = psycopg.connect(uri)
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT count(*) FROM work_items").fetchone()
                hold_began = time.monotonic()
            elif phase == "after" and holder is not None:
                holder.rollback()
                holder.close()
                holder = None
            end = time.monotonic() + seconds
            t_next = time.monotonic()
            while time.monotonic() < end:
                t_next += 1.0 / args.rate
                time.sleep(max(0.0, t_next - time.monotonic()))
                d.submit(Submission(kind="turn", tenant="t", payload=time.time()))
                now = time.monotonic()
                if now >= next_window:
                    probe.close_window(phase, now - t0)
                    next_window += args.window
                    if phase == "hold" and alert_at is None and probe.rows[-1][5] > ALERT_S:
                        alert_at = now - hold_began
    finally:
        if holder is not None:
            holder.close()
        worker.request_stop()
        runner.join(timeout=30)
        transport.close()
        store.close()
        drop_database(uri)

    by_phase: dict[str, list[float]] = {}
    for phase, _t, _p50, p99, _dead, _age in probe.rows:
        by_phase.setdefault(phase, []).append(p99)
    base = statistics.median(by_phase.get("before", [float("nan")]))
    print(f"\nbaseline p99 (median of windows): {base:.1f} ms")
    for phase in ("hold", "after"):
        values = by_phase.get(phase, [])
        if values:
            print(f"{phase}: p99 per window as a ratio of baseline: " + ", ".join(f"{v / base:.2f}" for v in values))
    print(
        "gauge past the 120 s alert threshold "
        + (f"{alert_at:.0f} s after the transaction began" if alert_at is not None else "never (hold too short?)")
    )


if __name__ == "__main__":
    main()
