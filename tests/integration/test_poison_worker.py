"""Reliability scenario 9: a turn that SIGKILLs its worker on every attempt
reaches the dead-letter queue after exactly max_attempts claims, and the turns
that were in flight beside it each time still finish."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from agentdispatch import Status, Submission
from backends import sqlite_harness

APPS = Path(__file__).parent.parent / "apps"


def test_a_poison_turn_is_dead_lettered_alone(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path, claim_ttl_s=1.0, renew_interval_s=0.3)
    env = {
        **os.environ,
        **h.env,
        "AGENT_DISPATCH_CLAIM_TTL_S": "1",
        "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.3",
        "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [sys.executable, "-m", "agentdispatch", "worker", "--concurrency", "40", "--app", "poison_app:registry"]
    try:
        subs = [Submission(kind="work", payload={"seconds": 1.0}, tenant="t", session_id=f"s{i}") for i in range(60)]
        subs.insert(30, Submission(kind="poison", tenant="t", session_id="poison"))
        jobs = [x.job_id for x in h.dispatcher().submit_many(subs)]
        poison = jobs[30]
        deaths = 0
        deadline = time.monotonic() + 240

        def settled() -> bool:
            return all(h.store.get(j, "t").status.terminal for j in jobs)

        # A supervisor's loop: restart the worker each time it dies.
        while not settled() and time.monotonic() < deadline:
            worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                while worker.poll() is None and not settled() and time.monotonic() < deadline:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        worker.wait(timeout=0.5)
                deaths += worker.poll() is not None
            finally:
                if worker.poll() is None:
                    worker.terminate()
                    worker.wait(timeout=60)
        items = {j: h.store.get(j, "t") for j in jobs}
        dead = items.pop(poison)
        assert (dead.status, dead.reason, dead.attempt) == (Status.DEAD_LETTER, "lease_exhausted", 5)
        assert deaths == 5  # one per claim of the poison turn
        assert {j: i.status for j, i in items.items() if i.status is not Status.SUCCEEDED} == {}
    finally:
        h.close()
