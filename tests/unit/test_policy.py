"""Pure policy math: backoff, lease timing, opaque references, backpressure, batch pacing."""

from __future__ import annotations

import random

import pytest

from agentdispatch.lanes import Lane
from agentdispatch.policy import (
    LEASE_RTO_S,
    Backpressure,
    backoff_delay,
    batch_size,
    opaque_ref,
    renew_every,
    sweep_every,
)


@pytest.mark.parametrize("attempt", range(1, 15))
def test_backoff_stays_within_half_and_full_ceiling(attempt: int) -> None:
    rng = random.Random(attempt)
    ceiling = min(300.0, 2.0 ** (attempt - 1))
    for _ in range(200):
        d = backoff_delay(attempt, rng=rng)
        assert ceiling / 2 <= d <= ceiling


def test_backoff_grows_exponentially_until_the_cap() -> None:
    class Fixed(random.Random):
        def random(self) -> float:
            return 1.0  # the top of the jitter range: the ceiling itself

    rng = Fixed()
    assert [backoff_delay(a, base_s=0.5, cap_s=10.0, rng=rng) for a in range(1, 8)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        8.0,
        10.0,
        10.0,
    ]


def test_backoff_is_never_zero_and_attempt_zero_is_the_base() -> None:
    class Zero(random.Random):
        def random(self) -> float:
            return 0.0

    assert backoff_delay(0, base_s=2.0, rng=Zero()) == 1.0
    assert backoff_delay(1, base_s=2.0, rng=Zero()) == 1.0
    assert backoff_delay(100, cap_s=60.0, rng=Zero()) == 30.0  # huge attempt: capped, no overflow


def test_backoff_is_reproducible_with_a_seeded_rng_and_jittered() -> None:
    a = [backoff_delay(5, rng=random.Random(42)) for _ in range(3)]
    b = [backoff_delay(5, rng=random.Random(42)) for _ in range(3)]
    assert a == b
    rng = random.Random(7)
    spread = {round(backoff_delay(5, rng=rng), 6) for _ in range(50)}
    assert len(spread) > 40  # jitter spreads retries out


@pytest.mark.parametrize(
    ("ttl", "interval", "expected"),
    [(120, 30, 30), (60, 30, 20), (9, 5, 3), (300, 299, 100), (3, 1, 1)],
)
def test_renew_every_is_min_of_interval_and_a_third_of_ttl(ttl: float, interval: float, expected: float) -> None:
    assert renew_every(ttl, interval) == pytest.approx(expected)
    assert renew_every(ttl, interval) < ttl


@pytest.mark.parametrize(("ttl", "expected"), [(120, 5.0), (300, 5.0), (8, 2.0), (1, 0.25), (0.4, 0.2)])
def test_sweep_every_keeps_recovery_within_one_ttl(ttl: float, expected: float) -> None:
    assert sweep_every(ttl) == pytest.approx(expected)
    assert 0.2 <= sweep_every(ttl) <= 5.0


def test_lease_rto_is_300_seconds() -> None:
    assert LEASE_RTO_S == 300.0


def test_opaque_ref_is_keyed_stable_and_hides_its_input() -> None:
    key = b"k" * 32
    ref = opaque_ref(key, "tenant", "acme-corp")
    assert ref == opaque_ref(key, "tenant", "acme-corp")
    assert len(ref) == 24 and all(c in "0123456789abcdef" for c in ref)
    assert "acme" not in ref
    assert ref != opaque_ref(b"j" * 32, "tenant", "acme-corp")  # keyed
    assert ref != opaque_ref(key, "tenant", "acme-corp2")
    assert ref != opaque_ref(key, "session", "acme-corp")
    # parts are separated, not concatenated
    assert opaque_ref(key, "ab", "c") != opaque_ref(key, "a", "bc")


def test_backpressure_is_silent_until_ten_samples() -> None:
    bp = Backpressure()
    for _ in range(9):
        bp.record(False, 100.0)
    assert bp.claim_delay() == 0.0
    bp.record(False, 100.0)
    assert bp.claim_delay() == bp.max_delay_s


def test_backpressure_healthy_fleet_has_no_delay() -> None:
    bp = Backpressure()
    for i in range(50):
        bp.record(i % 4 != 0, 1.0)  # 25 % failures, under the 50 % budget
    assert bp.claim_delay() == 0.0


