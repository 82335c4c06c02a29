"""Batched fair claims on PostgreSQL: claims per second by tenants and claimers.

``--turns`` turns (one session each) over ``--tenants`` tenants are queued on a
fresh database, then ``--claimers`` threads, each with a store and transport of
its own (as worker processes have), claim them in batches of ``--batch``
(``Flow.claim``: the fair claim and the claims' writes, one transaction) until
the queue is dry. Prints claims per second for each ``--tenants`` value.

``--baseline-src DIR`` runs each case on another checkout's ``src`` first (e.g.
a ``git worktree`` of the previous commit), alternating ``--rounds`` times, and
prints the ratios. Each run is a subprocess. No assertions.

    python benchmarks/bench_claims.py --tenants 1,3,100 --claimers 4
    python benchmarks/bench_claims.py --baseline-src /tmp/base/src --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

BASE = os.environ.get("AGENTDISPATCH_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")


def child(args: argparse.Namespace, tenants: int) -> dict[str, Any]:
    """One case in this process: queue, then claim until dry."""
    import psycopg

    from agentdispatch import Dispatcher, Submission, load_settings, open_backends
    from agentdispatch.factory import open_flow

    name = "bench_claims_" + uuid.uuid4().hex[:8]
    server = BASE.rsplit("/", 1)[0]
    with psycopg.connect(BASE, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        os.environ.update(
            TASK_QUEUE_BACKEND="postgres", STATE_DB_URI=f"{server}/{name}", AGENT_DISPATCH_MAX_DEPTH="10000000"
        )
        store, transport = open_backends(load_settings(), migrate=True)
        d = Dispatcher(store, transport, load_settings())
        for i in range(0, args.turns, 1000):
            n = min(1000, args.turns - i)
            d.submit_many(
                [Submission(kind="echo", tenant=f"t{(i + j) % tenants}", session_id=f"s{i + j}") for j in range(n)]
            )
        counts = [0] * args.claimers
        ready = threading.Barrier(args.claimers + 1)

        def claim(k: int) -> None:
            flow = open_flow(*open_backends(load_settings()))
            assert flow is not None
            ready.wait()
            while batch := flow.claim(f"w{k}:0", args.batch, ttl_s=600.0).claimed:
                counts[k] += len(batch)

        threads = [threading.Thread(target=claim, args=(k,)) for k in range(args.claimers)]
        for t in threads:
            t.start()
        ready.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        return {"claimed": sum(counts), "seconds": elapsed, "per_s": sum(counts) / elapsed}
    finally:
        with psycopg.connect(BASE, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(src: Path, tenants: int) -> dict[str, Any]:
    """One case in a subprocess importing agentdispatch from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--child", str(tenants), *sys.argv[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise SystemExit(f"run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10_000)
    ap.add_argument("--tenants", default="1,3,100", help="comma-separated tenant counts, one case each")
    ap.add_argument("--claimers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline-src", type=Path, help="another checkout's src, run first each round")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.child is not None:
        print(json.dumps(child(args, args.child)))
        return
    here = Path(__file__).resolve().parent.parent / "src"
    print(
        f"bench_claims: {args.turns} turns, one session each; {args.claimers} claimers, batches of {args.batch}; "
        f"{os.cpu_count()} cores"
    )
    for tenants in [int(t) for t in args.tenants.split(",") if t.strip()]:
        for r in range(args.rounds):
            base = run(args.baseline_src, tenants) if args.baseline_src else None
            this = run(here, tenants)
            line = f"  {tenants:>4} tenant(s), round {r + 1}: this {this['per_s']:,.0f} claims/s"
            if base is not None:
                line += f", baseline {base['per_s']:,.0f} claims/s, ratio {this['per_s'] / base['per_s']:.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
