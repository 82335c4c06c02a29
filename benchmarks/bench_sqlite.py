"""End-to-end no-op turns per second on SQLite, against a bare SQLite claim loop.

Measures, in one run on one machine:

a) submission of ``--turns`` turns through ``Dispatcher.submit_many`` in batches;
b) draining them with the built-in ``echo`` handler on ``--threads`` worker threads
   (in this process, or in ``--procs`` ``agent-dispatch-worker`` processes);
c) a bare claim loop on a fresh file with the same pragmas (WAL, busy_timeout):
   ``BEGIN IMMEDIATE; UPDATE q SET claimed=1 WHERE id=(SELECT ...) RETURNING ...; COMMIT``
   with ``synchronous=FULL`` and, for reference, ``NORMAL``;

and prints ``ratio = ours / bare``. Then d) a claim that comes up short (one turn
queued, two asked for) with none vs ``--in-flight`` turns claimed and unfinished,
each with as many turns again queued behind their session heads (ratio of p50s),
over 5 tenants and over as many tenants as turns in flight: a worker whose
concurrency is above its load claims so at every arrival. No assertion on time: the
figures are the output.

    python benchmarks/bench_sqlite.py --turns 10000 --threads 4
    python benchmarks/bench_sqlite.py --turns 10000 --threads 2 --procs 2
    python benchmarks/bench_sqlite.py --turns 2000 --profile   # cProfile of one claim loop
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import logging
import os
import pstats
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from agentdispatch import Dispatcher, Submission, Worker, WorkerOptions, load_settings, open_backends
from agentdispatch.backends.sqlite.db import BUSY_TIMEOUT_MS
from agentdispatch.factory import open_flow
from agentdispatch.handlers import builtins


def _written() -> int | None:
    """Bytes this process has caused to be written to storage (Linux only)."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class _Io:
    """Storage bytes written per turn during a phase (WAL frames, checkpoints)."""

    def __init__(self) -> None:
        self.per_turn: dict[str, float] = {}

    def measure(self, label: str, turns: int, fn: Any) -> float:
        before = _written()
        result: float = fn()
        after = _written()
        if before is not None and after is not None:
            self.per_turn[label] = (after - before) / turns
        return result


def _settings(data_dir: Path):  # type: ignore[no-untyped-def]
    return load_settings(
        AGENT_DISPATCH_DATA_DIR=str(data_dir),
        TASK_QUEUE_BACKEND="sqlite",
        AGENT_DISPATCH_MAX_DEPTH=10_000_000,
    )


def _subs(turns: int, sessions: int) -> list[Submission]:
    # sessions == 0: every turn is its own session (no serial constraint)
    return [
        Submission(kind="echo", payload={"n": i}, session_id=f"s{i % sessions}" if sessions else None)
        for i in range(turns)
    ]


def bench_submit(data_dir: Path, turns: int, batch: int, sessions: int) -> float:
    """Seconds to submit ``turns`` in batches of ``batch``."""
    settings = _settings(data_dir)
    store, transport = open_backends(settings)
    dispatcher = Dispatcher(store, transport, settings)
    subs = _subs(turns, sessions)
    t0 = time.perf_counter()
    for i in range(0, turns, batch):
        dispatcher.submit_many(subs[i : i + batch])
    elapsed = time.perf_counter() - t0
    assert store.counts(None).get("ready", 0) == turns, store.counts(None)
    transport.close()
    store.close()
    return elapsed


def _succeeded(data_dir: Path) -> int:
    conn = sqlite3.connect(data_dir / "agent_dispatch_queue.db", timeout=30)
    try:
        return int(conn.execute("SELECT count(*) FROM work_items WHERE status = 'succeeded'").fetchone()[0])
    finally:
        conn.close()


def bench_drain_threads(data_dir: Path, turns: int, threads: int, batch_max: int = 16) -> float:
    """Seconds for one in-process Worker with ``threads`` threads to drain the queue."""
    settings = _settings(data_dir)
    store, transport = open_backends(settings)
    worker = Worker(
        settings,
        store,
        transport,
        builtins(),
        options=WorkerOptions(threads=threads, get_wait_s=0.05, grace_s=10, batch_max=batch_max),
    )
    worker.preflight()

    def completed() -> float:
        # The worker's own counter: polling the file would compete for the CPU.
        got = worker.metrics.registry.get_sample_value("agent_utilities_dispatch_turns_total", {"outcome": "completed"})
        return got or 0.0

    t0 = time.perf_counter()
    worker.start()
    while completed() < turns:
        time.sleep(0.005)
    elapsed = time.perf_counter() - t0
    worker.stop()
    assert _succeeded(data_dir) == turns
    transport.close()
    store.close()
    return elapsed


