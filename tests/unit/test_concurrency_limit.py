"""The AIMD concurrency limit under overload, with a fake clock."""

from __future__ import annotations

import pytest

from agentdispatch.policy import ConcurrencyLimit


def test_overload_cuts_once_per_burst_and_holds_claims_for_retry_after():
    lim = ConcurrencyLimit(ceiling=1000, limit=1000, decrease=0.5)
    assert (lim.limit, lim.claim_delay(0.0)) == (1000, 0.0)
    lim.overloaded(10.0, retry_after_s=2.0)
    assert lim.limit == 500
    assert lim.claim_delay(10.5) == pytest.approx(1.5)
    lim.overloaded(10.1, retry_after_s=0.5)  # the same burst: counted once
    assert lim.limit == 500
    assert lim.claim_delay(12.0) == 0.0
    lim.overloaded(12.5)  # after the cool-down: cut again
    assert lim.limit == 250


def test_a_refused_turn_that_started_before_the_cut_cuts_nothing_more():
    lim = ConcurrencyLimit(ceiling=1000, limit=1000)
    lim.overloaded(10.0, retry_after_s=1.0, started_at=9.0)
    assert lim.limit == 700
    # Stragglers of the same burst, refused long after the cool-down.
    for t in (10.5, 12.0, 20.0):
        lim.overloaded(t, started_at=9.5)
    assert lim.limit == 700
    lim.overloaded(21.0, started_at=20.5)  # a turn started under the new limit
    assert lim.limit == 490


def test_successes_raise_the_limit_additively_up_to_the_ceiling():
    lim = ConcurrencyLimit(ceiling=200, limit=200, step=10, decrease=0.5)
    lim.overloaded(0.0)
    assert lim.limit == 100
    lim.succeeded(0.5)  # still cooling down
    assert lim.limit == 100
    now = 1.0
    for _ in range(30):
        now += 1.0
        lim.succeeded(now)
    assert lim.limit == 200  # +10 a period, capped


def test_the_default_step_is_two_percent_of_the_limit_in_force():
    lim = ConcurrencyLimit(ceiling=10_000, limit=500)
    lim.overloaded(0.0)
    assert lim.limit == 350
    lim.succeeded(1.0)
    lim.succeeded(2.0)
    assert lim.limit == 357  # +7, not +100 (one percent of the ceiling)


def test_slow_start_grows_a_period_after_the_limit_was_filled():
    lim = ConcurrencyLimit(ceiling=2000, initial=256, ramp_every_s=0.5, ramp_factor=1.5)
    assert lim.limit == 256
    lim.tick(0.0, 100)
    lim.tick(1.0, 100)
    assert lim.limit == 256  # never filled: never tried against the gateway
    lim.tick(1.1, 256)  # filled here
    assert lim.ramp_in(1.2) == pytest.approx(0.4)
    lim.tick(1.5, 256)
    assert lim.limit == 256  # filled, but not a period ago yet
    seen = []
    for t in (1.6, 1.7, 2.2, 2.3, 2.8, 2.9, 3.4):
        lim.tick(t, lim.limit)
        seen.append(lim.limit)
    assert seen == [384, 384, 576, 576, 864, 864, 1296]
    for t in (4.0, 4.6, 4.7, 5.2):
        lim.tick(t, lim.limit)
    assert (lim.limit, lim.ramp_in(5.2)) == (2000, None)  # capped at the ceiling: done
    lim.succeeded(6.0)
    assert lim.limit == 2000


def test_slow_start_is_not_held_back_by_turns_ending_and_being_replaced():
    lim = ConcurrencyLimit(ceiling=2000, initial=256, ramp_every_s=0.5, ramp_factor=1.5)
    lim.tick(0.0, 256)
    lim.tick(0.2, 250)  # a few turns ended, their replacements not claimed yet
    lim.tick(0.5, 251)
    assert lim.limit == 384


def test_overload_ends_the_slow_start():
    lim = ConcurrencyLimit(ceiling=1000, initial=256, ramp_every_s=0.5, ramp_factor=2.0)
    lim.tick(0.0, 256)
    lim.tick(0.5, 256)
    assert lim.limit == 512
    lim.overloaded(0.6, retry_after_s=1.0, started_at=0.55)
    assert lim.limit == 358
    assert lim.ramp_in(0.6) is None
    lim.tick(5.0, 358)
    lim.tick(6.0, 358)
    assert lim.limit == 358  # no more doubling: additive increase from here on
    lim.succeeded(2.0)
    assert lim.limit == 365


def test_a_small_ceiling_starts_at_the_ceiling():
    lim = ConcurrencyLimit(ceiling=16)
    assert lim.limit == 16
    assert lim.ramp_in(0.0) is None


def test_the_limit_never_drops_below_the_floor():
    lim = ConcurrencyLimit(ceiling=8, floor=2)
    for t in range(10):
        lim.overloaded(float(t * 10))
    assert lim.limit == 2
    with pytest.raises(ValueError):
        ConcurrencyLimit(ceiling=0)