def test_backpressure_grows_with_failure_rate_and_is_capped() -> None:
    def delay(failures: int) -> float:
        bp = Backpressure(window=20, max_failure_rate=0.5, max_delay_s=2.0)
        for i in range(20):
            bp.record(i >= failures, 0.1)
        return bp.claim_delay()

    assert delay(10) == 0.0  # exactly at budget
    assert delay(12) == pytest.approx(0.4)  # 60 % / 50 % = 1.2 -> 0.2 * 2 s
    assert delay(15) == pytest.approx(1.0)
    assert delay(20) == pytest.approx(2.0)
    assert delay(12) < delay(15) < delay(20)


def test_backpressure_reacts_to_latency() -> None:
    bp = Backpressure(latency_budget_s=1.0, max_delay_s=4.0)
    for _ in range(10):
        bp.record(True, 1.5)
    assert bp.claim_delay() == pytest.approx(2.0)


def test_backpressure_window_forgets_old_results() -> None:
    bp = Backpressure(window=10)
    for _ in range(10):
        bp.record(False, 0.0)
    assert bp.claim_delay() > 0
    for _ in range(10):
        bp.record(True, 0.0)
    assert bp.claim_delay() == 0.0
    assert len(bp._recent) == 10


def test_backpressure_is_safe_across_claim_threads():
    # A worker's claim threads record and ask at once; iterating the window
    # while another thread appended used to kill a claim thread.
    import threading

    bp = Backpressure(window=5)
    errors: list[BaseException] = []

    def churn(ok: bool) -> None:
        try:
            for _ in range(20_000):
                bp.record(ok, 0.001)
                bp.claim_delay()
        except BaseException as exc:  # pragma: no cover - the failure being tested
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    bp_fail = Backpressure(window=10)
    for _ in range(25):
        bp_fail.record(False, 0.0)
    assert bp_fail.claim_delay() == bp_fail.max_delay_s  # sums stay exact after evictions


def test_batch_size_fills_the_budget_within_bounds() -> None:
    assert batch_size(None, budget_s=0.01, cap=16) == 1  # unknown: one at a time
    assert batch_size(0.0001, budget_s=0.01, cap=16) == 16  # fast: capped
    assert batch_size(0.002, budget_s=0.01, cap=16) == 5  # 5 x 2 ms fit 10 ms
    assert batch_size(0.5, budget_s=0.01, cap=16) == 1  # slow: never held back
    assert batch_size(0.0, budget_s=0.01, cap=16) == 16
    assert batch_size(0.0001, budget_s=0.0, cap=16) == 1  # batching off
    assert batch_size(0.0001, budget_s=0.01, cap=1) == 1


def test_backpressure_mean_latency_needs_a_window() -> None:
    bp = Backpressure(window=20)
    for _ in range(9):
        bp.record(True, 0.004)
    assert bp.mean_latency() is None
    bp.record(True, 0.004)
    assert bp.mean_latency() == pytest.approx(0.004)
    for _ in range(20):
        bp.record(True, 0.002)  # the window forgets the older turns
    assert bp.mean_latency() == pytest.approx(0.002)


def test_lane_pace_counts_steps_within_a_batch_not_the_commit_between() -> None:
    """A slow commit between batches must not size the next batch: counted in,
    it kept a machine whose commit takes about the budget at batches of one."""
    lane = Lane()
    lane.step(10.000, chained=False)
    lane.step(10.002, chained=True)
    assert lane.pace == pytest.approx(0.002)
    lane.committed(dry=False)
    lane.step(10.040, chained=True)  # 38 ms later: the commit and claims
    assert lane.pace == pytest.approx(0.002)
    lane.step(10.042, chained=True)
    assert lane.pace == pytest.approx(0.002)
    assert batch_size(lane.pace, budget_s=0.025, cap=32) == 12


def test_lane_waits_for_news_only_when_its_claims_ran_dry_and_nothing_is_claimed() -> None:
    lane = Lane()
    lane.committed(dry=True)
    assert lane.dry
    lane.claimed.append(object())  # type: ignore[arg-type]
    lane.committed(dry=True)
    assert not lane.dry
