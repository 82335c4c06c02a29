"""Real worker processes on one PostgreSQL, SIGKILLed and restarted, with a
restart of PostgreSQL itself in the middle of the run."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from agentdispatch import Status, Submission
from backends import pg_harness_at
from crashkit import Fleet, analyse
from pg import PrivateCluster

# The TTL outlasts the database restart (about 3 s here): leases must survive an
# outage shorter than the TTL. A longer outage can expire a lease while its
# handler still runs; only side effects are fenced then (see the lead's notes).
TTL_ENV = {"AGENT_DISPATCH_CLAIM_TTL_S": "8", "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5"}


@pytest.mark.slow
# One tenant: its claims take a lone tenant's batch in one pass and skip its
# fairness stamp; four: passes serve the tenants round by round.
@pytest.mark.parametrize("tenants", [4, 1])
def test_sigkill_storm_and_database_restart_lose_nothing(tmp_path: Path, tenants: int) -> None:
    cluster = PrivateCluster().start()
    h = pg_harness_at(cluster.uri(), cluster.destroy, claim_ttl_s=8, renew_interval_s=0.5)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {**h.env, "CRASH_SINK_DIR": str(sink), **TTL_ENV}
    turns, sessions = 1500, 60
    subs = [
        # One tenant per session: a session is serial within its tenant.
        Submission(
            kind="crash_turn", tenant=f"t{(i % sessions) % tenants}", session_id=f"s{i % sessions}", payload={"i": i}
        )
        for i in range(turns)
    ]
    handles = []
    for start in range(0, turns, 500):
        handles += h.dispatcher().submit_many(subs[start : start + 500])
    fleet = Fleet(env, threads=4)
    for _ in range(3):
        fleet.spawn()
    rng = random.Random(11)
    kills, restarted, restart_s = 0, False, 0.0
    deadline = time.monotonic() + 170

    def active() -> int:
        counts = h.store.counts(None)
        return sum(counts.get(s, 0) for s in ("submitted", "ready", "leased", "running"))

    try:
        while time.monotonic() < deadline:
            left = active()
            if left == 0:
                break
            if not restarted and left < turns * 0.6:
                t0 = time.monotonic()
                cluster.restart()
                restart_s = time.monotonic() - t0
                restarted = True
                continue
            time.sleep(rng.uniform(0.1, 0.4))
            # At even steps of progress, not of time: a peer reaps a killed
            # worker within about a second, so a run can end before timed kills.
            if kills < 10 and turns - left >= turns * (kills + 1) // 11:
                fleet.kill(rng.choice(fleet.live()))
                kills += 1
                fleet.spawn()
    finally:
        fleet.stop_all()
    statuses = [h.store.get(x.job_id, None).status for x in handles]
    report = analyse(sink, fleet.killed_at)
    lost = sum(1 for s in statuses if not s.terminal)
    by_status = {s.value: statuses.count(s) for s in set(statuses)}
    print(
        f"\npostgres crash: turns={turns} kills={kills} pg_restart={restarted} ({restart_s:.1f} s) lost={lost} "
        f"duplicates={report.duplicate_effects} overlaps={len(report.overlaps)} takeovers={len(report.takeovers)} "
        f"out_of_order={len(report.out_of_order)} executions={report.starts} by_status={by_status}"
    )
    h.close()
    assert restarted and kills >= 5
    assert lost == 0
    assert report.duplicate_effects == 0
    assert report.overlaps == [], report.overlaps
    assert report.out_of_order == []
    assert statuses.count(Status.SUCCEEDED) + statuses.count(Status.DEAD_LETTER) == turns
    assert all(n == 1 for n in report.effects.values())
