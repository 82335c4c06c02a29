"""What the chaos audits (scripts/chaos/chaos_pg.py, chaos_kafka.py) share: a
private PostgreSQL cluster, a fleet of workers running chaos_app.py, the
submitter, the drain, the analysis of the effect sink and of the store, and the
command line. Each script keeps its own fault schedule and transport checks.

Importing this module puts tests/ on sys.path, for tests/pg.py, tests/ports.py
and tests/kafka_broker.py.
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
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from pg import PrivateCluster  # noqa: E402
from ports import free_port  # noqa: E402

ACTIVE = ("submitted", "ready", "leased", "running")

# Report fields that fail the audit (exit 1) when not empty or zero.
VERDICT = (
    "lost", "stuck", "duplicate_keys", "stale_epoch_effects", "overlaps", "out_of_order_sessions",
    "missing_effects_of_succeeded", "unexpected_terminal",
)  # fmt: skip


def now() -> float:
    return time.time()


@dataclass
class Slot:
    """One worker position: restarted in place after each kill."""

    index: int
    name: str | None
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    exits: list[tuple[int, int | None, str]] = field(default_factory=list)  # (pid, code, why)


class Fleet:
    def __init__(self, env: dict[str, str], logs: Path, concurrency: int) -> None:
        self.env = env
        self.logs = logs
        self.concurrency = concurrency
        self.slots: list[Slot] = []
        self.killed_at: dict[int, float] = {}
        self.stopped: dict[int, tuple[float, float]] = {}  # pid -> (SIGSTOP, SIGCONT)

    def spawn(self, slot: Slot) -> None:
        slot.incarnation += 1
        log = (self.logs / f"w{slot.index}-{slot.incarnation}.log").open("wb")
        cmd = [
            sys.executable, "-m", "agentdispatch", "worker",
            "--concurrency", str(self.concurrency), "--app", "chaos_app:registry", "--grace", "5",
        ]  # fmt: skip
        if slot.name:
            cmd += ["--name", slot.name]
        slot.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def kill(self, slot: Slot) -> int:
        assert slot.proc is not None
        pid = slot.proc.pid
        slot.proc.send_signal(signal.SIGKILL)
        slot.proc.wait()
        self.killed_at[pid] = now()
        slot.exits.append((pid, slot.proc.returncode, "SIGKILL"))
        return pid

    def stop_all(self) -> None:
        for s in self.slots:
            if s.proc and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGCONT)
                s.proc.send_signal(signal.SIGTERM)
        for s in self.slots:
            if s.proc is None:
                continue
            t0 = time.monotonic()
            try:
                s.proc.wait(timeout=30)
                s.exits.append((s.proc.pid, s.proc.returncode, f"SIGTERM ({time.monotonic() - t0:.1f} s)"))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
                s.exits.append((s.proc.pid, None, "HUNG after SIGTERM: killed"))


def pg(uri: str) -> psycopg.Connection[Any]:
    return psycopg.connect(uri, autocommit=True, connect_timeout=5)


class Rig:
    """One audit run: the cluster, the gateway, three workers and the
    submitter, up to the drain and the report. The script in between runs its
    faults with pause(), resume() and kill_one()."""

    def __init__(self, args: argparse.Namespace, prefix: str) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = Path(tempfile.mkdtemp(prefix=prefix))
        self.sink, self.logs = self.work / "sink", self.work / "logs"
        self.sink.mkdir()
        self.logs.mkdir()
        self.cluster = PrivateCluster().start()
        self.uri = self.cluster.uri()
        self.events: list[str] = []
        self.faults: dict[str, Any] = {"kills": 0, "named_restarts": 0}

    def start(self, backend_env: dict[str, str], effects: Callable[[int, int], int]) -> None:
        """Migrate, start the gateway and the fleet, and submit in the
        background: turn r of session n sends effects(n, r) effects."""
        self.effects = effects
        args = self.args
        settings_env = {
            "STATE_DB_URI": self.uri,
            **backend_env,
            "AGENT_DISPATCH_CLAIM_TTL_S": str(args.ttl),
            "AGENT_DISPATCH_RENEW_INTERVAL_S": str(args.renew),
            "AGENT_DISPATCH_MAX_ATTEMPTS": str(args.max_attempts),
        }
        env = self.env = {
            **os.environ,
            **settings_env,
            "CHAOS_SINK_DIR": str(self.sink),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        # The submitting Dispatcher below reads the same settings.
        os.environ.update(settings_env)
        mig = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "migrate"], env=env, capture_output=True, text=True
        )
        assert mig.returncode == 0, mig.stderr

        from agentdispatch import Dispatcher, Submission, load_settings, open_backends

        settings = load_settings()
        self.store, transport = open_backends(settings)
        dispatcher = Dispatcher(self.store, transport, settings)

        # The last tenant submits over HTTP, through the gateway and the Client.
        from agentdispatch import Client

        http_tenant = f"t{args.tenants - 1}"
        tok = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "token", "create", "--tenant", http_tenant, "--json"],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        token = json.loads(tok.stdout)["token"]
        gw_port = free_port()
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "agentdispatch", "gateway", "--port", str(gw_port)],
            env=env, stdout=(self.logs / "gateway.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        client = self.client = Client(f"http://127.0.0.1:{gw_port}", token)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.jobs()
                break
            except Exception:
                assert time.monotonic() < deadline, "the gateway never answered"
                time.sleep(0.2)

        fleet = self.fleet = Fleet(env, self.logs, args.concurrency)
        fleet.slots = [Slot(0, "chaos-w0"), Slot(1, None), Slot(2, None)]
        for s in fleet.slots:
            fleet.spawn(s)

        # Turns: round r holds turn r of every session, so each session's turns
        # arrive spread over the whole submission window.
        per = args.turns // args.sessions
        subs = []
        for r in range(per):
            for n in range(args.sessions):
                subs.append(
                    Submission(
                        kind="chaos_turn",
                        tenant=f"t{n % args.tenants}",
                        session_id=f"s{n}",
                        job_id=f"chaos-s{n}-{r}",
                        payload={"i": r, "effects": effects(n, r)},
                    )
                )
        accepted: dict[str, str] = {}  # job id -> tenant
        submit_errors: list[str] = []
        http_accepted = [0]
        submit_done = threading.Event()
        t_start = now()
        self.accepted, self.submit_errors, self.http_accepted = accepted, submit_errors, http_accepted
        self.submit_done, self.t_start = submit_done, t_start

        def submitter() -> None:
            batch = args.batch
            interval = args.submit_s / (len(subs) / batch)
            for k in range(0, len(subs), batch):
                chunk = subs[k : k + batch]
                direct = [x for x in chunk if x.tenant != http_tenant]
                over_http = [x for x in chunk if x.tenant == http_tenant]
                for part, http in ((direct, False), (over_http, True)):
                    if not part:  # a chunk without the HTTP tenant's turns (many tenants)
                        continue
                    while True:
                        try:
                            if http:
                                rows = [
                                    {
                                        "kind": x.kind,
                                        "payload": x.payload,
                                        "session_id": x.session_id,
                                        "job_id": x.job_id,
                                    }
                                    for x in part
                                ]
                                handles = client.submit_many(rows)
                                http_accepted[0] += len(handles)
                            else:
                                handles = dispatcher.submit_many(part)
                            break
                        except Exception as exc:  # a caller retries with the same ids
                            via = "http" if http else "python"
                            submit_errors.append(f"{now() - t_start:.1f}s {via} {type(exc).__name__}: {exc}"[:200])
                            time.sleep(0.5)
                    for sub, h in zip(part, handles, strict=True):
                        accepted[h.job_id] = sub.tenant
                time.sleep(interval)
            submit_done.set()

        threading.Thread(target=submitter, daemon=True).start()

    def note(self, msg: str) -> None:
        line = f"{now() - self.t_start:6.1f}s {msg}"
        self.events.append(line)
        print(line, flush=True)

    def pause(self, slot: Slot) -> int:
        """SIGSTOP the slot's worker; its pid."""
        assert slot.proc is not None
        slot.proc.send_signal(signal.SIGSTOP)
        self.faults["stopped"] = slot.proc.pid
        self.fleet.stopped[slot.proc.pid] = (now(), float("inf"))
        return slot.proc.pid

    def resume(self, slot: Slot, *, say: bool = True) -> None:
        assert slot.proc is not None
        slot.proc.send_signal(signal.SIGCONT)
        self.fleet.stopped[slot.proc.pid] = (self.fleet.stopped[slot.proc.pid][0], now())
        if say:
            self.note(f"SIGCONT pid {slot.proc.pid}")

    def kill_one(self, paused: Slot | None) -> None:
        """SIGKILL a worker that is not paused and start its slot again."""
        fleet = self.fleet
        candidates = [s for s in fleet.slots if s is not paused]
        # The second kill hits the named worker: it comes back under its name.
        slot = fleet.slots[0] if self.faults["kills"] == 1 else self.rng.choice(candidates)
        pid = fleet.kill(slot)
        self.faults["kills"] += 1
        fleet.spawn(slot)
        if slot.name:
            self.faults["named_restarts"] += 1
        assert slot.proc is not None
        self.note(f"SIGKILL pid {pid} (slot {slot.index}{' ' + slot.name if slot.name else ''}) -> pid {slot.proc.pid}")

    def drain(self) -> None:
        """After the faults: wait for the submitter and for every accepted
        turn to end, then stop the fleet and the gateway."""
        self.t_faults_end = now()
        self.note("faults over")
        self.submit_done.wait(300)
        self.note(f"submissions done: {len(self.accepted)} accepted, {len(self.submit_errors)} submit errors retried")
        drain_deadline = time.monotonic() + self.args.drain_s
        left = None
        while time.monotonic() < drain_deadline:
            try:
                with pg(self.uri) as c:
                    row = c.execute(
                        "SELECT count(*) FROM work_items WHERE status = ANY(%s)", (list(ACTIVE),)
                    ).fetchone()
                    left = row[0] if row else None
            except psycopg.Error:
                left = None
            if left == 0:
                break
            time.sleep(0.5)
        self.t_drained = now()
        self.note(f"drain: {left} active left, {self.t_drained - self.t_faults_end:.1f} s after the faults")
        time.sleep(1.0)  # let the last acks land before stopping the fleet
        self.fleet.stop_all()
        self.client.close()
        self.gateway.terminate()
        self.gateway_rc = self.gateway.wait(timeout=30)

    def audit(self, *, dlq_without_reason: bool = False) -> Audit:
        """Read the DLQ through the CLI, then analyse the store and the sink."""
        self.dlq = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "dlq", "list", "--all-tenants", "--json"],
            env=self.env, capture_output=True, text=True,
        )  # fmt: skip
        (self.work / "dlq.json").write_text(self.dlq.stdout)
        return analyse(
            self.uri,
            self.sink,
            self.fleet,
            self.accepted,
            self.t_start,
            per_turn=self.effects,
            dlq_without_reason=dlq_without_reason,
        )

    def facts(self, **extra: Any) -> dict[str, Any]:
        """The run's own report fields; extra goes right after the faults."""
        return dict(
            work=str(self.work),
            faults=self.faults,
            **extra,
            http_accepted=self.http_accepted[0],
            gateway_exit=self.gateway_rc,
            submit_errors=len(self.submit_errors),
            submit_error_samples=self.submit_errors[:3],
            drain_after_faults_s=round(self.t_drained - self.t_faults_end, 1),
            dlq_cli_rc=self.dlq.returncode,
            dlq_cli=self.dlq.stderr[:500],
            exits=[(s.index, e) for s in self.fleet.slots for e in s.exits],
            logs=scan_logs(self.logs),
        )

    def close(self) -> None:
        self.store.close() if hasattr(self.store, "close") else None
        if not self.args.keep:
            self.cluster.destroy()


