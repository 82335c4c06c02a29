"""Worker processes that die: what it costs the turns beside them.

Reliability scenario 9 (a poison turn that SIGKILLs its worker on every
attempt) and a kill storm (scenario 5's SIGKILLs at random): ``--turns``
innocent turns (``--work`` s each, one session each) over ``--procs`` worker
processes of ``--concurrency`` each, TTL ``--ttl`` s, with a supervisor loop
that restarts a worker as soon as it dies. Per run: the innocent turns' wall
time and throughput, against a run without the fault in the same round, the
deaths, the poison's end, and turns not succeeded.

``--baseline-src DIR`` runs the same on another checkout's ``src`` (a
``git worktree`` of an older commit), alternating ``--rounds`` times, and
prints the ratios of the two. Each run is a subprocess importing the ``src``
under test (and its ``tests`` helpers). No assertions.

    python benchmarks/bench_worker_death.py --baseline-src /tmp/base/src
    python benchmarks/bench_worker_death.py --store postgres --fault storm
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
OPEN = {"submitted", "ready", "leased", "running"}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run, in a process importing the ``src`` under test."""
    tests = Path(args.src).resolve().parent / "tests"
    sys.path[:0] = [str(tests)]
    from agentdispatch import Submission
    from backends import postgres_harness, sqlite_harness

    build = sqlite_harness if args.store == "sqlite" else postgres_harness
    tmp = Path(tempfile.mkdtemp(prefix="bench-death-"))
    renew = args.ttl / 3
    h = build(tmp, claim_ttl_s=args.ttl, renew_interval_s=renew)
    apps = tests / "apps"
    env = {
        **os.environ,
        **h.env,
        "AGENT_DISPATCH_CLAIM_TTL_S": str(args.ttl),
        "AGENT_DISPATCH_RENEW_INTERVAL_S": str(renew),
        "PYTHONPATH": f"{Path(args.src).resolve()}{os.pathsep}{apps}",
    }
    cmd = [sys.executable, "-m", "agentdispatch", "worker", "--concurrency", str(args.concurrency)]
    cmd += ["--app", "poison_app:registry"]
    subs = [
        Submission(kind="work", payload={"seconds": args.work}, tenant="t", session_id=f"s{i}")
        for i in range(args.turns)
    ]
    poison_at = len(subs) // 4
    if args.fault == "poison":
        subs.insert(poison_at, Submission(kind="poison", tenant="t", session_id="poison"))
    ids = [a.job_id for a in h.dispatcher().submit_many(subs)]
    poison = ids.pop(poison_at) if args.fault == "poison" else None
    workers: list[subprocess.Popen[bytes]] = []
    deaths = 0
    died: list[float] = []
    rng = random.Random(7)
    start = time.monotonic()
    next_kill = start + args.kill_every
    left = set(ids)
    try:
        workers = [subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL) for _ in range(args.procs)]
        while left and time.monotonic() - start < args.limit:
            time.sleep(0.2)
            for n, w in enumerate(workers):
                if w.poll() is not None:  # the supervisor: restart at once
                    deaths += 1
                    died.append(round(time.monotonic() - start, 1))
                    workers[n] = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
            if args.fault == "storm" and time.monotonic() >= next_kill and deaths < args.kills:
                rng.choice(workers).send_signal(signal.SIGKILL)
                next_kill += args.kill_every
            open_now = sum(c.n for c in h.store.fleet_counts() if c.status in OPEN)
            if poison is not None and not h.store.get(poison, "t").status.terminal:
                open_now -= 1
            left = left if open_now > 0 else set()
        wall = time.monotonic() - start
        items = [h.store.get(j, "t") for j in ids]
        first = min(i.created_at for i in items)
        per_s = [0] * (int(wall) + 2)
        for i in items:
            if i.completed_at is not None:
                per_s[min(len(per_s) - 1, max(0, int(i.completed_at - first)))] += 1
        end = None
        if poison is not None:
            p = h.store.get(poison, "t")
            end = f"{p.status.value}/{p.reason}/{p.attempt}"
        return {
            "wall": wall,
            "rate": len(ids) / wall,
            "deaths": deaths,
            "not_succeeded": sum(1 for i in items if i.status.value != "succeeded"),
            "poison": end,
            "attempts_max": max(i.attempt for i in items),
            "died": died,
            "per_s": per_s,
        }
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
        h.close()


def run(src: Path, args: argparse.Namespace, fault: str) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", "--src", str(src), "--fault", fault]
    for name in ("store", "turns", "work", "procs", "concurrency", "ttl", "kills", "kill_every", "limit"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"run failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", default=str(SRC), help=argparse.SUPPRESS)
    ap.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--fault", choices=["poison", "storm", "none"], default="poison")
    ap.add_argument("--turns", type=int, default=3600)
    ap.add_argument("--work", type=float, default=0.5)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=40)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--kills", type=int, default=6, help="storm: SIGKILLs in all")
    ap.add_argument("--kill-every", type=float, default=3.0, help="storm: seconds between SIGKILLs")
    ap.add_argument("--limit", type=float, default=600.0, help="give up a run after this long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trace", action="store_true", help="print the deaths and the turns finished each second")
    ap.add_argument("--baseline-src", type=Path, help="another checkout's src, run first each round")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    srcs = {"this": SRC} if args.baseline_src is None else {"base": args.baseline_src, "this": SRC}
    rel: dict[str, list[float]] = {name: [] for name in srcs}
    print(
        f"{args.store}, {args.fault}: {args.turns} turns x {args.work} s, "
        f"{args.procs} procs x {args.concurrency}, TTL {args.ttl} s"
    )
    for r in range(args.rounds):
        for name, src in srcs.items():
            clean = run(src, args, "none")
            hit = run(src, args, args.fault)
            rel[name].append(hit["rate"] / clean["rate"])
            print(
                f"round {r + 1} {name}: clean {clean['rate']:.0f}/s ({clean['wall']:.1f} s); "
                f"{args.fault} {hit['rate']:.0f}/s ({hit['wall']:.1f} s), {hit['deaths']} deaths, "
                f"poison {hit['poison']}, not succeeded {hit['not_succeeded']}, "
                f"max attempts {hit['attempts_max']} -> {rel[name][-1]:.2f} x clean"
            )
            if args.trace:
                print(f"  deaths at {hit['died']} s; finished per second: {hit['per_s']}")
    for name, values in rel.items():
        print(f"{name}: {args.fault} throughput {statistics.median(values):.2f} x clean (median of {len(values)})")
    if "base" in rel:
        ratio = statistics.median(rel["this"]) / statistics.median(rel["base"])
        print(f"this / base: {ratio:.2f}")


if __name__ == "__main__":
    main()
