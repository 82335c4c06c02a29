"""Kafka broker-restart soak: re-publications, losses and drain after the last restart.

``--turns`` turns (2 ms handlers, ``--sessions`` sessions) over ``--procs`` worker
processes (``--threads`` threads each, TTL 3 s, the crash tests' workers) on a shared SQLite store and
one Tansu broker (memory storage: a restart loses the topic, the log and the
group's offsets). The turns come in ``--restarts`` + 1 equal waves; each restart
(kill -9, down ``--down-min``..``--down-max`` s, start again) comes once the
backlog is down to half a wave, and the next wave is submitted when the broker is
back, so the restarts are spread over the whole run. The workers are never
restarted; a worker that dies is replaced, as a supervisor would.

Printed per run: ``redelivered`` (the reconciler's re-publications of ready
items, from the store's events; ``reclaimed`` leases are counted apart), lost
turns, duplicate side effects, session overlaps; the full speed (the best 3 s
of finished turns in the run); per restart the longest pause in finished turns
once the broker was back (turns already in the consumers' buffers finish at
once, so the first finish says little); and for the last restart: the backlog
(the turns committed after it, the last wave included), the messages the new log got (with
the copies the relays and the reconciler published), the drain time (broker
back -> all done), and the drain time minus backlog / full speed (what the
restart itself cost), against the TTL.

``--baseline-src DIR`` runs the same soak on another checkout's ``src`` (e.g. a
``git worktree`` of the previous commit) first, alternating ``--rounds`` times,
and prints the ratios. Each run is a subprocess with its own broker. No
assertions.

    python benchmarks/bench_kafka_restarts.py --baseline-src /tmp/kbase/src
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import logging
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parents[1] / "tests"


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process (the agentdispatch on ``sys.path``)."""
    sys.path.insert(0, str(TESTS))
    sys.path.insert(0, str(TESTS / "integration"))
    import test_kafka_crash as crash  # the worker processes and the evidence

    from kafka_broker import Broker

    ttl = 3.0  # the worker processes' claim TTL (tests/integration/test_kafka_crash.py)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(args.keep or tmp_s)
        broker = Broker(tmp / "broker").start()
        fleet = crash.Fleet(tmp, broker)
        try:
            wave = args.turns // (args.restarts + 1)
            jobs = fleet.submit(wave, sessions=args.sessions, sleep=0.002)
            for _ in range(args.procs):
                fleet.spawn(args.threads)
            restarts: list[dict[str, Any]] = []
            for r in range(args.restarts):
                deadline = time.monotonic() + 300
                while len(jobs) - (done := fleet.succeeded(jobs)) > wave // 2:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"no progress before restart {r}: {fleet.evidence(jobs)}")
                    fleet.reap()
                    time.sleep(0.05)
                backlog = len(jobs) - done
                broker.kill()
                killed = time.time()
                time.sleep(rng.uniform(args.down_min, args.down_max))
                broker.start()
                restarts.append({"killed": killed, "back": time.time(), "backlog": backlog})
                jobs += fleet.submit(wave, sessions=args.sessions, sleep=0.002)
            fleet.wait(jobs, timeout=args.timeout)
            finished = time.time()
            # The log since the last restart, all consumed: the group's
            # committed offsets are its ends (Tansu's own end answer leaves
            # the last batch out). Against the backlog it shows the copies.
            try:
                log_messages = sum(max(done, high) for done, high in fleet.transport._admin.positions().values())
            except Exception:
                log_messages = -1
            ev = fleet.evidence(jobs)
            ends = sorted(
                float(ln.split()[4]) for ln in Path(fleet.sink).read_text().splitlines() if ln.startswith("end ")
            )
            # Recovery: the longest time no turn finished once the broker was
            # back, until the next kill (turns buffered in the consumers
            # before the kill finish at once, so the first finish says little).
            for rs, until in zip(restarts, [*(r["killed"] for r in restarts[1:]), finished], strict=True):
                marks = [rs["back"], *(e for e in ends if rs["back"] < e < until)]
                rs["recovery_s"] = round(max((b - a for a, b in itertools.pairwise(marks)), default=0.0), 2)
            # Full speed: the best 3 s window of the run (the pace of a drain
            # with nothing failing).
            full = max((bisect.bisect_right(ends, e + 3.0) - i for i, e in enumerate(ends)), default=0) / 3.0
            with sqlite3.connect(fleet.settings.sqlite_path) as db:
                events = dict(db.execute("SELECT event, count(*) FROM work_events GROUP BY event").fetchall())
                per_job = [
                    n
                    for (n,) in db.execute(
                        "SELECT count(*) FROM work_events WHERE event = 'redelivered' GROUP BY job_id"
                    ).fetchall()
                ]
                t0 = db.execute("SELECT min(at) FROM work_events").fetchone()[0]
                # The last restart's backlog: the turns committed once the broker
                # was back, the last wave included (a count taken when its submit
                # returned left out what ran meanwhile, often all of it).
                restarts[-1]["backlog"] = db.execute(
                    "SELECT count(*) FROM work_events WHERE event = 'committed' AND at > ?", (restarts[-1]["back"],)
                ).fetchone()[0]
            last = restarts[-1]
            drain = (ends[-1] if fleet.done(jobs) else finished) - last["back"]
            return {
                **ev,
                "done": fleet.done(jobs),
                "redelivered": events.get("redelivered", 0),
                "reclaimed": events.get("lease_expired", 0),
                "redelivered_jobs": len(per_job),
                "redelivered_max": max(per_job, default=0),
                "restarts_at": [[round(rs["killed"] - t0, 1), round(rs["back"] - t0, 1)] for rs in restarts],
                "ttl_s": ttl,
                "full_speed_turns_s": round(full, 1),
                "recovery_s": [rs["recovery_s"] for rs in restarts],
                "down_s": [round(rs["back"] - rs["killed"], 1) for rs in restarts],
                "backlog_at_restarts": [rs["backlog"] for rs in restarts],
                "last_backlog": last["backlog"],
                "last_log_messages": log_messages,
                "last_drain_s": round(drain, 2),
                "last_excess_s": round(drain - last["backlog"] / max(full, 1e-3), 2),
                "crashes": sorted(fleet.crashed.values()),
            }
        finally:
            fleet.close()
            broker.kill()


