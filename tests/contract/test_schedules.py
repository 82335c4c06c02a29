"""Contract: periodic schedules in every store (issue 20, item 2)."""

from __future__ import annotations

import threading

import pytest

from agentdispatch import InvalidInput
from agentdispatch.schedules import ScheduleExists, ScheduleNotFound, Schedules, tick_job_id
from agentdispatch.stores.base import Schedule

from .helpers import wait_until

EVERY_SECOND = "* * * * * *"  # six fields: seconds last


def _db_now(harness) -> float:
    return harness.store.schedules_due(1)[0]


def _jobs(harness, tenant: str = "t") -> list[str]:
    return [i.id for i in harness.dispatcher().jobs(tenant, limit=500)]


def test_add_list_pause_resume_delete(harness):
    s = Schedules(harness.dispatcher())
    view = s.add("t", "nightly", cron="0 3 * * *", tz="Europe/Berlin", kind="echo", payload={"r": 1})
    assert (view["name"], view["tz"], view["paused"], view["payload"]) == ("nightly", "Europe/Berlin", False, {"r": 1})
    assert view["next_at"] > _db_now(harness)
    with pytest.raises(ScheduleExists):
        s.add("t", "nightly", cron="* * * * *", kind="echo")
    assert [v["name"] for v in s.entries("t")] == ["nightly"] and s.entries("other") == []
    assert s.pause("t", "nightly")["paused"] is True
    assert s.resume("t", "nightly")["paused"] is False
    assert s.delete("t", "nightly")["name"] == "nightly"
    for call in (s.pause, s.resume, s.delete, s.get):
        with pytest.raises(ScheduleNotFound):
            call("t", "nightly")
    with pytest.raises(ScheduleNotFound):
        s.get("other", "nightly")  # another tenant's looks missing


@pytest.mark.parametrize(
    "fields",
    [
        {"cron": "not cron", "kind": "echo"},
        {"cron": "* * * * *", "kind": "echo", "tz": "Nowhere/Land"},
        {"cron": "* * * * *", "kind": "bad kind"},
        {"cron": "* * * * *", "kind": "echo", "priority": 1000},
        {"cron": "* * * * *", "kind": "echo", "payload": float("nan")},
        {"cron": "0 0 30 2 *", "kind": "echo"},  # February 30th: never fires
        {"cron": "* * * * * * 2020", "kind": "echo"},  # croniter's year field: runs out of ticks
        {"cron": "* * * * * * *", "kind": "echo"},
    ],
)
def test_bad_schedules_are_refused_and_change_nothing(harness, fields):
    s = Schedules(harness.dispatcher())
    with pytest.raises(InvalidInput):
        s.add("t", "bad", **fields)
    assert s.entries("t") == []


def test_missed_ticks_fire_once_and_a_tick_fires_one_job(harness):
    s = Schedules(harness.dispatcher())
    view = s.add("t", "often", cron=EVERY_SECOND, kind="echo", payload={"p": 1})
    # Nothing fires for a while (an outage): several ticks pass.
    first = view["next_at"]
    wait_until(lambda: _db_now(harness) >= first + 2.0, timeout=30, every=0.1)
    # Two firers race on the due schedule: one job, the one of the latest tick.
    results: list[list[str]] = []
    barrier = threading.Barrier(2)

    def fire() -> None:
        barrier.wait()
        results.append(Schedules(harness.dispatcher()).fire_due())

    threads = [threading.Thread(target=fire) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fired = {j for r in results for j in r}
    assert len(fired) == 1
    (job,) = fired
    assert _jobs(harness) == [job]
    after = s.get("t", "often")
    assert after["last_job_id"] == job and after["last_tick"] >= first + 2.0
    assert after["next_at"] > after["last_tick"]
    sched = next(x for x in harness.store.schedules("t") if x.name == "often")
    assert tick_job_id(sched, after["last_tick"]) == job
    assert harness.store.get(job, "t").payload == {"p": 1}
    # A paused schedule fires nothing, however long it waits.
    s.pause("t", "often")
    paused_at = _db_now(harness)
    wait_until(lambda: _db_now(harness) >= paused_at + 1.5, timeout=30, every=0.1)
    assert s.fire_due() == [] and _jobs(harness) == [job]


def test_a_worker_fires_due_schedules(harness):
    from agentdispatch.handlers import builtins

    s = Schedules(harness.dispatcher())
    s.add("t", "tick", cron=EVERY_SECOND, kind="echo", payload="beat")
    worker = harness.worker(builtins(), threads=1)
    worker.start()
    try:
        wait_until(lambda: any(harness.store.get(j, "t").status.terminal for j in _jobs(harness)), timeout=30)
    finally:
        worker.stop()
    s.pause("t", "tick")
    jobs = _jobs(harness)
    assert jobs and all(harness.store.get(j, "t").payload == "beat" for j in jobs)


def test_a_stored_schedule_without_a_next_tick_is_paused_and_holds_up_no_other(harness):
    # A row from before such expressions were refused: its year is over.
    now = _db_now(harness)
    over = Schedule("t", "over", "0 0 1 1 * 0 2020", "UTC", "echo", None, next_at=now - 60.0, created_at=now - 90.0)
    assert harness.store.schedule_add(over)
    s = Schedules(harness.dispatcher())
    s.add("t", "live", cron=EVERY_SECOND, kind="echo")
    first = s.get("t", "live")["next_at"]
    wait_until(lambda: _db_now(harness) >= first, timeout=30, every=0.1)
    fired = s.fire_due()  # the spent row is due first; the live one still fires
    assert len(fired) == 1 and _jobs(harness) == fired
    assert s.get("t", "over")["paused"] is True and s.get("t", "live")["paused"] is False
