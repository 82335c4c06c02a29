"""PostgreSQL backend benchmarks, each against a reference measured in the same run.

1. submit: ``--turns`` turns through ``Dispatcher.submit_many`` (``--batch`` per call).
2. end to end: a Worker with ``--threads`` threads drains them with the no-op ``echo``
   handler; against a bare ``DELETE ... WHERE id = (SELECT ... FOR UPDATE SKIP LOCKED
   LIMIT 1) RETURNING`` loop on the same database and thread count. Prints the ratio
   and where our time goes (seconds inside each store/transport call).
3. claim latency: p50/p99 of the fair claim with 1,000 vs ``--big`` queued rows over
   10,000 tenants and 100,000 sessions, with the EXPLAIN plan (ratio of p50s).
4. dispatch latency: ``--rate`` turns/s offered to idle workers, submit -> handler start.

    python benchmarks/bench_postgres.py                      # everything, 1M backlog
    python benchmarks/bench_postgres.py --big 100000         # a smaller big backlog
    python benchmarks/bench_postgres.py --skip-big

``AGENTDISPATCH_TEST_PG`` names the server (default: the local development one).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import psycopg

from agentdispatch import Dispatcher, Submission, Worker, WorkerOptions, load_settings
from agentdispatch.handlers import Registry, Turn, builtins
from agentdispatch.lease import LeaseGuard
from agentdispatch.sqlfiles import queries
from agentdispatch.stores.postgres import PostgresStore
from agentdispatch.transports.postgres import PostgresTransport

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
GET = queries("agentdispatch.transports.sql", "postgres.sql")["get"]


@contextmanager
def schema() -> Iterator[tuple[str, str]]:
    """A fresh schema and its URI; dropped afterwards."""
    name = "bench_" + secrets.token_hex(4)
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {name}")
    sep = "&" if "?" in BASE else "?"
    try:
        yield name, f"{BASE}{sep}options={quote(f'-csearch_path={name}')}"
    finally:
        with psycopg.connect(BASE, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {name} CASCADE")


def backends(uri: str, **settings: Any) -> tuple[PostgresStore, PostgresTransport, Any]:
    store = PostgresStore(uri)
    store.migrate()
    return store, PostgresTransport(store), load_settings(STATE_DB_URI=uri, **settings)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


class Timers:
    """Wall time spent inside chosen methods of an object (all threads)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def wrap(self, obj: Any, label: str, names: list[str]) -> None:
        for name in names:
            fn = getattr(obj, name)

            def timed(*a: Any, _fn: Callable[..., Any] = fn, _key: str = f"{label}.{name}", **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    with self._lock:
                        self.total[_key] += time.perf_counter() - t0
                        self.calls[_key] += 1

            setattr(obj, name, timed)


def bench_submit_and_drain(turns: int, batch: int, threads: int) -> None:
    with schema() as (_name, uri):
        store, transport, settings = backends(uri, AGENT_DISPATCH_MAX_DEPTH=max(100_000, turns))
        d = Dispatcher(store, transport, settings)
        subs = [Submission(kind="echo", tenant=f"t{i % 10}", payload=i) for i in range(turns)]
        t0 = time.perf_counter()
        for i in range(0, turns, batch):
            d.submit_many(subs[i : i + batch])
        submit_s = time.perf_counter() - t0
        print(
            f"submit: {turns} turns via submit_many (batches of {batch}) in {submit_s:.2f} s "
            f"({turns / submit_s:,.0f}/s; target < 2 s for 10,000)"
        )
        timers = Timers()
        timers.wrap(store, "store", ["claim", "commit", "heartbeat"])
        timers.wrap(transport, "transport", ["get", "ack", "release"])
        worker = Worker(
            settings,
            store,
            transport,
            builtins(),
            options=WorkerOptions(threads=threads, get_wait_s=0.2, reconcile=False),
        )
        t0 = time.perf_counter()
        worker.start()
        while store.counts(None).get("succeeded", 0) < turns:
            time.sleep(0.05)
        ours_s = time.perf_counter() - t0
        worker.stop(grace_s=5)
        transport.close()
        store.close()
    ours = turns / ours_s
    with schema() as (_name, uri):
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE bare_q (id bigserial PRIMARY KEY, body text NOT NULL)")
            c.execute("INSERT INTO bare_q (body) SELECT '{}' FROM generate_series(1, %s)", (turns,))
            c.execute("ANALYZE bare_q")

        def loop() -> None:
            with psycopg.connect(uri, autocommit=True) as c:
                while c.execute(
                    "DELETE FROM bare_q WHERE id = (SELECT id FROM bare_q ORDER BY id "
                    "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id, body"
                ).fetchone():
                    pass

        pool = [threading.Thread(target=loop) for _ in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        bare = turns / (time.perf_counter() - t0)
    print(
        f"end to end: {ours:,.0f} turns/s with {threads} threads; bare SKIP LOCKED delete loop {bare:,.0f} rows/s; "
        f"ratio = {ours / bare:.2f} (target >= 0.4)"
    )
    print("  where our time goes (seconds summed over threads, per turn):")
    busy = ours_s * threads
    for key in sorted(timers.total, key=lambda k: -timers.total[k]):
        print(
            f"    {key:<20} {timers.total[key] / turns * 1e3:7.3f} ms/turn  {timers.calls[key]:>7} calls "
            f"{100 * timers.total[key] / busy:5.1f}% of thread time"
        )


def fill(uri: str, n: int) -> None:
    """``n`` queued rows over 10,000 tenants and 100,000 sessions (1 tenant per session;
    fewer when ``n`` is smaller)."""
    with psycopg.connect(uri, autocommit=True) as c:
        step = 200_000
        for lo in range(1, n + 1, step):
            hi = min(n, lo + step - 1)
            c.execute(
                "INSERT INTO agent_dispatch_queue (job_id, item_seq, session_ref, tenant_ref, group_ref, priority, "
                "envelope, enqueued_at, visible_at) "
                "SELECT 'j' || i, i, 's' || mod(i, 100000), 't' || mod(i, 10000), 's' || mod(i, 100000), 0, '{}', 0, 0 "
                "FROM generate_series(%s::bigint, %s::bigint) AS i",
                (lo, hi),
            )
        c.execute("VACUUM ANALYZE")


def claim_latency(uri: str, samples: int) -> list[float]:
    lat = []
    with psycopg.connect(uri, autocommit=True) as c:
        for _ in range(samples):
            t0 = time.perf_counter()
            row = c.execute(GET, {"owner": "bench:0", "vis": 60.0}).fetchone()
            lat.append(time.perf_counter() - t0)
            assert row is not None
            # Replace the claimed row (same session, later in it): the backlog stays constant.
            c.execute(
                "INSERT INTO agent_dispatch_queue (job_id, item_seq, session_ref, tenant_ref, group_ref, priority, "
                "envelope, enqueued_at, visible_at) SELECT job_id || 'r', item_seq + 100000000, session_ref, "
                "tenant_ref, group_ref, priority, envelope, 0, 0 FROM agent_dispatch_queue WHERE id = %s",
                (row[0],),
            )
            c.execute("DELETE FROM agent_dispatch_queue WHERE id = %s", (row[0],))
    return lat


def bench_claim_latency(big: int, samples: int, explain: bool = True) -> None:
    results: dict[int, list[float]] = {}
    for n in (1_000, big):
        with schema() as (_name, uri):
            store = PostgresStore(uri)
            store.migrate()
            store.close()
            t0 = time.perf_counter()
            fill(uri, n)
            fill_s = time.perf_counter() - t0
            results[n] = claim_latency(uri, samples)
            if explain and n == big:
                # EXPLAIN ANALYZE really claims a row: inside a transaction rolled back.
                with psycopg.connect(uri) as c:
                    plan = c.execute(
                        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + GET,
                        {"owner": "bench:0", "vis": 60.0},
                    ).fetchall()
                print(f"  EXPLAIN ANALYZE of the fair claim at {n:,} queued:")
                for (line,) in plan:
                    print("    " + line)
        lat = results[n]
        print(
            f"claim latency at {n:>9,} queued (filled in {fill_s:.1f} s): p50 {pct(lat, 50) * 1e3:.3f} ms, "
            f"p99 {pct(lat, 99) * 1e3:.3f} ms over {samples} claims"
        )
    ratio = statistics.median(results[big]) / statistics.median(results[1_000])
    print(f"claim p50 ratio {big:,} / 1,000 = {ratio:.2f} (target <= 2)")


def bench_dispatch_latency(rate: float, count: int, threads: int) -> None:
    with schema() as (_name, uri):
        store, transport, settings = backends(uri)
        submitted: dict[str, float] = {}
        started: dict[str, float] = {}
        lock = threading.Lock()

        def note(turn: Turn, guard: LeaseGuard) -> None:
            with lock:
                started[turn.job_id] = time.perf_counter()

        reg = Registry()
        reg.add("note", note)
        worker = Worker(
            settings, store, transport, reg, options=WorkerOptions(threads=threads, get_wait_s=0.5, reconcile=False)
        )
        worker.start()
        time.sleep(1.0)  # idle workers, listener connected
        d = Dispatcher(store, transport, settings)
        t_next = time.perf_counter()
        for i in range(count):
            t_next += 1.0 / rate
            time.sleep(max(0.0, t_next - time.perf_counter()))
            t0 = time.perf_counter()
            h = d.submit(Submission(kind="note", tenant=f"t{i % 5}", payload=i))
            submitted[h.job_id] = t0
        deadline = time.monotonic() + 30
        while len(started) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.stop(grace_s=5)
        transport.close()
        store.close()
    lat = [started[j] - t for j, t in submitted.items() if j in started]
    print(
        f"dispatch latency at {rate:.0f} turns/s offered ({len(lat)}/{count} started): "
        f"p50 {pct(lat, 50) * 1e3:.2f} ms, p99 {pct(lat, 99) * 1e3:.2f} ms "
        "(submit -> handler start; target p50 <= 2 ms)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=1_000)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--big", type=int, default=1_000_000)
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--samples", type=int, default=2_000)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--dispatch-count", type=int, default=500)
    args = p.parse_args(argv)
    bench_submit_and_drain(args.turns, args.batch, args.threads)
    if not args.skip_big:
        bench_claim_latency(args.big, args.samples)
    bench_dispatch_latency(args.rate, args.dispatch_count, args.threads)


if __name__ == "__main__":
    sys.exit(main())
