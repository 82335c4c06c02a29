"""A SIGKILLed worker's turns resume from their checkpoints in another process."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from agentdispatch import Status, Submission
from backends import BUILDERS
from crashkit import Fleet

TTL_ENV = {"AGENT_DISPATCH_CLAIM_TTL_S": "2", "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5"}
TURNS, STEPS = 8, 10


def _lines(sink: Path, kind: str) -> list[list[str]]:
    return [
        parts
        for log in sink.glob("*.log")
        for parts in (line.split() for line in log.read_text().splitlines())
        if parts[0] == kind
    ]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_killed_turn_resumes_from_its_checkpoint(tmp_path: Path, backend: str) -> None:
    h = BUILDERS[backend](tmp_path / "h0", claim_ttl_s=2, renew_interval_s=0.5)
    sink = tmp_path / "sink"
    sink.mkdir()
    fleet = Fleet({**h.env, "CRASH_SINK_DIR": str(sink), **TTL_ENV}, threads=TURNS)
    try:
        payload = {"steps": STEPS, "step_s": 0.1}
        handles = h.dispatcher().submit_many(
            [Submission(kind="checkpoint_turn", tenant="t", session_id=f"s{i}", payload=payload) for i in range(TURNS)]
        )
        victim = fleet.spawn()
        # Kill the first worker once every turn is part way through.
        deadline = time.monotonic() + 60
        while len({p[2] for p in _lines(sink, "step")}) < TURNS or len(_lines(sink, "step")) < TURNS * 3:
            assert time.monotonic() < deadline, "the first worker never got going"
            time.sleep(0.02)
        fleet.kill(victim)
        saved = {x.job_id: len(h.store.get(x.job_id, "t").checkpoint["done"]) for x in handles}
        fleet.spawn()
        deadline = time.monotonic() + 90
        while not all(h.store.get(x.job_id, "t").status.terminal for x in handles):
            assert time.monotonic() < deadline, "the turns never finished"
            time.sleep(0.1)
        items = [h.store.get(x.job_id, "t") for x in handles]
    finally:
        fleet.stop_all()
        h.close()
    resumed = {p[2]: int(p[4]) for p in _lines(sink, "resume") if int(p[3]) > 1}
    runs = Counter((p[2], int(p[3])) for p in _lines(sink, "step"))
    print(f"\n{backend}: saved before the kill {sorted(saved.values())}, resumed at {sorted(resumed.values())}")
    assert all(it.status is Status.SUCCEEDED for it in items)
    # Every step's work is in the result once, in order, across both attempts.
    assert all(it.result == {"done": list(range(STEPS))} for it in items)
    # The second attempt of each turn started where its checkpoint left off ...
    assert resumed == saved and all(0 < n < STEPS for n in saved.values())
    # ... so at most the one step in flight at the kill ran twice.
    assert all(runs[(x.job_id, s)] == 1 for x in handles for s in range(saved[x.job_id]))
    assert sum(runs.values()) <= TURNS * (STEPS + 1)
