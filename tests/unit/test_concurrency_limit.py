"""The AIMD concurrency limit under overload, with a fake clock."""

from __future__ import annotations

import pytest

from agentdispatch.policy import ConcurrencyLimit


def test_overload_halves_once_per_burst_and_holds_claims_for_retry_after():
    lim = ConcurrencyLimit(ceiling=1000)
    assert (lim.limit, lim.claim_delay(0.0)) == (1000, 0.0)
    lim.overloaded(10.0, retry_after_s=2.0)
    assert lim.limit == 500
    assert lim.claim_delay(10.5) == pytest.approx(1.5)
    lim.overloaded(10.1, retry_after_s=0.5)  # the same burst: counted once
    assert lim.limit == 500
    assert lim.claim_delay(12.0) == 0.0
    lim.overloaded(12.5)  # after the cool-down: halved again
    assert lim.limit == 250


def test_successes_raise_the_limit_additively_up_to_the_ceiling():
    lim = ConcurrencyLimit(ceiling=200, step=10)
    lim.overloaded(0.0)
    assert lim.limit == 100
    lim.succeeded(0.5)  # still cooling down
    assert lim.limit == 100
    now = 1.0
    for _ in range(30):
        now += 1.0
        lim.succeeded(now)
    assert lim.limit == 200  # +10 a period, capped


def test_the_limit_never_drops_below_the_floor():
    lim = ConcurrencyLimit(ceiling=8, floor=2)
    for t in range(10):
        lim.overloaded(float(t * 10))
    assert lim.limit == 2
    with pytest.raises(ValueError):
        ConcurrencyLimit(ceiling=0)
