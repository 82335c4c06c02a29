"""Scenario 21, scaled: turns longer than ``max.poll.interval.ms`` on Kafka
(a real Kafka-protocol broker, Tansu). The interval is 6 s and the long turns
take LONG_S (default 13 s, over 2x the interval, as the scenario's 120 s
against 60 s); short turns run beside them. Each turn makes one side effect
through the lease guard. Pass: every turn succeeds, each handler runs once,
each effect applies once, no rebalance (revocation) and no hand-off.

    LONG=4 SHORT=20 LONG_S=13 python audit/scen21_long_turn.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from agentdispatch import Status, Submission
from agentdispatch.dispatch import Dispatcher
from agentdispatch.handlers import Registry
from agentdispatch.worker import Worker, WorkerOptions
from integration.test_kafka_transport import Env

LONG, SHORT, LONG_S = (
    int(os.environ.get("LONG", "4")),
    int(os.environ.get("SHORT", "20")),
    float(os.environ.get("LONG_S", "13")),
)
env = Env(Path(tempfile.mkdtemp(prefix="scen21-")))
settings = env.settings(claim_ttl_s=30, renew_interval_s=5)
store, transport = env.open(settings, max_poll_interval_ms=6_000, session_timeout_ms=6_000)
runs: Counter[str] = Counter()
effects: Counter[str] = Counter()
lock = threading.Lock()


def handler(turn: Any, guard: Any) -> str:
    with lock:
        runs[turn.job_id] += 1
    time.sleep(float(turn.payload["sleep"]))

    def effect() -> str:
        with lock:
            effects[turn.job_id] += 1
        return "sent"

    return str(guard.side_effect(f"reply:{turn.job_id}", effect))


reg = Registry()
reg.add("work", handler)
worker = Worker(
    settings, store, transport, reg, options=WorkerOptions(threads=LONG + 1, get_wait_s=0.05, heartbeat_s=1)
)
worker.start()
t0 = time.monotonic()
try:
    while transport.stats()["assignments"] < 1 and time.monotonic() < t0 + 30:
        time.sleep(0.1)
    time.sleep(4)  # let the group settle
    settled = transport.stats()
    d = Dispatcher(store, transport, settings)
    every = [d.submit(Submission(kind="work", tenant="t", payload={"sleep": LONG_S})) for _ in range(LONG)]
    every += [d.submit(Submission(kind="work", tenant="t", payload={"sleep": 0})) for _ in range(SHORT)]
    deadline = time.monotonic() + 4 * LONG_S + 60
    while not all(store.get(h.job_id, None).status.terminal for h in every) and time.monotonic() < deadline:
        time.sleep(0.2)
finally:
    worker.stop(grace_s=5)
after = transport.stats()
statuses = Counter(store.get(h.job_id, None).status for h in every)
dup_runs = sum(1 for h in every if runs[h.job_id] != 1)
dup_effects = sum(1 for h in every if effects[h.job_id] != 1)
revoked = after["revocations"] - settled["revocations"]
print(f"long={LONG}x{LONG_S:g}s short={SHORT} max.poll.interval=6s statuses={dict(statuses)}")
print(f"handlers_not_once={dup_runs} effects_not_once={dup_effects} revocations={revoked} handoffs={after['handoffs']}")
env.close()
ok = (
    statuses == Counter({Status.SUCCEEDED: LONG + SHORT})
    and dup_runs == dup_effects == revoked == after["handoffs"] == 0
)
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
