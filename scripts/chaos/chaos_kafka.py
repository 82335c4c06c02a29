"""Operator-style chaos audit of the Kafka rung, through the public surfaces
only: `agentdispatch migrate`, `worker` and `gateway` processes, the Python
Dispatcher and (for one tenant) the gateway's Client to submit, the CLI to
read the DLQ.

The store is a private PostgreSQL cluster (tests/pg.py); envelopes travel on a
Tansu broker (tests/kafka_broker.py, memory storage: a restart loses the log
and the group, and the reconciler re-publishes from the store's outbox).
Three async workers run turns (scripts/chaos/chaos_app.py) while they are
submitted; meanwhile workers are SIGKILLed and restarted (one under its stable
name), one is SIGSTOPped for 3x the lease TTL, and the broker is restarted
(twice by default; no kills for a while after each, so the workers that saw
the restart must recover by themselves). After the drain the script checks:
nothing lost or stuck, no duplicate or stale-epoch effect, no overlap and no
disorder within a session, and every worker alive across a broker restart ran
turns again.

    python scripts/chaos/chaos_kafka.py --turns 2000 --sessions 200 --seed 1
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

import chaoskit as kit
from chaoskit import Fleet, Slot, now

from kafka_broker import Broker  # tests/, which chaoskit puts on sys.path


def open_turns(sink: Path) -> Counter[int]:
    """Per worker pid: turns started and not ended, as the sink says."""
    open_: Counter[int] = Counter()
    for f in sink.glob("*.log"):
        for line in f.read_text().splitlines():
            p = line.split()
            if p[0] in ("start", "end"):
                open_[int(p[1])] += 1 if p[0] == "start" else -1
    return open_


def run(args: argparse.Namespace) -> dict[str, Any]:
    rig = kit.Rig(args, "chaos-kafka-")
    sink, note = rig.sink, rig.note
    broker = Broker(rig.work / "broker").start()
    ttl = args.ttl
    backend_env = {
        "TASK_QUEUE_BACKEND": "kafka",
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AGENT_TURNS_PARTITIONS": str(args.partitions),
    }
    rig.start(backend_env, effects=lambda n, r: 2)
    fleet, faults, t_start = rig.fleet, rig.faults, rig.t_start

    stop_at, cont_at = args.stop_at, args.stop_at + 3 * ttl
    paused: Slot | None = None
    restarts_at = sorted(float(x) for x in args.broker_restart_at.split(",") if x.strip())
    # Each broker restart: (down, up, pids of the workers alive across it).
    broker_restarts: list[tuple[float, float, list[int]]] = []
    quiet_until = 0.0
    next_kill = 5.0
    while now() - t_start < args.fault_s:
        t = now() - t_start
        if paused is None and t >= stop_at and "stopped" not in faults:
            # The worker with the most turns open: a pause that holds none
            # tests nothing. Not the named slot, which the kills revisit.
            busy = open_turns(sink)
            paused = max(fleet.slots[1:], key=lambda s: busy[s.proc.pid] if s.proc else -1)
            assert paused.proc is not None
            if not busy[paused.proc.pid]:
                if t < stop_at + 10:
                    paused = None
                    time.sleep(0.1)
                    continue
                note("no worker holds a turn: pausing one anyway")
            pid = rig.pause(paused)
            cont_at = t + 3 * ttl
            note(f"SIGSTOP pid {pid} ({busy[pid]} turns open) for {3 * ttl} s")
        if paused is not None and t >= cont_at:
            rig.resume(paused)
            paused = None
        if restarts_at and t >= restarts_at[0]:
            restarts_at.pop(0)
            alive = [s.proc.pid for s in fleet.slots if s.proc is not None and s.proc.poll() is None]
            down = now()
            note("broker SIGKILL")
            broker.kill()
            time.sleep(args.broker_down_s)
            broker.start()
            up = now()
            broker_restarts.append((down, up, alive))
            faults["broker_restarts"] = faults.get("broker_restarts", 0) + 1
            # No kills for a while: the workers that saw the restart must
            # recover without a restart of their own.
            quiet_until = t + args.broker_down_s + args.quiet_s
            note(f"broker started again ({up - down:.1f} s down), workers alive across it: {alive}")
        if t >= next_kill and t < quiet_until:
            next_kill = quiet_until
        if t >= next_kill:
            next_kill += rig.rng.uniform(4.0, 6.0)
            rig.kill_one(paused)
        time.sleep(0.1)
    if paused is not None and paused.proc is not None:
        rig.resume(paused, say=False)
    rig.drain()
    audit = rig.audit(dlq_without_reason=True)
    report = audit.report
    report.update(after_broker_restarts(audit, fleet, broker_restarts, t_start))
    report.update(rig.facts())
    broker.kill()
    rig.close()
    return report


def after_broker_restarts(
    audit: kit.Audit, fleet: Fleet, broker_restarts: list[tuple[float, float, list[int]]], t_start: float
) -> dict[str, Any]:
    """After each broker restart: how soon each worker alive across it (and
    not killed in the meantime) started a turn again, and the first commit."""
    recovery = []
    for down, up, alive in broker_restarts:
        per_pid: dict[str, Any] = {}
        for pid in alive:
            if pid in fleet.stopped and fleet.stopped[pid][1] > up:
                per_pid[str(pid)] = "paused"
                continue
            later = [x[1] for x in audit.execs if x[6] == pid and x[1] >= up]
            killed = fleet.killed_at.get(pid)
            if later:
                per_pid[str(pid)] = round(min(later) - up, 2)
            else:
                per_pid[str(pid)] = f"no turn before its kill at +{killed - up:.1f}s" if killed else "NO TURN"
        first_commit = min((a for a in audit.commits if a >= up), default=None)
        recovery.append({
            "down_at": f"+{down - t_start:.1f}s",
            "down_s": round(up - down, 1),
            "first_turn_after_up_s_by_pid": per_pid,
            "first_commit_after_up_s": None if first_commit is None else round(first_commit - up, 2),
        })  # fmt: skip
    unrecovered = [
        f"{r['down_at']} pid {pid}" for r in recovery for pid, v in r["first_turn_after_up_s_by_pid"].items()
        if v == "NO TURN"
    ]  # fmt: skip
    return {"broker_restarts": recovery, "workers_not_recovered_after_broker_restart": unrecovered}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--broker-restart-at", default="35,62", help="seconds into the run, comma-separated")
    ap.add_argument("--broker-down-s", type=float, default=2.0)
    ap.add_argument("--quiet-s", type=float, default=15.0, help="no kills this long after a broker restart")


if __name__ == "__main__":
    kit.main(
        __doc__,
        run,
        turns=2000,
        fault_s=80.0,
        add_arguments=add_arguments,
        verdict=("workers_not_recovered_after_broker_restart", "dlq_without_reason"),
    )
