"""Reliability scenario 18: what the queue's NOTIFY costs many concurrent enqueuers.

Durable single submissions from ``--procs`` processes x ``--threads`` threads for
``--seconds`` s on a fresh PostgreSQL schema, once as shipped and once with the
enqueue triggers' ``pg_notify`` removed from that schema (polling only), alternating
``--rounds`` times. PostgreSQL serializes the commits of transactions that notify
(a database-wide lock held through the commit's flush), so the ratio shows what the
wake-ups cost the submitters. The scenario passes at >= 0.8. No assertions.

    python benchmarks/bench_notify.py --procs 4 --threads 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import psycopg

BASE = os.environ.get("AGENTDISPATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
#: The enqueue triggers' wake-ups, and what replaces them for polling only.
NOTIFIES = {
    "dispatch_queue_added": ("PERFORM pg_notify('agent_dispatch_queue', '');", ""),
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


def enqueuer(uri: str, threads: int, seconds: float, out: Any) -> None:
    """One process of ``threads`` submitters; puts how many it submitted."""
    from agentdispatch import Dispatcher, Submission, load_settings
    from agentdispatch.factory import open_backends

    settings = load_settings(task_queue_backend="postgres", state_db_uri=uri, max_depth=10_000_000)
    store, transport = open_backends(settings)
    d = Dispatcher(store, transport, settings)
    counts = [0] * threads
    until = time.monotonic() + seconds

    def submit(i: int) -> None:
        while time.monotonic() < until:
            d.submit(Submission(kind="echo", tenant=f"t{i % 7}"))
            counts[i] += 1

    workers = [threading.Thread(target=submit, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    out.put(sum(counts))
    transport.close()
    store.close()


def rate(notify: bool, procs: int, threads: int, seconds: float) -> float:
    with schema(notify) as uri:
        out: Any = mp.Queue()
        ps = [mp.Process(target=enqueuer, args=(uri, threads, seconds, out)) for _ in range(procs)]
        for p in ps:
            p.start()
        total = sum(out.get() for _ in ps)
        for p in ps:
            p.join()
    return total / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=20, help="submitters per process")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    got: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for notify in (True, False):
            got[notify].append(rate(notify, args.procs, args.threads, args.seconds))
            label = "NOTIFY      " if notify else "polling only"
            print(f"round {r + 1} {label}: {got[notify][-1]:.0f} submits/s", flush=True)
    with_notify, polling = statistics.median(got[True]), statistics.median(got[False])
    print(
        f"{args.procs * args.threads} concurrent enqueuers: NOTIFY {with_notify:.0f}/s, "
        f"polling only {polling:.0f}/s, ratio {with_notify / polling:.2f} (scenario 18 passes at >= 0.80)"
    )


if __name__ == "__main__":
    main()
