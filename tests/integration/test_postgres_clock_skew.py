"""Reliability scenario 8: worker hosts whose clocks are five minutes fast
and five minutes slow share one PostgreSQL queue. Lease expiry is judged by
the database clock only, so turns that outlive the TTL and renew are never
reclaimed, and each effect happens once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from agentdispatch import Status, Submission
from backends import postgres_harness
from contract.helpers import wait_until

APPS = Path(__file__).parent.parent / "apps"
TURNS = 120
SKEWS = (300.0, -300.0)


def test_workers_five_minutes_off_reclaim_nothing(tmp_path: Path) -> None:
    h = postgres_harness(tmp_path, claim_ttl_s=2.0, renew_interval_s=0.6)
    sink = tmp_path / "sink"
    sink.mkdir()
    d = h.dispatcher()
    # Up to four seconds a turn against a two-second TTL: most turns renew.
    subs = [
        Submission(kind="crash_turn", tenant="t", session_id=f"s{i % 20}", payload={"i": i, "max_sleep": 2.0})
        for i in range(TURNS)
    ]
    jobs = [x.job_id for x in d.submit_many(subs)]
    procs = []
    spawned = time.time()
    try:
        for skew in SKEWS:
            env = {
                **os.environ,
                **h.env,
                "CRASH_SINK_DIR": str(sink),
                "AGENT_DISPATCH_CLAIM_TTL_S": "2",
                "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.6",
                "AGENTDISPATCH_TEST_SKEW_S": str(skew),
                "PYTHONPATH": os.pathsep.join([str(APPS / "skew"), str(APPS), os.environ.get("PYTHONPATH", "")]),
            }
            cmd = [sys.executable, "-m", "agentdispatch", "worker", "--concurrency", "6", "--app", "crash_app:registry"]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(lambda: all(h.store.get(j, "t").status.terminal for j in jobs), timeout=180, every=0.5)
        # Each worker stamps its start with its own clock: the skew took hold.
        started = sorted(w.started_at - spawned for w in h.store.workers())
        items = [h.store.get(j, "t") for j in jobs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        h.close()
    lines = [line.split() for log in sink.glob("*.log") for line in log.read_text().splitlines()]
    effects = Counter(parts[2] for parts in lines if parts[0] == "effect")
    pids = {parts[1] for parts in lines if parts[0] == "start"}
    assert len(started) == 2 and started[0] < -250 and started[1] > 250, started
    assert {i.status for i in items} == {Status.SUCCEEDED}
    assert {(i.attempt, i.lease_epoch) for i in items} == {(1, 1)}  # no reclaim, premature or other
    assert effects == dict.fromkeys(jobs, 1)
    assert len(pids) == 2  # both skewed workers ran turns
