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
    assert lim.limit == 900
    # Stragglers of the same burst, refused long after the cool-down: no new
    # cut, but each says the gateway took one turn less than the cut assumed.
    for t in (10.5, 12.0, 20.0):
        lim.overloaded(t, started_at=9.5)
    assert lim.limit == 897
    lim.overloaded(21.0, started_at=20.5)  # a turn started under the new limit
    assert lim.limit == 807


def test_a_slow_start_overshoot_lands_near_the_capacity_in_one_burst():
    lim = ConcurrencyLimit(ceiling=2000, limit=864)
    # 864 claimed at once; the gateway takes 564 of them and refuses 300.
    lim.overloaded(10.0, retry_after_s=1.0, started_at=9.5, in_flight=864)
    assert lim.limit == 778
    for i in range(299):
        lim.overloaded(10.0 + i / 1000, retry_after_s=1.0, started_at=9.5, in_flight=863 - i)
    assert lim.limit == round(0.9 * 565)


def test_the_cut_starts_from_the_turns_in_flight_when_refused():
    lim = ConcurrencyLimit(ceiling=2000, limit=1000)
    # The limit ran ahead of the turns running: the gateway refused at 600.
    lim.overloaded(10.0, started_at=9.0, in_flight=600)
    assert lim.limit == 540
    # More in flight than the limit (turns started before the cut): the limit counts.
    lim.overloaded(20.0, started_at=19.0, in_flight=700)
    assert lim.limit == 486


def test_successes_regain_half_the_way_to_the_last_refusal_a_period():
    lim = ConcurrencyLimit(ceiling=200, limit=200, step=10, decrease=0.5)
    lim.overloaded(0.0)
    assert lim.limit == 100
    lim.succeeded(0.5)  # still cooling down
    assert lim.limit == 100
    seen = []
    for now in (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0):
        lim.succeeded(now)
        seen.append(lim.limit)
    # Half the distance to 200 a period, at least a step, capped at the ceiling.
    assert seen == [150, 150, 175, 187, 197, 200, 200]


def test_past_the_last_refusal_the_default_step_is_two_percent_of_the_limit():
    lim = ConcurrencyLimit(ceiling=10_000, limit=500)
    lim.overloaded(0.0)
    assert lim.limit == 450
    seen = []
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        lim.succeeded(now)
        seen.append(lim.limit)
    # +25, +12, +9 (two percent beats half of 4), then probing: +9, +10, +10.
    assert seen == [475, 487, 496, 505, 515, 525]


def test_a_refusal_in_the_period_postpones_the_increase():
    lim = ConcurrencyLimit(ceiling=1000, limit=500)
    lim.overloaded(0.0, started_at=-1.0)
    lim.overloaded(1.5, started_at=-0.5)  # a straggler: no cut, but not quiet either
    lim.succeeded(2.0)
    assert lim.limit == 449  # the straggler: one less
    lim.succeeded(2.5)
    assert lim.limit == 474


def test_a_limit_the_turns_do_not_fill_does_not_grow():
    lim = ConcurrencyLimit(ceiling=1000, limit=500)
    lim.overloaded(0.0)
    assert lim.limit == 450
    # Claims lag (a starved loop): fewer than the limit less a step in flight.
    lim.tick(0.5, 400)
    lim.succeeded(1.0, in_flight=430)
    lim.succeeded(2.0, in_flight=420)
    assert lim.limit == 450
    # Filled again within a step: the next period grows.
    lim.tick(2.5, 445)
    lim.succeeded(3.0, in_flight=441)
    assert lim.limit == 475
    lim.succeeded(4.0, in_flight=470)
    assert lim.limit == 487


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
    assert lim.limit == 461
    assert lim.ramp_in(0.6) is None
    lim.tick(5.0, 461)
    lim.tick(6.0, 461)
    assert lim.limit == 461  # no more doubling: the increase after a cut from here on
    lim.succeeded(2.0)
    assert lim.limit == 486


def test_a_small_ceiling_starts_at_the_ceiling():
    lim = ConcurrencyLimit(ceiling=16)
    assert lim.limit == 16
    assert lim.ramp_in(0.0) is None


def test_a_shallow_cut_of_a_small_limit_still_cuts():
    lim = ConcurrencyLimit(ceiling=4, limit=4)
    lim.overloaded(0.0)
    assert lim.limit == 3  # 0.9 x 4 rounds back to 4


def test_the_limit_never_drops_below_the_floor():
    lim = ConcurrencyLimit(ceiling=8, floor=2)
    for t in range(10):
        lim.overloaded(float(t * 10))
    assert lim.limit == 2
    with pytest.raises(ValueError):
        ConcurrencyLimit(ceiling=0)