def run_child(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One soak in a subprocess importing agentdispatch from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 900)
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise SystemExit(f"soak run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}") from None


def show(label: str, r: dict[str, Any]) -> None:
    print(
        f"  {label:<9} redelivered {r['redelivered']:6,} ({r['redelivered'] / r['jobs']:.2f}/turn), "
        f"reclaimed {r['reclaimed']}, lost {r['lost']}, dead {r['dead_letter']}, "
        f"duplicate effects {r['duplicate_effects']}, overlaps {r['session_overlaps']}, "
        f"out of order {r['out_of_order']}, crashes {r['crashes']}"
    )
    print(
        f"  {'':<9} full speed {r['full_speed_turns_s']:.0f} turns/s (best 3 s); down {r['down_s']} s; longest "
        f"pause after each restart {r['recovery_s']} s; backlog at each {r['backlog_at_restarts']}"
    )
    print(
        f"  {'':<9} last restart: backlog {r['last_backlog']} ({r.get('last_log_messages', -1):,} messages in the "
        f"new log), drained {r['last_drain_s']:.1f} s after it "
        f"({r['last_drain_s'] / r['ttl_s']:.2f} TTL), {r['last_excess_s']:.1f} s beyond backlog / full speed "
        f"({r['last_excess_s'] / r['ttl_s']:.2f} TTL; TTL {r['ttl_s']:g} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=5000)
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--restarts", type=int, default=6)
    ap.add_argument("--down-min", type=float, default=1.0)
    ap.add_argument("--down-max", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--timeout", type=float, default=300.0, help="wait for the drain after the last restart")
    ap.add_argument("--keep", type=Path, help="run once here (data, sink, logs kept) instead of a temporary directory")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline-src", type=Path, help="another checkout's src, run first each round")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.child:
        print(json.dumps(soak(args)))
        return
    here = Path(__file__).parents[1] / "src"
    print(
        f"kafka restart soak: {args.turns} turns, {args.procs} processes x {args.threads} threads, "
        f"TTL 3 s, {args.restarts} kill -9 restarts ({args.down_min:g}-{args.down_max:g} s down):"
    )
    for rnd in range(args.rounds):
        base = run_child(args.baseline_src, args) if args.baseline_src else None
        ours = run_child(here, args)
        print(f" round {rnd + 1}:")
        if base is not None:
            show("baseline", base)
        show("this", ours)
        if base is not None:
            print(
                f"  ratio this/baseline: redelivered {ours['redelivered'] / max(base['redelivered'], 1):.2f}x, "
                f"last drain {ours['last_drain_s'] / max(base['last_drain_s'], 1e-3):.2f}x"
            )


if __name__ == "__main__":
    main()
