"""PostgreSQL backend benchmarks, each against a reference measured in the same run.

1. submit: ``--turns`` turns through ``Dispatcher.submit_many`` (``--batch`` per call).
2. end to end: a Worker with ``--threads`` threads drains them with the no-op ``echo``
   handler, then ``--procs`` worker processes of one thread each (one Python process is
   GIL-bound); each against a bare ``DELETE ... WHERE id = (SELECT ... FOR UPDATE SKIP
   LOCKED LIMIT 1) RETURNING`` loop on the same database with as many threads or
   processes. Prints the ratios and where our time goes: statements and worker CPU per
   turn, time inside each store/transport call.
3. claim latency: p50/p99 of the fair claim with 1,000 vs ``--big`` queued rows over
   10,000 tenants and 100,000 sessions, with the EXPLAIN plan (ratio of p50s).
   Then a claim that comes up short (one turn queued, two asked for) with none vs
   ``--in-flight`` turns claimed and unfinished, over 5 tenants and over one tenant
   per turn (ratios of p50s): a worker whose concurrency is above its load claims
   so at every arrival.
4. dispatch latency: ``--rate`` turns/s offered to idle workers: submit call -> handler
   start, and submit returned (its commit visible) -> handler start; once with the
   workers in the submitting process, once in a worker process of their own; for the
   async worker (what ``agentdispatch worker`` runs, ``--concurrency`` = ``--threads``)
   and the thread Worker (``--dispatch-worker`` picks; default both); against
   a bare durable INSERT + NOTIFY woken by LISTEN and claimed with the bare delete
   (on a virtual machine, waking an idle process dominates both).

    python benchmarks/bench_postgres.py                      # everything, 1M backlog
    python benchmarks/bench_postgres.py --big 100000         # a smaller big backlog
    python benchmarks/bench_postgres.py --skip-big
    python benchmarks/bench_postgres.py --skip-big --skip-dispatch --batch-max 1   # A/B: a commit per turn
    python benchmarks/bench_postgres.py --skip-drain --skip-big                  # dispatch latency only

``AGENTDISPATCH_TEST_PG`` names the server (default: the local development one).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import random
import resource
import secrets
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from agentdispatch import Dispatcher, Submission, Worker, WorkerOptions, load_settings
from agentdispatch.backends.postgres.db import explain_nested
from agentdispatch.backends.postgres.store import PostgresStore
from agentdispatch.backends.postgres.transport import PostgresTransport
from agentdispatch.handlers import Registry, Turn, builtins
from agentdispatch.lease import LeaseGuard
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.sqlfiles import queries

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
GET = queries("agentdispatch.backends.postgres.sql", "transport.sql")["get"]
#: One turn for a claimer that marks itself waiting for nobody (no listener).
CLAIM_ARGS = {"owner": "bench:0", "vis": 60.0, "n": 1, "read": False, "listener": None, "mark_s": 0.0}


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


class Statements:
    """Statements sent by this process (every psycopg ``Cursor.execute``)."""

    def __init__(self) -> None:
        self.n = 0
        original = psycopg.Cursor.execute

        def counted(cur: Any, *a: Any, **kw: Any) -> Any:
            self.n += 1
            return original(cur, *a, **kw)

        psycopg.Cursor.execute = counted  # type: ignore[method-assign]


def cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def server_cpu_s() -> float | None:
    """CPU seconds used so far by the PostgreSQL processes on this machine, exited
    backends included (Linux, a server on this host; None otherwise): where the
    rest of a turn goes."""
    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    try:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                text = stat.read_text()
                name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
                if name.startswith("postgres"):
                    # Own time, plus that of reaped children (backends that exited).
                    total += sum(int(x) for x in rest[11:15]) / ticks
    except OSError:
        return None
    return total or None


def drain_worker(
    uri: str, threads: int, turns: int, stop: Any = None, out: Any = None, batch_max: int = 16
) -> tuple[float, dict[str, float], dict[str, int], int, float]:
    """Run a Worker until ``stop`` is set (a process of a fleet) or until
    ``turns`` turns succeeded; returns (seconds, timers, calls, statements, cpu)."""
    store = PostgresStore(uri)
    transport = PostgresTransport(store)
    settings = load_settings(STATE_DB_URI=uri, AGENT_DISPATCH_MAX_DEPTH=max(100_000, turns))
    timers = Timers()
    timers.wrap(store, "store", ["claim", "claim_many", "commit", "commit_many", "heartbeat"])
    timers.wrap(transport, "transport", ["get", "get_many", "ack", "ack_many", "release"])
    stmts = Statements()
    worker = Worker(
        settings,
        store,
        transport,
        builtins(),
        options=WorkerOptions(threads=threads, get_wait_s=0.2, reconcile=False, batch_max=batch_max),
    )
    # The worker's batch verbs (each one transaction of store and queue).
    timers.wrap(worker.flow, "flow", ["claim", "finish", "release"])
    cpu0, t0 = cpu_s(), time.perf_counter()
    worker.start()
    if stop is not None:
        stop.wait()
    else:
        while store.counts(None).get("succeeded", 0) < turns:
            time.sleep(0.2)  # a count over every item: keep the harness's share small
    took, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    worker.stop(grace_s=5)
    transport.close()
    store.close()
    result = (took, dict(timers.total), dict(timers.calls), stmts.n, cpu)
    if out is not None:
        out.put(result)
    return result


def fresh_backlog(uri: str, turns: int, batch: int) -> float:
    """Migrate, submit ``turns`` echo turns; returns the submit seconds."""
    store, transport, settings = backends(uri, AGENT_DISPATCH_MAX_DEPTH=max(100_000, turns))
    d = Dispatcher(store, transport, settings)
    subs = [Submission(kind="echo", tenant=f"t{i % 10}", payload=i) for i in range(turns)]
    t0 = time.perf_counter()
    for i in range(0, turns, batch):
        d.submit_many(subs[i : i + batch])
    took = time.perf_counter() - t0
    transport.close()
    store.close()
    return took


def drain_fleet(
    uri: str, procs: int, turns: int, batch_max: int
) -> tuple[float, dict[str, float], dict[str, int], int, float]:
    """``procs`` worker processes (one claim thread each) drain the backlog."""
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    fleet = [ctx.Process(target=drain_worker, args=(uri, 1, turns, stop, out, batch_max)) for _ in range(procs)]
    for p in fleet:
        p.start()
    first: tuple[float, int] | None = None
    with psycopg.connect(uri, autocommit=True) as c:
        while True:
            row = c.execute("SELECT count(*) FROM work_items WHERE status = 'succeeded'").fetchone()
            done = 0 if row is None else int(row[0])
            if first is None and done > 0:
                first = (time.perf_counter(), done)  # from here on every process is draining
            if done >= turns:
                break
            time.sleep(0.01)
    assert first is not None
    took = (time.perf_counter() - first[0]) * turns / max(1, turns - first[1])  # scaled to all turns
    stop.set()
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    stmts, cpu = 0, 0.0
    for _ in fleet:
        _t, tot, cl, n, c_s = out.get(timeout=60)
        for k, v in tot.items():
            totals[k] += v
        for k, n_calls in cl.items():
            calls[k] += n_calls
        stmts += n
        cpu += c_s
    for p in fleet:
        p.join(timeout=30)
    return took, dict(totals), dict(calls), stmts, cpu


def _bare_loop(uri: str) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        while c.execute(
            "DELETE FROM bare_q WHERE id = (SELECT id FROM bare_q ORDER BY id "
            "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id, body"
        ).fetchone():
            pass


def bare_rate(turns: int, n: int, processes: bool) -> float:
    """Rows/s of ``n`` threads or processes running the bare SKIP LOCKED delete loop."""
    with schema() as (_name, uri):
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE bare_q (id bigserial PRIMARY KEY, body text NOT NULL)")
            c.execute("INSERT INTO bare_q (body) SELECT '{}' FROM generate_series(1, %s)", (turns,))
            c.execute("ANALYZE bare_q")
        ctx = mp.get_context("spawn")
        pool: list[Any] = [
            ctx.Process(target=_bare_loop, args=(uri,))
            if processes
            else threading.Thread(target=_bare_loop, args=(uri,))
            for _ in range(n)
        ]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return turns / (time.perf_counter() - t0)


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def breakdown(
    turns: int,
    busy_s: float,
    totals: dict[str, float],
    calls: dict[str, int],
    stmts: int,
    cpu: float,
    server: float | None = None,
    bare_server: float | None = None,
) -> None:
    print(f"    statements per turn {stmts / turns:.1f}; worker CPU per turn {cpu / turns * 1e6:,.0f} us")
    if server is not None and bare_server is not None:
        print(
            f"    PostgreSQL server CPU per turn {server / turns * 1e6:,.0f} us "
            f"(bare loop: {bare_server / turns * 1e6:,.0f} us per row)"
        )
    for key in sorted(totals, key=lambda k: -totals[k]):
        print(
            f"    {key:<20} {totals[key] / turns * 1e6:7.0f} us/turn  {calls[key]:>7} calls "
            f"{100 * totals[key] / busy_s:5.1f}% of claim-thread time"
        )


def bench_submit_and_drain(turns: int, batch: int, threads: int, procs: int, batch_max: int) -> None:
    with schema() as (_name, uri):
        submit_s = fresh_backlog(uri, turns, batch)
        print(
            f"submit: {turns} turns via submit_many (batches of {batch}) in {submit_s:.2f} s "
            f"({turns / submit_s:,.0f}/s; target < 2 s for 10,000)"
        )
        server0 = server_cpu_s()
        took, totals, calls, stmts, cpu = drain_worker(uri, threads, turns, batch_max=batch_max)
        server = _delta(server0, server_cpu_s())
    ours_t = turns / took
    bare0 = server_cpu_s()
    bare_t = bare_rate(turns, threads, processes=False)
    bare_server = _delta(bare0, server_cpu_s())
    print(
        f"end to end, {threads} threads in one process: {ours_t:,.0f} turns/s; bare SKIP LOCKED delete loop "
        f"{bare_t:,.0f} rows/s; ratio = {ours_t / bare_t:.2f} (target >= 0.4)"
    )
    breakdown(turns, took * threads, totals, calls, stmts, cpu, server, bare_server)
    with schema() as (_name, uri):
        # The same backlog again, submitted in one call (one transaction).
        submit_s = fresh_backlog(uri, turns, turns)
        print(f"submit: {turns} turns via one submit_many call in {submit_s:.2f} s ({turns / submit_s:,.0f}/s)")
        server0 = server_cpu_s()
        took, totals, calls, stmts, cpu = drain_fleet(uri, procs, turns, batch_max)
        server = _delta(server0, server_cpu_s())
    ours_p = turns / took
    bare0 = server_cpu_s()
    bare_p = bare_rate(turns, procs, processes=True)
    bare_server = _delta(bare0, server_cpu_s())
    print(
        f"end to end, {procs} worker processes x 1 thread: {ours_p:,.0f} turns/s; "
        f"bare loop in {procs} processes {bare_p:,.0f} rows/s; ratio = {ours_p / bare_p:.2f} (target >= 0.4)"
    )
    breakdown(turns, took * procs, totals, calls, stmts, cpu, server, bare_server)


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
            row = c.execute(GET, CLAIM_ARGS).fetchone()
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
                # The fair claim runs inside dispatch_claim: auto_explain shows
                # its plan as executed there (in a transaction rolled back).
                with psycopg.connect(uri) as c:
                    plan = explain_nested(c, GET, CLAIM_ARGS, analyze=True)
                print(f"  EXPLAIN ANALYZE of the fair claim at {n:,} queued (auto_explain, inside dispatch_claim):")
                for line in plan.splitlines():
                    print("    " + line)
        lat = results[n]
        print(
            f"claim latency at {n:>9,} queued (filled in {fill_s:.1f} s): p50 {pct(lat, 50) * 1e3:.3f} ms, "
            f"p99 {pct(lat, 99) * 1e3:.3f} ms over {samples} claims"
        )
    ratio = statistics.median(results[big]) / statistics.median(results[1_000])
    print(f"claim p50 ratio {big:,} / 1,000 = {ratio:.2f} (target <= 2)")


def short_claims(uri: str, in_flight: int, samples: int, tenants: int = 5) -> list[float]:
    """Latency of claims that come up short (a claim of 2 with one turn queued)
    while ``in_flight`` turns over ``tenants`` tenants are claimed and not
    finished, as arrivals (of those tenants) trickle into a worker whose
    concurrency is above its load."""
    store, transport, settings = backends(uri, AGENT_DISPATCH_MAX_DEPTH=10_000_000)
    d = Dispatcher(store, transport, settings)
    lat = []
    try:
        for i in range(0, in_flight, 1_000):
            d.submit_many(
                [Submission(kind="note", tenant=f"t{(i + j) % tenants}") for j in range(min(1_000, in_flight - i))]
            )
        with psycopg.connect(uri, autocommit=True) as c:
            while c.execute(GET, {**CLAIM_ARGS, "vis": 3600.0, "n": 500}).fetchall():
                pass
            for i in range(samples):
                d.submit(Submission(kind="note", tenant=f"t{i * 7919 % tenants}"))
                t0 = time.perf_counter()
                rows = c.execute(GET, {**CLAIM_ARGS, "vis": 3600.0, "n": 2}).fetchall()
                lat.append(time.perf_counter() - t0)
                assert len(rows) == 1
    finally:
        transport.close()
        store.close()
    return lat


def bench_in_flight_claims(in_flight: int, samples: int) -> None:
    """None in flight, then ``in_flight`` over 5 tenants, then over as many
    tenants as turns (one customer each): ratios to the first."""
    runs = [(0, 1), (in_flight, 5), (in_flight, in_flight)]
    results: dict[tuple[int, int], list[float]] = {}
    for n, tenants in runs:
        with schema() as (_name, uri):
            results[n, tenants] = lat = short_claims(uri, n, samples, tenants)
        print(
            f"claim that comes up short with {n:>6,} turns in flight over {tenants:>6,} tenant(s): "
            f"p50 {pct(lat, 50) * 1e3:.3f} ms, p99 {pct(lat, 99) * 1e3:.3f} ms over {samples} claims"
        )
    none = statistics.median(results[runs[0]])
    for key in runs[1:]:
        ratio = statistics.median(results[key]) / none
        what = f"{key[0]:,} in flight over {key[1]:,} tenant(s)"
        print(f"short claim p50 ratio {what} / none = {ratio:.2f} (target <= 2)")


#: Random (Poisson) arrivals instead of evenly spaced ones (``--poisson``):
#: bursts, as real traffic has, put submissions close behind each other.
POISSON = False


def _offer(d: Dispatcher, rate: float, count: int) -> dict[str, tuple[float, float]]:
    """Submit ``count`` turns at ``rate``/s; job id -> (call, returned) perf_counter times."""
    submitted: dict[str, tuple[float, float]] = {}
    gaps = random.Random(18)
    t_next = time.perf_counter()
    for i in range(count):
        t_next += gaps.expovariate(rate) if POISSON else 1.0 / rate
        time.sleep(max(0.0, t_next - time.perf_counter()))
        t0 = time.perf_counter()
        h = d.submit(Submission(kind="note", tenant=f"t{i % 5}", payload=i))
        submitted[h.job_id] = (t0, time.perf_counter())
    return submitted


class _Running:
    """A worker of either kind, started and stopped the same way."""

    def __init__(self, kind: str, settings: Any, store: Any, transport: Any, reg: Registry, threads: int) -> None:
        self._thread: threading.Thread | None = None
        self._async: AsyncWorker | None = None
        self._worker: Worker | None = None
        if kind == "async":
            opts = RuntimeOptions(concurrency=threads, threads=threads, reconcile=False)
            self._async = AsyncWorker(settings, store, transport, reg, options=opts)
        else:
            opts_t = WorkerOptions(threads=threads, get_wait_s=0.5, reconcile=False)
            self._worker = Worker(settings, store, transport, reg, options=opts_t)

    def start(self) -> None:
        if self._async is not None:
            self._thread = threading.Thread(target=self._async.run_forever, name="async-worker", daemon=True)
            self._thread.start()
        else:
            assert self._worker is not None
            self._worker.start()

    def stop(self) -> None:
        if self._async is not None:
            self._async.request_stop()
            assert self._thread is not None
            self._thread.join(timeout=30)
        else:
            assert self._worker is not None
            self._worker.stop(grace_s=5)


def _latency_worker(uri: str, kind: str, threads: int, ready: Any, stop: Any, out: Any) -> None:
    """A worker process whose handler reports when each turn started
    (``perf_counter`` is the host's monotonic clock, shared by processes)."""
    store = PostgresStore(uri)
    transport = PostgresTransport(store)
    settings = load_settings(STATE_DB_URI=uri)
    reg = Registry()
    reg.add("note", lambda turn, guard: out.put((turn.job_id, time.perf_counter())))
    worker = _Running(kind, settings, store, transport, reg, threads)
    worker.start()
    time.sleep(1.0)  # idle workers, listener connected
    ready.set()
    stop.wait()
    worker.stop()
    transport.close()
    store.close()


def _bare_consumer(uri: str, ready: threading.Event, stop: threading.Event, started: dict[int, float]) -> None:
    """Wake on NOTIFY, claim with the bare SKIP LOCKED delete, note the time."""
    with psycopg.connect(uri, autocommit=True) as listen, psycopg.connect(uri, autocommit=True) as c:
        listen.execute("LISTEN bare_d")
        ready.set()
        while not stop.is_set():
            for _ in listen.notifies(timeout=0.2, stop_after=1):
                while row := c.execute(
                    "DELETE FROM bare_d WHERE id = (SELECT id FROM bare_d ORDER BY id "
                    "FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING id"
                ).fetchone():
                    started[int(row[0])] = time.perf_counter()


def bare_dispatch_latency(rate: float, count: int) -> list[float]:
    """The floor of dispatch latency on this machine: a durable one-row INSERT
    with NOTIFY, a consumer woken by LISTEN that claims it with the bare SKIP
    LOCKED delete; insert call -> claimed, at the same offered rate."""
    with schema() as (_name, uri):
        with psycopg.connect(uri, autocommit=True) as c:
            c.execute("CREATE TABLE bare_d (id bigint PRIMARY KEY, body text NOT NULL)")
        started: dict[int, float] = {}
        ready, stop = threading.Event(), threading.Event()
        consumer = threading.Thread(target=_bare_consumer, args=(uri, ready, stop, started), daemon=True)
        consumer.start()
        ready.wait(timeout=30)
        submitted: dict[int, float] = {}
        with psycopg.connect(uri, autocommit=True) as c:
            t_next = time.perf_counter()
            for i in range(count):
                t_next += 1.0 / rate
                time.sleep(max(0.0, t_next - time.perf_counter()))
                submitted[i] = time.perf_counter()
                c.execute(f"BEGIN; INSERT INTO bare_d VALUES ({i:d}, '{{}}'); NOTIFY bare_d; COMMIT".encode())
        deadline = time.monotonic() + 10
        while len(started) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        consumer.join(timeout=5)
    return [started[i] - t0 for i, t0 in submitted.items() if i in started]


#: A start this late after its submission returned waited for a poll, not a wake.
LATE_S = 0.1


def bench_dispatch_latency(
    rate: float, count: int, threads: int, *, separate: bool, kind: str = "thread", bare: list[float] | None = None
) -> None:
    """Submit -> handler start at light load: the workers in this process (they
    share its GIL with the submitter), or in a process of their own (as a
    gateway and a worker fleet run)."""
    with schema() as (_name, uri):
        store, transport, settings = backends(uri)
        started: dict[str, float] = {}
        if separate:
            ctx = mp.get_context("spawn")
            ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_latency_worker, args=(uri, kind, threads, ready, stop, out))
            proc.start()
            ready.wait(timeout=60)
            submitted = _offer(Dispatcher(store, transport, settings), rate, count)
            deadline = time.monotonic() + 30
            while len(started) < count and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    job_id, at = out.get(timeout=0.5)
                    started[job_id] = at
            stop.set()
            proc.join(timeout=30)
        else:
            lock = threading.Lock()

            def note(turn: Turn, guard: LeaseGuard) -> None:
                with lock:
                    started[turn.job_id] = time.perf_counter()

            reg = Registry()
            reg.add("note", note)
            worker = _Running(kind, settings, store, transport, reg, threads)
            worker.start()
            time.sleep(1.0)  # idle workers, listener connected
            submitted = _offer(Dispatcher(store, transport, settings), rate, count)
            deadline = time.monotonic() + 30
            while len(started) < count and time.monotonic() < deadline:
                time.sleep(0.05)
            worker.stop()
        transport.close()
        store.close()
    whole = [started[j] - t0 for j, (t0, _t1) in submitted.items() if j in started]
    after = [started[j] - t1 for j, (_t0, t1) in submitted.items() if j in started]
    submit = [t1 - t0 for t0, t1 in submitted.values()]
    where = "a worker process of its own" if separate else "this process"
    who = f"the async worker (concurrency {threads})" if kind == "async" else f"{threads} idle Worker threads"
    how = "Poisson arrivals" if POISSON else "evenly spaced"
    print(f"dispatch latency at {rate:.0f} turns/s ({how}) offered to {who} in {where} ({len(whole)}/{count} started):")
    print(
        f"    submit call -> handler start:            p50 {pct(whole, 50) * 1e3:.2f} ms, "
        f"p99 {pct(whole, 99) * 1e3:.2f} ms (target p50 <= 2 ms)"
    )
    if bare:
        print(
            f"    bare INSERT+NOTIFY -> LISTEN wake + SKIP LOCKED delete: p50 {pct(bare, 50) * 1e3:.2f} ms, "
            f"p99 {pct(bare, 99) * 1e3:.2f} ms; ratio of p50s ours / bare = {pct(whole, 50) / pct(bare, 50):.2f}"
        )
    print(
        f"    submit returned (commit visible) -> start: p50 {pct(after, 50) * 1e3:.2f} ms, "
        f"p99 {pct(after, 99) * 1e3:.2f} ms, {sum(1 for x in after if x > LATE_S)} started "
        f"over {LATE_S * 1e3:.0f} ms late (a missed wake waits for the poll)"
    )
    print(
        f"    the durable submit itself:               p50 {pct(submit, 50) * 1e3:.2f} ms, "
        f"p99 {pct(submit, 99) * 1e3:.2f} ms"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=1_000)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--procs", type=int, default=4, help="worker processes (one claim thread each)")
    p.add_argument("--big", type=int, default=1_000_000)
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--samples", type=int, default=2_000)
    p.add_argument("--in-flight", type=int, default=5_000, help="turns in flight for the short-claim run")
    p.add_argument("--skip-in-flight", action="store_true", help="skip the short-claim run")
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--dispatch-count", type=int, default=500)
    p.add_argument("--batch-max", type=int, default=32, help="WorkerOptions.batch_max (1: a commit per turn)")
    p.add_argument("--skip-dispatch", action="store_true", help="skip the dispatch latency runs")
    p.add_argument("--skip-drain", action="store_true", help="skip the drain throughput runs")
    p.add_argument(
        "--dispatch-worker",
        choices=["async", "thread", "both"],
        default="both",
        help="which worker the dispatch latency runs measure (async: what `agentdispatch worker` runs)",
    )
    p.add_argument("--poisson", action="store_true", help="random (Poisson) arrivals in the dispatch latency runs")
    args = p.parse_args(argv)
    global POISSON
    POISSON = args.poisson
    if not args.skip_drain:
        bench_submit_and_drain(args.turns, args.batch, args.threads, args.procs, args.batch_max)
    if not args.skip_big:
        bench_claim_latency(args.big, args.samples)
    if not args.skip_in_flight:
        bench_in_flight_claims(args.in_flight, min(args.samples, 500))
    if args.skip_dispatch:
        return
    bare = bare_dispatch_latency(args.rate, args.dispatch_count)
    kinds = ["async", "thread"] if args.dispatch_worker == "both" else [args.dispatch_worker]
    for kind in kinds:
        for separate in (False, True):
            bench_dispatch_latency(
                args.rate, args.dispatch_count, args.threads, separate=separate, kind=kind, bare=bare
            )


if __name__ == "__main__":
    sys.exit(main())
