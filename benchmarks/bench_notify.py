"""Reliability scenario 18: what the queue's NOTIFY costs many concurrent enqueuers.

Durable single submissions from ``--procs`` processes x ``--threads`` threads for
``--seconds`` s on a fresh PostgreSQL schema, while ``--workers`` async worker
processes (LISTEN, wake, claim, run a no-op turn) drain the queue, so that
claimers wait for news during the run as they do in production. Arms, each
in a process of its own, alternating for ``--rounds`` rounds:

* shipped: this checkout as it is (enqueuers notify while a claimer waits);
* polling only: this checkout with the enqueue triggers' ``pg_notify`` removed;
* baseline: ``--baseline-src DIR`` (another checkout's ``src``, e.g. a worktree
  of main) as it is, when given.

PostgreSQL serializes the commits of transactions that notify (a database-wide
lock held through the commit's flush), so the ratio to polling only shows what
the wake-ups cost the submitters; the scenario passes at >= 0.8. Each arm also
reports how many notifications the channel carried per submission, the
submit calls' p50 and p99, and the queue's depth at the end (workers keeping
up or not). At full speed the workers fall behind and nobody waits; with
``--rate`` (per submitter) low enough for the workers to keep up they wait
for news between turns, and the submit latency shows what notifying costs.
No assertions.

    python benchmarks/bench_notify.py --procs 4 --threads 20 --baseline-src ../wt-base/src
    python benchmarks/bench_notify.py --rate 2 --baseline-src ../wt-base/src
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
CHANNEL = "agent_dispatch_queue"
#: The enqueue triggers' wake-ups, and what replaces them for polling only.
NOTIFIES = {
    "dispatch_queue_added": ("PERFORM pg_notify('agent_dispatch_queue', '');", "NULL;"),
    "dispatch_queue_added_many": ("PERFORM pg_notify('agent_dispatch_queue', n::text);", "NULL;"),
}


@contextmanager
def schema(notify: bool) -> Iterator[str]:
    """A fresh, migrated schema's URI (without the NOTIFYs unless ``notify``)."""
    from agentdispatch.backends.postgres.store import PostgresStore

    name = "bench_" + secrets.token_hex(4)
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {name}")
    sep = "&" if "?" in BASE else "?"
    uri = f"{BASE}{sep}options={quote(f'-csearch_path={name}')}"
    try:
        store = PostgresStore(uri)
        store.migrate()
        store.close()
        if not notify:
            with psycopg.connect(uri, autocommit=True) as c:
                for fn, (call, instead) in NOTIFIES.items():
                    row = c.execute("SELECT pg_get_functiondef(%s::regproc)", (fn,)).fetchone()
                    assert row is not None and call in row[0], fn
                    c.execute(row[0].replace(call, instead))
        yield uri
    finally:
        with psycopg.connect(BASE, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {name} CASCADE")


def enqueuer(uri: str, threads: int, seconds: float, rate: float, go: Any, out: Any) -> None:
    """One process of ``threads`` submitters (each at most ``rate``/s when
    given); puts how many it submitted and their submit calls' durations."""
    from agentdispatch import Dispatcher, Submission, load_settings
    from agentdispatch.factory import open_backends

    settings = load_settings(task_queue_backend="postgres", state_db_uri=uri, max_depth=10_000_000)
    store, transport = open_backends(settings)
    d = Dispatcher(store, transport, settings)
    counts = [0] * threads
    took: list[float] = []
    go.wait()
    until = time.monotonic() + seconds

    def submit(i: int) -> None:
        at = time.monotonic() + i / (rate * threads) if rate else 0.0
        while time.monotonic() < until:
            if rate:
                time.sleep(max(0.0, at - time.monotonic()))
                at += 1.0 / rate
            t0 = time.perf_counter()
            d.submit(Submission(kind="echo", tenant=f"t{i % 7}"))
            took.append(time.perf_counter() - t0)
            counts[i] += 1

    workers = [threading.Thread(target=submit, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    out.put((sum(counts), took))
    transport.close()
    store.close()


def worker(uri: str, ready: Any, stop: Any) -> None:
    """An async worker process as ``agentdispatch worker`` runs one, on a no-op handler."""
    from agentdispatch import load_settings
    from agentdispatch.backends.postgres.store import PostgresStore
    from agentdispatch.backends.postgres.transport import PostgresTransport
    from agentdispatch.handlers import Registry
    from agentdispatch.runtime.options import RuntimeOptions
    from agentdispatch.runtime.worker import AsyncWorker

    store = PostgresStore(uri)
    transport = PostgresTransport(store)
    reg = Registry()
    reg.add("echo", lambda turn, guard: None)
    w = AsyncWorker(load_settings(STATE_DB_URI=uri), store, transport, reg, options=RuntimeOptions(reconcile=False))
    runner = threading.Thread(target=w.run_forever, daemon=True)
    runner.start()
    ready.release()
    stop.wait()
    w.request_stop()
    runner.join(timeout=60)
    transport.close()
    store.close()


def count_notifications(uri: str, stop: threading.Event, got: list[int]) -> None:
    with psycopg.connect(uri, autocommit=True) as c:
        c.execute(f"LISTEN {CHANNEL}")
        got.append(0)
        while not stop.is_set():
            got[0] += sum(1 for _ in c.notifies(timeout=0.2))


def run_arm(notify: bool, procs: int, threads: int, seconds: float, workers: int, rate: float) -> dict[str, float]:
    """One arm on a fresh schema: submits/s, notifications per submission, depth at the end."""
    ctx = mp.get_context("fork")
    with schema(notify) as uri:
        ready, stop, go = ctx.Semaphore(0), ctx.Event(), ctx.Event()
        ws = [ctx.Process(target=worker, args=(uri, ready, stop)) for _ in range(workers)]
        for p in ws:
            p.start()
        for _ in ws:
            ready.acquire(timeout=60)
        heard: list[int] = []
        quiet = threading.Event()
        counter = threading.Thread(target=count_notifications, args=(uri, quiet, heard), daemon=True)
        counter.start()
        out: Any = ctx.Queue()
        ps = [ctx.Process(target=enqueuer, args=(uri, threads, seconds, rate, go, out)) for _ in range(procs)]
        for p in ps:
            p.start()
        time.sleep(2.0)  # workers idle, listeners connected, enqueuers' pools open
        go.set()
        got = [out.get() for _ in ps]
        total = sum(n for n, _ in got)
        took = sorted(t for _, ts in got for t in ts)
        quiet.set()
        counter.join(timeout=10)
        with psycopg.connect(uri, autocommit=True) as c:
            row = c.execute("SELECT count(*) FROM agent_dispatch_queue").fetchone()
            depth = int(row[0]) if row else -1
        stop.set()
        for p in ps + ws:
            p.join(timeout=60)
    return {
        "rate": total / seconds,
        "notified": heard[0] / max(1, total) if heard else 0.0,
        "depth": depth,
        "p50_ms": took[len(took) // 2] * 1e3 if took else 0.0,
        "p99_ms": took[int(len(took) * 0.99)] * 1e3 if took else 0.0,
    }


def child(arm: str, src: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """``run_arm`` in a new interpreter (with ``src`` first on its path, when given)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--one", arm]
    cmd += ["--procs", str(args.procs), "--threads", str(args.threads), "--seconds", str(args.seconds)]
    cmd += ["--workers", str(args.workers), "--rate", str(args.rate)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=20, help="submitters per process")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="async worker processes draining the queue")
    ap.add_argument(
        "--rate", type=float, default=0.0, help="submits/s per submitter (0: as fast as they go); low: workers wait"
    )
    ap.add_argument("--baseline-src", type=Path, help="another checkout's src: its shipped NOTIFY as a third arm")
    ap.add_argument("--one", choices=["shipped", "polling"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        got = run_arm(args.one == "shipped", args.procs, args.threads, args.seconds, args.workers, args.rate)
        print(json.dumps(got))
        return
    arms: list[tuple[str, str, Path | None]] = [("shipped", "shipped", None), ("polling only", "polling", None)]
    if args.baseline_src:
        arms.append(("baseline", "shipped", args.baseline_src.resolve()))
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _, _ in arms}
    for r in range(args.rounds):
        for label, arm, src in arms[r % len(arms) :] + arms[: r % len(arms)]:
            res = child(arm, src, args)
            results[label].append(res)
            print(
                f"round {r + 1} {label:<12}: {res['rate']:.0f} submits/s, "
                f"{res['notified']:.3f} notifications per submit, depth at end {res['depth']:.0f}, "
                f"submit p50 {res['p50_ms']:.1f} ms p99 {res['p99_ms']:.1f} ms",
                flush=True,
            )
    med = {label: statistics.median(x["rate"] for x in rs) for label, rs in results.items()}
    polling = med["polling only"]
    print(f"{args.procs * args.threads} concurrent enqueuers, {args.workers} async workers, medians of {args.rounds}:")
    for label, rate in med.items():
        notified = statistics.median(x["notified"] for x in results[label])
        print(
            f"    {label:<12} {rate:.0f}/s, ratio to polling only {rate / polling:.2f}, {notified:.3f} notes/submit, "
            f"submit p50 {statistics.median(x['p50_ms'] for x in results[label]):.1f} ms"
        )
    if "baseline" in med:
        print(f"    shipped / baseline {med['shipped'] / med['baseline']:.2f}")
    print("scenario 18 passes at a ratio to polling only >= 0.80")


if __name__ == "__main__":
    main()