def bench_drain_procs(data_dir: Path, turns: int, threads: int, procs: int) -> float:
    """Seconds for ``procs`` worker processes (``threads`` each) to drain the queue,
    counted from the spawn (so it includes interpreter start-up)."""
    env = dict(os.environ)
    env.update(AGENT_DISPATCH_DATA_DIR=str(data_dir), XDG_DATA_HOME=str(data_dir / "xdg"), TASK_QUEUE_BACKEND="sqlite")
    t0 = time.perf_counter()
    children = [
        subprocess.Popen(
            ["agent-dispatch-worker", "--workers", str(threads), "--grace", "10"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(procs)
    ]
    try:
        while _succeeded(data_dir) < turns:
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait(timeout=30)
    return elapsed


def bench_bare(path: Path, turns: int, threads: int, synchronous: str, *, pipeline: bool = False) -> float:
    """Seconds for ``threads`` threads to claim ``turns`` rows one transaction each.

    With ``pipeline``, each row instead takes our transaction shape with bare SQL:
    claim (NORMAL), mark running (NORMAL), then finish + delete (``synchronous``):
    the floor of a three-transaction turn without any Python around it."""

    def connect(sync: str = synchronous) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {sync}")
        return conn

    setup = connect()
    setup.execute("CREATE TABLE q (id INTEGER PRIMARY KEY, claimed INTEGER NOT NULL DEFAULT 0, body TEXT NOT NULL)")
    setup.execute("CREATE INDEX q_unclaimed ON q (id) WHERE claimed = 0")
    setup.execute("BEGIN IMMEDIATE")
    setup.executemany("INSERT INTO q (body) VALUES (?)", [(f'{{"n": {i}}}',) for i in range(turns)])
    setup.execute("COMMIT")
    setup.close()
    claimed = [0] * threads

    def pipeline_loop(index: int) -> None:
        fast, durable = connect("NORMAL"), connect()
        while True:
            fast.execute("BEGIN IMMEDIATE")
            row = fast.execute(
                "UPDATE q SET claimed = 1 WHERE id = (SELECT id FROM q WHERE claimed = 0 ORDER BY id LIMIT 1) "
                "RETURNING id, body"
            ).fetchone()
            fast.execute("COMMIT")
            if row is None:
                break
            fast.execute("BEGIN IMMEDIATE")
            fast.execute("UPDATE q SET claimed = 2 WHERE id = ?", (row[0],))
            fast.execute("COMMIT")
            durable.execute("BEGIN IMMEDIATE")
            durable.execute("UPDATE q SET body = ? WHERE id = ?", (row[1], row[0]))
            durable.execute("DELETE FROM q WHERE id = ?", (row[0],))
            durable.execute("COMMIT")
            claimed[index] += 1
        fast.close()
        durable.close()

    def loop(index: int) -> None:
        conn = connect()
        while True:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute(
                "UPDATE q SET claimed = 1 WHERE id = (SELECT id FROM q WHERE claimed = 0 ORDER BY id LIMIT 1) "
                "RETURNING id, body"
            ).fetchone()
            conn.execute("COMMIT")
            if row is None:
                break
            claimed[index] += 1
        conn.close()

    target = pipeline_loop if pipeline else loop
    workers = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - t0
    assert sum(claimed) == turns, claimed
    return elapsed


def _verb(sql: str) -> str:
    code = [ln for ln in sql.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    return code[0].split(None, 1)[0].upper() if code else "?"


def profile_one_loop(data_dir: Path, turns: int, top: int) -> str:
    """Count SQL statements per turn over a first slice of the queue, then
    cProfile one claim loop (get -> claim -> handler -> commit -> ack) run in
    this thread over the rest; returns the report."""
    settings = _settings(data_dir)
    statements: Counter[str] = Counter()
    tracing = [True]
    real_connect = sqlite3.connect

    def count(sql: str) -> None:
        if tracing[0]:
            statements.update([_verb(sql)])

    def traced_connect(*a: Any, **kw: Any) -> sqlite3.Connection:
        # SQLite reports every statement it runs, BEGIN and COMMIT included.
        conn = real_connect(*a, **kw)
        conn.set_trace_callback(count)
        return conn

    store, transport = open_backends(settings)
    worker = Worker(settings, store, transport, builtins(), options=WorkerOptions(threads=1))
    loop = asyncio.new_event_loop()

    def run(n: int) -> int:
        done = 0
        while done < n:
            label = worker.poll("profiler:0", 0, loop)
            if label is None:
                break
            done += label in ("completed", "pending")  # pending: committed with its batch
        return done

    sqlite3.connect = traced_connect  # type: ignore[assignment]
    try:
        store.close()  # reopen this thread's connections through the traced connect
        transport.close()
        run(1)  # warm-up: connections opened, statements cached
        statements.clear()
        counted = run(max(1, turns // 5))
        tracing[0] = False
        prof = cProfile.Profile()
        prof.enable()
        done = run(turns)
        prof.disable()
    finally:
        sqlite3.connect = real_connect
        loop.close()
        transport.close()
        store.close()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    # Which of our functions issue the SQL, and what each costs (COMMIT fsyncs included).
    stats.sort_stats("tottime").print_callers(r"method 'execute' of 'sqlite3")
    raw = stats.stats  # type: ignore[attr-defined]
    calls = sum(v[1] for k, v in raw.items() if "method 'execute' of 'sqlite3" in k[2])
    verbs = ", ".join(f"{verb} {n / max(1, counted):.2f}" for verb, n in statements.most_common())
    return (
        f"SQL statements per turn (over {counted} turns): {verbs}\n"
        f"profiled {done} turns; {calls / max(1, done):.1f} sqlite3 execute() calls per turn\n" + out.getvalue()
    )


def short_claims(data_dir: Path, in_flight: int, samples: int, tenants: int = 5) -> list[float]:
    """Latency of claims that come up short (a batch claim of 2 with one turn
    queued) while ``in_flight`` turns over ``tenants`` tenants are claimed and
    not finished, each with one turn queued behind it in its session."""
    settings = _settings(data_dir)
    store, transport = open_backends(settings)
    flow = open_flow(store, transport)
    assert flow is not None
    d = Dispatcher(store, transport, settings)
    lat = []
    try:
        for i in range(0, in_flight, 500):
            k = min(500, in_flight - i)
            d.submit_many(
                [
                    Submission(kind="note", tenant=f"t{(i + j) % tenants}", session_id=f"s{i + j}")
                    for _ in "ab"
                    for j in range(k)
                ]
            )
        while flow.claim("w:0", 100, ttl_s=3600).claimed:
            pass
        for i in range(samples):
            d.submit(Submission(kind="note", tenant=f"t{i % tenants}"))
            t0 = time.perf_counter()
            got = flow.claim("w:0", 2, ttl_s=3600).claimed
            lat.append(time.perf_counter() - t0)
            assert len(got) == 1
    finally:
        transport.close()
        store.close()
    return lat


def bench_in_flight_claims(root: Path, in_flight: int, samples: int) -> list[str]:
    """The lines to print of the short-claim run."""
    out = []
    results: dict[int, list[float]] = {}
    for n in (0, in_flight):
        results[n] = lat = sorted(short_claims(root / f"in_flight{n}", n, samples))
        out.append(
            f"claim that comes up short with {n:>6,} turns in flight: p50 {statistics.median(lat) * 1e3:.3f} ms, "
            f"p99 {lat[int(len(lat) * 0.99)] * 1e3:.3f} ms over {samples} claims"
        )
    ratio = statistics.median(results[in_flight]) / statistics.median(results[0])
    out.append(f"short claim p50 ratio {in_flight:,} in flight / none = {ratio:.2f} (target <= 2)")
    # A fleet of one-conversation customers: every turn in flight its own tenant.
    lat = sorted(short_claims(root / "in_flight_tenants", in_flight, samples, tenants=max(1, in_flight)))
    out.append(
        f"claim that comes up short with {in_flight:>6,} turns in flight over as many tenants: "
        f"p50 {statistics.median(lat) * 1e3:.3f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.3f} ms"
    )
    ratio = statistics.median(lat) / statistics.median(results[0])
    out.append(f"short claim p50 ratio {in_flight:,} tenants in flight / none = {ratio:.2f} (target <= 2)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=4, help="worker threads (per process with --procs)")
    parser.add_argument("--procs", type=int, default=0, help="worker processes (0 = threads in this process)")
    parser.add_argument("--batch", type=int, default=1000, help="submit_many batch size (as bench_postgres)")
    parser.add_argument("--sessions", type=int, default=0, help="spread turns over this many sessions (0 = one each)")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the files (default: a temp dir)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one claim loop")
    parser.add_argument("--batch-max", type=int, default=32, help="WorkerOptions.batch_max (1: a commit per turn)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and bare FULL (median)")
    parser.add_argument("--top", type=int, default=25, help="profile entries to print")
    parser.add_argument("--in-flight", type=int, default=5_000, help="turns in flight for the short-claim run")
    parser.add_argument("--skip-in-flight", action="store_true", help="skip the short-claim run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    rounds: list[tuple[float, float, float]] = []  # (submit, ours, bare FULL) seconds
    with tempfile.TemporaryDirectory(prefix="ad-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        io_ = _Io()
        bare_threads = args.procs * args.threads if args.procs else args.threads
        shape = f"{args.procs} procs x {args.threads} threads" if args.procs else f"{args.threads} threads"
        # Ours and the bare loop alternate, so that a change in the disk's
        # fsync latency during the run shows in both sides of a round's ratio.
        for r in range(args.rounds):
            ours_dir = root / f"ours{r}"
            t_submit = bench_submit(ours_dir, args.turns, args.batch, args.sessions)
            if args.procs:
                t_ours = bench_drain_procs(ours_dir, args.turns, args.threads, args.procs)
            else:
                t_ours = io_.measure(
                    "ours",
                    args.turns,
                    lambda: bench_drain_threads(ours_dir, args.turns, args.threads, args.batch_max),  # noqa: B023
                )
            t_full = io_.measure(
                "bare FULL",
                args.turns,
                lambda: bench_bare(root / f"bare_full{r}.db", args.turns, bare_threads, "FULL"),  # noqa: B023
            )
            rounds.append((t_submit, t_ours, t_full))
        t_normal = bench_bare(root / "bare_normal.db", args.turns, bare_threads, "NORMAL")
        t_pipe = io_.measure(
            "bare 3-tx",
            args.turns,
            lambda: bench_bare(root / "bare_pipeline.db", args.turns, bare_threads, "FULL", pipeline=True),
        )
        profile: str | None = None
        if args.profile:
            prof_dir = root / "profile"
            n = min(args.turns, 2000)
            bench_submit(prof_dir, n + n // 5 + 1, args.batch, args.sessions)
            profile = profile_one_loop(prof_dir, n, args.top)
        in_flight = [] if args.skip_in_flight else bench_in_flight_claims(root, args.in_flight, 300)

    ratios = [t_full / t_ours for _s, t_ours, t_full in rounds]
    mid = sorted(range(len(rounds)), key=lambda i: ratios[i])[len(rounds) // 2]  # the median round
    t_submit, t_ours, t_full = rounds[mid]
    ours = args.turns / t_ours
    full = args.turns / t_full
    normal = args.turns / t_normal
    pipe = args.turns / t_pipe
    sessions = args.sessions or args.turns
    py = sys.version.split()[0]
    print(f"agentdispatch SQLite benchmark: {args.turns} no-op turns over {sessions} sessions, python {py}")
    for i, (sub, o, f) in enumerate(rounds):
        print(
            f"  round {i + 1}: submit {sub:6.3f} s, ours {args.turns / o:7.0f} turns/s, "
            f"bare FULL {args.turns / f:7.0f} claims/s, ratio {ratios[i]:.3f}"
        )
    print(f"the median round ({mid + 1}) in full:")
    print(f"  submit ({args.batch}/batch)      {t_submit:8.3f} s   {args.turns / t_submit:10.0f} turns/s")
    print(f"  ours  drain ({shape:>16}) {t_ours:8.3f} s   {ours:10.0f} turns/s")
    print(f"  bare  claim FULL   ({bare_threads:>2} thr) {t_full:8.3f} s   {full:10.0f} claims/s")
    print(f"  bare  claim NORMAL ({bare_threads:>2} thr) {t_normal:8.3f} s   {normal:10.0f} claims/s")
    print(f"  bare  3-tx turn    ({bare_threads:>2} thr) {t_pipe:8.3f} s   {pipe:10.0f} turns/s (NORMAL,NORMAL,FULL)")
    print(f"ratio = ours / bare(FULL)   = {ours / full:.3f}   (median of {len(rounds)} rounds; target >= 0.5)")
    print(f"ratio = ours / bare(NORMAL) = {ours / normal:.3f}")
    print(f"ratio = ours / bare(3-tx)   = {ours / pipe:.3f}   (same transaction count, bare SQL)")
    print(f"submit {args.turns} turns: {t_submit:.3f} s   (target < 2 s)")
    if io_.per_turn:
        sizes = ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in io_.per_turn.items())
        print(f"storage written per turn: {sizes}")
    for line in in_flight:
        print(line)
    if profile:
        print()
        print(profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