@dataclass
class Audit:
    """The analysis: its report fields, and what a script's own checks read."""

    report: dict[str, Any]
    status: dict[str, tuple[Any, ...]]  # job id -> (id, status, reason, lease_epoch, attempts, error)
    claims: list[tuple[Any, ...]]  # (job id, epoch, at, owner)
    commits: list[float]
    execs: list[tuple[Any, ...]]  # (session, t0, t1, job, i, epoch, pid, outcome, zombie)


def analyse(
    uri: str,
    sink: Path,
    fleet: Fleet,
    accepted: dict[str, str],
    t_start: float,
    *,
    per_turn: Callable[[int, int], int],
    dlq_without_reason: bool = False,
) -> Audit:
    with pg(uri) as c:
        rows = c.execute("SELECT id, status, reason, lease_epoch, attempts, error FROM work_items").fetchall()
        ledger = {r[0]: r[1:] for r in c.execute("SELECT key, state, epoch, created_at, updated_at FROM side_effects")}
        claims = c.execute("SELECT job_id, epoch, at, detail FROM work_events WHERE event = 'claimed'").fetchall()
        commits = [r[0] for r in c.execute("SELECT completed_at FROM work_items WHERE status = 'succeeded'").fetchall()]
    status = {r[0]: r for r in rows}
    by_status = Counter(r[1] for r in rows)
    lost = [j for j in accepted if j not in status]
    stuck = [j for j, r in status.items() if r[1] in ACTIVE]
    odd = [(j, r[1], r[2]) for j, r in status.items() if r[1] not in ("succeeded", "dead_letter", *ACTIVE)]
    dlq_reasons = Counter(r[2] for r in rows if r[1] == "dead_letter")
    no_reason = [j for j, r in status.items() if r[1] == "dead_letter" and not r[2]]
    claim_at: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for job, epoch, at, _owner in claims:
        claim_at[job].append((epoch, at))

    starts, ends, effects = [], {}, []
    begun: dict[str, list[tuple[int, float]]] = defaultdict(list)
    fn_started: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for f in sink.glob("*.log"):
        for line in f.read_text().splitlines():
            p = line.split()
            if p[0] == "start":
                starts.append((int(p[1]), p[2], p[3], int(p[4]), int(p[5]), float(p[6])))
            elif p[0] == "end":
                ends[(int(p[1]), p[3], int(p[5]))] = (float(p[6]), p[7])
            elif p[0] == "begin":
                begun[p[2]].append((int(p[1]), float(p[5])))
            elif p[0] == "fnstart":
                fn_started[p[2]].append((int(p[1]), float(p[5])))
            elif p[0] == "effect":
                effects.append((int(p[1]), p[2], p[3], int(p[4]), p[5], float(p[6]), float(p[7])))

    # Effects: each key once, never from an epoch a later claim had superseded.
    keys = Counter(e[1] for e in effects)
    duplicates = {k: n for k, n in keys.items() if n > 1}
    # Stale: the effect function started after a newer epoch's claim (the
    # guard must refuse that). Applied late: it started under a valid lease
    # but reached the sink after a newer claim (a pause inside fn: only a
    # sink that checks the fence can refuse it).
    stale, applied_late = [], []
    for pid, key, job, epoch, _token, t0, t1 in effects:
        newer = [at for e, at in claim_at[job] if e > epoch]
        if any(at <= t0 for at in newer):
            stale.append(f"{key} epoch {epoch} at +{t0 - t_start:.2f}s after a newer claim (pid {pid})")
        elif any(at <= t1 for at in newer):
            applied_late.append(f"{key} epoch {epoch} fn +{t0 - t_start:.2f}..+{t1 - t_start:.2f}s (pid {pid})")
    missing = []
    for j, r in status.items():
        if r[1] == "succeeded":
            n = int(j.rsplit("-", 1)[1])
            s = int(j.split("-")[1][1:])
            for k in range(per_turn(s, n)):
                if keys.get(f"fx:{j}:{k}", 0) != 1:
                    missing.append(f"fx:{j}:{k}")

    # Executions: a killed process's open turns end at the kill; a paused
    # process's turns are frozen between SIGSTOP and SIGCONT.
    final_epoch = {j: r[3] for j, r in status.items()}
    execs = []
    for pid, session, job, i, epoch, t0 in starts:
        end = ends.get((pid, job, epoch))
        t1 = end[0] if end else fleet.killed_at.get(pid, now())
        outcome = end[1] if end else ("killed" if pid in fleet.killed_at else "open")
        zombie = epoch < final_epoch.get(job, epoch)
        execs.append((session, t0, t1, job, i, epoch, pid, outcome, zombie))
    by_session: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for e in execs:
        by_session[e[0]].append(e)
    overlaps, takeovers, zombie_overlaps, disorder = [], 0, [], []

    def live(e: tuple[Any, ...]) -> list[tuple[float, float]]:
        """The times an execution could act: not while its process was paused."""
        pid, t0, t1 = e[6], e[1], e[2]
        if pid in fleet.stopped:
            s, c = fleet.stopped[pid]
            parts = [(t0, min(t1, s)), (max(t0, c), t1)]
            return [(a, b) for a, b in parts if b > a]
        return [(t0, t1)]

    for session, items in by_session.items():
        items.sort(key=lambda e: e[1])
        for a_idx, a in enumerate(items):
            for b in items[a_idx + 1 :]:
                if b[1] >= a[2]:
                    continue
                if any(x0 < y1 and y0 < x1 for x0, x1 in live(a) for y0, y1 in live(b)):
                    if a[3] == b[3]:
                        takeovers += 1
                    elif a[8] or b[8]:
                        zombie_overlaps.append(f"{session}: {a[3]}@{a[5]}({a[7]}) and {b[3]}@{b[5]}({b[7]})")
                    else:
                        overlaps.append(f"{session}: {a[3]}@{a[5]} [{a[1] - t_start:.2f},{a[2] - t_start:.2f}] "
                                        f"and {b[3]}@{b[5]} [{b[1] - t_start:.2f},{b[2] - t_start:.2f}]")  # fmt: skip
        # Order: the first start of each turn follows submission order.
        first: dict[int, float] = {}
        for e in items:
            first.setdefault(e[4], e[1])
        seq = [i for i, _ in sorted(first.items(), key=lambda kv: kv[1])]
        if seq != sorted(seq):
            disorder.append(f"{session}: {seq[:20]}")

    # Re-lease latency: for each turn open in a killed or paused process, the
    # next claim of the turn after the fault.
    relase_kill: list[float] = []
    relase_stop: list[float] = []
    per_kill: dict[int, list[float]] = defaultdict(list)
    for _session, t0, _t1, job, _i, epoch, pid, outcome, _z in execs:
        # A turn held over the pause counts for the pause, even if its
        # process was killed later.
        if pid in fleet.stopped and t0 < fleet.stopped[pid][0] < _t1:
            t_fault = fleet.stopped[pid][0]
            bucket = relase_stop
        elif pid in fleet.killed_at and outcome == "killed":
            t_fault = fleet.killed_at[pid]
            bucket = relase_kill
        else:
            continue
        nxt = [at for e, at in claim_at[job] if e > epoch]
        if nxt:
            bucket.append(min(nxt) - t_fault)
            if bucket is relase_kill:
                per_kill[pid].append(min(nxt) - t_fault)

    def summary(xs: list[float]) -> dict[str, Any]:
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "min": round(min(xs), 2), "median": round(statistics.median(xs), 2),
                "max": round(max(xs), 2)}  # fmt: skip

    # The paused worker's turns: how long after SIGCONT they stopped, and its
    # effects that reached the sink after SIGCONT (in flight over the pause,
    # or started after it by a turn claimed before it).
    stopped_pid = next(iter(fleet.stopped), None)
    after_cont: list[tuple[float, str, bool]] = []
    zombie_effects_after_cont: list[tuple[Any, ...]] = []
    if stopped_pid is not None:
        t_stop, t_cont = fleet.stopped[stopped_pid]
        for x in execs:
            if x[6] == stopped_pid and x[1] < t_stop < x[2]:
                after_cont.append((x[2] - t_cont, x[7], x[8]))
        held = {(x[3], x[5]) for x in execs if x[6] == stopped_pid and x[1] < t_stop}
        for fx in effects:
            if fx[0] == stopped_pid and fx[6] > t_cont and (fx[5] < t_stop or (fx[2], fx[3]) in held):
                zombie_effects_after_cont.append(fx)
    # Each effect_unknown dead letter: when its effect reached the sink, and
    # when the process that ran it was killed or paused.
    unknown = []
    effect_at = {e[1]: e for e in effects}
    for r in status.values():
        if r[1] == "dead_letter" and r[2] == "effect_unknown":
            key = (r[5] or "").split("'")[1] if "'" in (r[5] or "") else "?"
            found = effect_at.get(key)
            if found is None:
                begins = [
                    (pid, round(t - t_start, 3), round(fleet.killed_at.get(pid, 0) - t, 3)) for pid, t in begun[key]
                ]
                fns = [(pid, round(t - t_start, 3)) for pid, t in fn_started[key]]
                led = ledger.get(key)
                led_s = (led[0], led[1], round(led[2] - t_start, 3), round(led[3] - t_start, 3)) if led else None
                unknown.append(f"{key}: not in the sink; begin (pid, t, kill-t) {begins} fnstart {fns} ledger {led_s}")
                continue
            pid = found[0]
            fault = fleet.killed_at.get(pid) or fleet.stopped.get(pid, (None,))[0]
            gap = f"{fault - found[6]:+.3f}s" if fault else "no fault"
            fn_s = f"+{found[5] - t_start:.2f}..+{found[6] - t_start:.2f}s"
            unknown.append(f"{key}: fn {fn_s}, fault of pid {pid} {gap} after fn end")
    report: dict[str, Any] = {
        "accepted": len(accepted),
        "by_status": dict(by_status),
        "lost": len(lost),
        "stuck": len(stuck),
        "stuck_samples": stuck[:5],
        "unexpected_terminal": odd[:5],
        "dlq_reasons": dict(dlq_reasons),
    }
    if dlq_without_reason:
        report["dlq_without_reason"] = len(no_reason)
    report.update({
        "executions": len(execs),
        "effects": len(effects),
        "duplicate_keys": len(duplicates),
        "duplicate_samples": list(duplicates.items())[:5],
        "stale_epoch_effects": len(stale),
        "stale_samples": stale[:5],
        "applied_after_newer_claim": len(applied_late),
        "applied_late_samples": applied_late[:5],
        "missing_effects_of_succeeded": len(missing),
        "missing_samples": missing[:5],
        "overlaps": len(overlaps),
        "overlap_samples": overlaps[:5],
        "takeovers_same_turn": takeovers,
        "zombie_overlaps": len(zombie_overlaps),
        "zombie_overlap_samples": zombie_overlaps[:3],
        "out_of_order_sessions": len(disorder),
        "disorder_samples": disorder[:3],
        "relase_after_kill_s": summary(relase_kill),
        "relase_after_sigstop_s": summary(relase_stop),
        "relase_per_kill": {
            f"+{fleet.killed_at[p] - t_start:.1f}s pid {p}": summary(xs) for p, xs in sorted(per_kill.items())
        },
        "paused_turns_end_after_sigcont_s": summary([x[0] for x in after_cont]),
        "paused_turn_outcomes": dict(Counter(x[1] for x in after_cont)),
        "paused_worker_effects_after_sigcont": len(zombie_effects_after_cont),
        "effect_unknown_detail": unknown[:20],
    })  # fmt: skip
    return Audit(report, status, claims, commits, execs)


