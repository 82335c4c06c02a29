"""Operator-style chaos audit of the PostgreSQL rung, through the public
surfaces only: `agentdispatch migrate`, `worker` and `gateway` processes, the
Python Dispatcher and (for one tenant) the gateway's Client to submit, the CLI
to read the DLQ.

A private PostgreSQL cluster (tests/pg.py) serves three async workers while
turns are submitted; meanwhile workers are SIGKILLed and restarted (one under
its stable name), one is SIGSTOPped for 3x the lease TTL, the cluster is
restarted once and a listener's backend is terminated once. After the drain
the script checks: nothing lost or stuck, no duplicate or stale-epoch effect,
no overlap and no disorder within a session.

    python scripts/chaos/chaos_pg.py --turns 3000 --sessions 200 --seed 1
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import chaoskit as kit
from chaoskit import Slot, now, pg


def listener_pids(uri: str) -> list[int]:
    """Backends of worker queue listeners (their last statement is LISTEN or
    the listener's probe)."""
    with pg(uri) as c:
        rows = c.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' "
            "AND (query LIKE 'LISTEN %%' OR query LIKE '%%DELETE FROM dispatch_waiting w%%' "
            "OR query LIKE 'UNLISTEN %%')"
        ).fetchall()
    return [r[0] for r in rows]


def run(args: argparse.Namespace) -> dict[str, Any]:
    rig = kit.Rig(args, "chaos-pg-")
    cluster, uri, rng, note = rig.cluster, rig.uri, rig.rng, rig.note
    ttl = args.ttl
    rig.start({"TASK_QUEUE_BACKEND": "postgres"}, effects=lambda n, r: 1 + (n + r) % 2)
    fleet, faults, t_start = rig.fleet, rig.faults, rig.t_start

    stop_at, cont_at = args.stop_at, args.stop_at + 3 * ttl
    paused: Slot | None = None
    pg_restart_done = listen_done = False
    pg_up_at: float | None = None
    listen_result: dict[str, Any] = {}
    next_kill = 5.0
    while now() - t_start < args.fault_s:
        t = now() - t_start
        if paused is None and t >= stop_at and "stopped" not in faults:
            paused = fleet.slots[1]
            note(f"SIGSTOP pid {rig.pause(paused)} for {3 * ttl} s")
        if paused is not None and t >= cont_at:
            rig.resume(paused)
            paused = None
        if not pg_restart_done and t >= args.pg_restart_at:
            t0 = time.monotonic()
            note("PG fast stop")
            cluster.stop("fast")
            time.sleep(3)
            cluster.start()
            faults["pg_down_at"], faults["pg_up_at"] = t0 - time.monotonic() + now(), now()
            pg_restart_done = True
            pg_up_at = faults["pg_up_at"]
            note(f"PG started again ({time.monotonic() - t0:.1f} s down)")
        if not listen_done and t >= args.listen_at:
            listen_done = True
            before = listener_pids(uri)
            if before:
                victim = rng.choice(before)
                with pg(uri) as c:
                    c.execute("SELECT pg_terminate_backend(%s)", (victim,))
                note(f"pg_terminate_backend listener {victim} (listeners: {len(before)})")

                def watch(before: list[int] = before, victim: int = victim) -> None:
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < 60:
                        cur = listener_pids(uri)
                        if len(cur) >= len(before) and victim not in cur:
                            listen_result["reconnect_s"] = round(time.monotonic() - t0, 2)
                            return
                        time.sleep(0.2)
                    listen_result["reconnect_s"] = None

                threading.Thread(target=watch, daemon=True).start()
            else:
                note("no listener backend found")
        if t >= next_kill:
            next_kill += rng.uniform(4.0, 6.0)
            rig.kill_one(paused)
        time.sleep(0.1)
    if paused is not None and paused.proc is not None:
        rig.resume(paused, say=False)
    rig.drain()
    if listen_result:
        note(f"listener reconnect: {listen_result}")
    audit = rig.audit()
    report = audit.report
    report.update(after_pg_restart(audit, pg_up_at))
    report.update(rig.facts(listen=listen_result))
    rig.close()
    return report


def after_pg_restart(audit: kit.Audit, pg_up: float | None) -> dict[str, Any]:
    """After the database restart: when each worker claimed again, and the
    first commit."""
    after_restart: dict[str, float] = {}
    if pg_up:
        for _job, _epoch, at, owner in audit.claims:
            if at >= pg_up and (owner not in after_restart or at - pg_up < after_restart[owner]):
                after_restart[owner] = round(at - pg_up, 2)
    first_commit_after_up = round(min((a for a in audit.commits if pg_up and a >= pg_up), default=0) - (pg_up or 0), 2)
    return {
        "first_claim_after_pg_up_s_by_worker": dict(sorted(after_restart.items(), key=lambda kv: kv[1])[:8]),
        "first_commit_after_pg_up_s": first_commit_after_up,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pg-restart-at", type=float, default=40.0)
    ap.add_argument("--listen-at", type=float, default=55.0)


if __name__ == "__main__":
    kit.main(__doc__, run, turns=3000, fault_s=75.0, add_arguments=add_arguments)
