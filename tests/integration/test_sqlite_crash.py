"""Real worker processes on one SQLite file, SIGKILLed and SIGSTOPped."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from agentdispatch import Status, Submission
from backends import Harness, sqlite_harness
from crashkit import Fleet, analyse, pause_between_writes

TTL_ENV = {"AGENT_DISPATCH_CLAIM_TTL_S": "2", "AGENT_DISPATCH_RENEW_INTERVAL_S": "0.5"}


def _env(tmp_path: Path) -> dict[str, str]:
    sink = tmp_path / "sink"
    sink.mkdir()
    return {
        "AGENT_DISPATCH_DATA_DIR": str(tmp_path / "h0" / "data"),
        "TASK_QUEUE_BACKEND": "sqlite",
        "CRASH_SINK_DIR": str(sink),
        **TTL_ENV,
    }


def _storm(h: Harness, fleet: Fleet, *, max_kills: int, seed: int = 7) -> int:
    """Three workers; SIGKILL one (and start another) at each of
    ``max_kills`` even steps of progress, until every turn is terminal.
    Returns the kills. Paced by progress, not by the clock: a peer reaps a
    killed worker within about a second, so on a fast run a storm timed by
    the clock ended before its kills."""
    for _ in range(3):
        fleet.spawn()
    rng = random.Random(seed)
    kills = 0
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            counts = h.store.counts(None)
            active = sum(counts.get(s, 0) for s in ("submitted", "ready", "leased", "running"))
            if active == 0:
                break
            time.sleep(rng.uniform(0.1, 0.4))
            total = sum(counts.values())
            if kills < max_kills and total - active >= total * (kills + 1) // (max_kills + 1):
                victim = rng.choice(fleet.live())
                fleet.kill(victim)
                kills += 1
                fleet.spawn()
    finally:
        fleet.stop_all()
    return kills


@pytest.mark.slow
def test_sigkill_storm_loses_nothing_and_never_duplicates(tmp_path: Path) -> None:
    env = _env(tmp_path)
    h = sqlite_harness(tmp_path / "h0", claim_ttl_s=2, renew_interval_s=0.5)
    turns, sessions = 2000, 80
    handles = []
    subs = [
        Submission(kind="crash_turn", tenant=f"t{i % 4}", session_id=f"s{i % sessions}", payload={"i": i})
        for i in range(turns)
    ]
    for start in range(0, turns, 500):
        handles += h.dispatcher().submit_many(subs[start : start + 500])
    fleet = Fleet(env, threads=4)
    kills = _storm(h, fleet, max_kills=12)
    statuses = [h.store.get(x.job_id, None).status for x in handles]
    report = analyse(Path(env["CRASH_SINK_DIR"]), fleet.killed_at)
    lost = sum(1 for s in statuses if not s.terminal)
    print(
        f"\nsqlite crash: turns={turns} kills={kills} lost={lost} "
        f"duplicates={report.duplicate_effects} overlaps={len(report.overlaps)} takeovers={len(report.takeovers)} "
        f"out_of_order={len(report.out_of_order)} executions={report.starts} "
        f"by_status={ {s.value: statuses.count(s) for s in set(statuses)} }"
    )
    h.close()
    assert kills >= 5
    assert lost == 0
    assert report.duplicate_effects == 0
    assert report.overlaps == []
    assert report.out_of_order == []
    assert statuses.count(Status.SUCCEEDED) + statuses.count(Status.DEAD_LETTER) == turns
    # Every committed effect belongs to a turn that ran; nothing ran twice.
    assert all(n == 1 for n in report.effects.values())


def test_sigstop_zombie_cannot_commit_or_run_a_side_effect(tmp_path: Path) -> None:
    env = _env(tmp_path)
    h = sqlite_harness(tmp_path / "h0", claim_ttl_s=2, renew_interval_s=0.5)
    job = h.dispatcher().submit(Submission(kind="slow_effect", tenant="t", payload={"seconds": 1.5}))
    fleet = Fleet(env, threads=1)
    zombie = fleet.spawn()
    sink = Path(env["CRASH_SINK_DIR"])
    try:
        deadline = time.monotonic() + 20
        while not (sink / f"{zombie.pid}.log").exists():
            assert time.monotonic() < deadline, "the first worker never started the turn"
            time.sleep(0.05)
        pause_between_writes(zombie, h.settings.sqlite_path)
        first_epoch = h.store.get(job.job_id, "t").lease_epoch
        rescuer = fleet.spawn()
        deadline = time.monotonic() + 30
        while h.store.get(job.job_id, "t").status is not Status.SUCCEEDED:
            assert time.monotonic() < deadline, "the lease was never taken over"
            time.sleep(0.1)
        zombie.send_signal(signal.SIGCONT)
        time.sleep(3)  # the zombie wakes, finishes its sleep, tries its effect and commit
        item = h.store.get(job.job_id, "t")
    finally:
        fleet.stop_all()
    report = analyse(sink, {})
    effects = (sink / f"{zombie.pid}.log").read_text().count("effect")
    print(f"\nzombie: first_epoch={first_epoch} final_epoch={item.lease_epoch} zombie_effects={effects}")
    assert item.status is Status.SUCCEEDED
    assert item.lease_epoch > first_epoch
    assert item.result == {"pid": rescuer.pid}
    assert effects == 0
    assert report.effects == {job.job_id: 1}
    h.close()


@pytest.mark.slow
def test_verified_and_idempotent_effects_settle_without_a_person(tmp_path: Path) -> None:
    """SIGKILLs during effects: undeclared effects end in the DLQ as
    effect_unknown (the baseline of this run); effects with verify or an
    idempotent downstream never do, and none of them runs twice."""
    env = _env(tmp_path)
    h = sqlite_harness(tmp_path / "h0", claim_ttl_s=2, renew_interval_s=0.5)
    kinds, per_kind, sessions = ("crash_turn", "verify_turn", "idempotent_turn"), 600, 60
    # Longer work around each effect: more kills land between its begin and end.
    subs = [
        Submission(kind=kinds[i % 3], tenant="t", session_id=f"s{i % sessions}", payload={"i": i, "max_sleep": 0.06})
        for i in range(per_kind * 3)
    ]
    handles = []
    for start in range(0, len(subs), 500):
        handles += h.dispatcher().submit_many(subs[start : start + 500])
    fleet = Fleet(env, threads=4)
    kills = _storm(h, fleet, max_kills=40, seed=11)
    items = [h.store.get(x.job_id, None) for x in handles]
    report = analyse(Path(env["CRASH_SINK_DIR"]), fleet.killed_at)
    unknown = {k: sum(1 for it in items if it.kind == k and it.reason == "effect_unknown") for k in kinds}
    lost = sum(1 for it in items if not it.status.terminal)
    print(
        f"\neffect_unknown after {kills} kills over {len(items)} turns: {unknown} "
        f"lost={lost} duplicates={report.duplicate_effects}"
    )
    h.close()
    assert kills >= 20
    assert lost == 0
    assert report.duplicate_effects == 0
    assert unknown["verify_turn"] == 0 and unknown["idempotent_turn"] == 0
    done = [it for it in items if it.kind != "crash_turn"]
    assert all(it.status is Status.SUCCEEDED for it in done)
    # Every settled effect happened exactly once downstream.
    assert all(report.effects.get(it.id) == 1 for it in done)
