"""Cron arithmetic of periodic schedules (croniter underneath)."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from agentdispatch.errors import InvalidInput
from agentdispatch.schedules import check_cron, latest_tick, next_tick, tick_job_id
from agentdispatch.stores.base import Schedule

BERLIN = ZoneInfo("Europe/Berlin")


def _t(*args: int, tz: ZoneInfo = BERLIN) -> float:
    return datetime(*args, tzinfo=tz).timestamp()


def test_ticks_follow_the_time_zone() -> None:
    # 09:00 every day in Berlin is 08:00 UTC in winter, 07:00 UTC in summer.
    assert next_tick("0 9 * * *", "Europe/Berlin", _t(2026, 1, 5, 8, 0)) == _t(2026, 1, 5, 9, 0)
    assert next_tick("0 9 * * *", "Europe/Berlin", _t(2026, 7, 5, 9, 0)) == _t(2026, 7, 6, 9, 0)
    assert next_tick("0 9 * * *", "UTC", _t(2026, 7, 5, 9, 0)) == _t(2026, 7, 5, 11, 0)


def test_missed_ticks_collapse_into_the_latest() -> None:
    # Down from 10:02 to 10:31: six ticks of */5 were missed; one fires, for 10:30.
    tick, following = latest_tick("*/5 * * * *", "UTC", _t(2026, 1, 1, 10, 31, 20, tz=ZoneInfo("UTC")))
    assert tick == _t(2026, 1, 1, 10, 30, tz=ZoneInfo("UTC"))
    assert following == _t(2026, 1, 1, 10, 35, tz=ZoneInfo("UTC"))
    # Exactly on a tick: that tick.
    on = _t(2026, 1, 1, 10, 35, tz=ZoneInfo("UTC"))
    assert latest_tick("*/5 * * * *", "UTC", on)[0] == on


def test_a_tick_has_one_job_id() -> None:
    s = Schedule("t", "nightly", "0 3 * * *", "UTC", "echo", None, next_at=0.0, created_at=1.5)
    again = Schedule("t", "nightly", "0 3 * * *", "UTC", "echo", {"edited": 1}, next_at=9.0, created_at=1.5)
    recreated = Schedule("t", "nightly", "0 3 * * *", "UTC", "echo", None, next_at=0.0, created_at=2.5)
    assert tick_job_id(s, 100.0) == tick_job_id(again, 100.0) != tick_job_id(s, 160.0)
    assert tick_job_id(recreated, 100.0) != tick_job_id(s, 100.0)


@pytest.mark.parametrize("cron", ["", "nope", "61 * * * *", "* * * *", "x" * 300])
def test_bad_cron_is_refused(cron: str) -> None:
    with pytest.raises(InvalidInput):
        check_cron(cron)


def test_unknown_time_zone_is_refused() -> None:
    with pytest.raises(InvalidInput, match="time zone"):
        next_tick("* * * * *", "Mars/Olympus", 0.0)