def scan_logs(logs: Path) -> dict[str, Any]:
    levels: Counter[str] = Counter()
    tracebacks = []
    messages: Counter[str] = Counter()
    for f in sorted(logs.glob("*.log")):
        text = f.read_text(errors="replace")
        if "Traceback" in text:
            tracebacks.append(f.name)
        for line in text.splitlines():
            for lvl in ("CRITICAL", "ERROR", "WARNING"):
                if f" {lvl} " in line or line.startswith(lvl):
                    levels[lvl] += 1
                    # The message without times, pids and ids.
                    msg = line.split(lvl, 1)[1].strip()
                    msg = " ".join(w for w in msg.split() if not any(ch.isdigit() for ch in w))[:140]
                    messages[f"{lvl}: {msg}"] += 1
    return {"levels": dict(levels), "tracebacks_in": tracebacks, "top_messages": messages.most_common(15)}


def main(
    doc: str | None,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    *,
    turns: int,
    fault_s: float,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    verdict: tuple[str, ...] = (),
) -> None:
    """Parse the shared options (add_arguments adds the script's own), run,
    print the report and exit 1 if a VERDICT or verdict field is set."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=turns)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--ttl", type=int, default=6)
    ap.add_argument("--renew", type=float, default=1.0)
    ap.add_argument("--max-attempts", type=int, default=10)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--submit-s", type=float, default=60.0)
    ap.add_argument("--fault-s", type=float, default=fault_s)
    ap.add_argument("--stop-at", type=float, default=12.0)
    add_arguments(ap)
    ap.add_argument("--drain-s", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the cluster and its files")
    args = ap.parse_args()
    report = run(args)
    print(json.dumps(report, indent=1, default=str))
    bad = any(report[k] for k in (*VERDICT, *verdict))
    sys.exit(1 if bad else 0)
