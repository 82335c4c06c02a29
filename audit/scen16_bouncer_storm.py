"""Scenario 16 x scenario 4: the SIGKILL storm of tests/integration/
test_postgres_crash.py (without its database restart), with every worker and
the submitter going through a real PgBouncer in transaction mode. Reports lost
turns, duplicate effects, overlaps and order, as the direct run does, plus
whether each worker logged that it polls (LISTEN is not forwarded there).

    TURNS=1500 KILLS=10 python audit/scen16_bouncer_storm.py
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agentdispatch import Status, Submission
from backends import _pg_backed, _pg_base, fresh_pg_database
from crashkit import Fleet, analyse
from pgbouncer import bouncer

TURNS = int(os.environ.get("TURNS", "1500"))
KILLS = int(os.environ.get("KILLS", "10"))
SESSIONS, TENANTS = 60, 4
TTL_ENV = {"AGENT_DISPATCH_CLAIM_TTL_S": "8", "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5"}

cleanup: list[Callable[[], None]] = []
direct = fresh_pg_database(cleanup)
uri = bouncer(_pg_base()).uri(direct.rsplit("/", 1)[1])
h = _pg_backed("pgbouncer", uri, lambda: [fn() for fn in cleanup], {"claim_ttl_s": 8, "renew_interval_s": 0.5},
               AGENT_DISPATCH_PG_PREPARED_STATEMENTS="0")  # fmt: skip
root = Path(tempfile.mkdtemp(prefix="scen16-"))
sink = root / "sink"
sink.mkdir()
env = {**h.env, "CRASH_SINK_DIR": str(sink), **TTL_ENV}
subs = [
    Submission(
        kind="crash_turn", tenant=f"t{(i % SESSIONS) % TENANTS}", session_id=f"s{i % SESSIONS}", payload={"i": i}
    )
    for i in range(TURNS)
]
handles = []
for start in range(0, TURNS, 500):
    handles += h.dispatcher().submit_many(subs[start : start + 500])


fleet = Fleet(env, threads=4)
# Keep each worker's log: Fleet sends stderr to /dev/null, so wrap Popen here.
import subprocess  # noqa: E402

_popen = subprocess.Popen
logs: list[Path] = []


def popen(*a, **kw):  # type: ignore[no-untyped-def]
    path = root / f"worker{len(logs)}.log"
    logs.append(path)
    kw["stderr"] = path.open("wb")
    return _popen(*a, **kw)


subprocess.Popen = popen  # type: ignore[misc]
for _ in range(3):
    fleet.spawn()
rng = random.Random(11)
kills = 0
t0 = time.monotonic()
deadline = t0 + 300


def active() -> int:
    counts = h.store.counts(None)
    return sum(counts.get(s, 0) for s in ("submitted", "ready", "leased", "running"))


try:
    while time.monotonic() < deadline:
        left = active()
        if left == 0:
            break
        time.sleep(rng.uniform(0.1, 0.4))
        if kills < KILLS and TURNS - left >= TURNS * (kills + 1) // (KILLS + 1):
            fleet.kill(rng.choice(fleet.live()))
            kills += 1
            fleet.spawn()
finally:
    fleet.stop_all()
    subprocess.Popen = _popen  # type: ignore[misc]
took = time.monotonic() - t0
statuses = [h.store.get(x.job_id, None).status for x in handles]
report = analyse(sink, fleet.killed_at)
lost = sum(1 for s in statuses if not s.terminal)
by_status = {s.value: statuses.count(s) for s in set(statuses)}
warned = sum(1 for p in logs if "polling only" in p.read_text(errors="replace"))
print(
    f"pgbouncer crash: turns={TURNS} kills={kills} took={took:.0f}s lost={lost} "
    f"duplicates={report.duplicate_effects} overlaps={len(report.overlaps)} takeovers={len(report.takeovers)} "
    f"out_of_order={len(report.out_of_order)} executions={report.starts} by_status={by_status} "
    f"workers_warned_polling={warned}/{len(logs)}"
)
h.close()
ok = (
    lost == 0
    and report.duplicate_effects == 0
    and not report.overlaps
    and not report.out_of_order
    and statuses.count(Status.SUCCEEDED) + statuses.count(Status.DEAD_LETTER) == TURNS
)
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
