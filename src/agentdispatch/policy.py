"""Pure policy math: backoff, lease timing, opaque references, backpressure."""

from __future__ import annotations

import functools
import hmac
import random
import threading
from collections import deque
from dataclasses import dataclass, field

#: The recovery-time objective: no lease may outlive this many seconds.
LEASE_RTO_S = 300.0


def backoff_delay(
    attempt: int,
    *,
    base_s: float = 1.0,
    cap_s: float = 300.0,
    rng: random.Random | None = None,
) -> float:
    """Exponential backoff with full jitter for retry ``attempt`` (1-based)."""
    ceiling = min(cap_s, base_s * float(2 ** max(0, attempt - 1)))
    pick: float = (rng or random).random()
    # Half fixed, half jittered: never zero, never above the ceiling.
    return ceiling / 2 + pick * ceiling / 2


def renew_every(ttl_s: float, interval_s: float) -> float:
    """How often the lease guard renews: min(interval, TTL/3)."""
    return min(interval_s, ttl_s / 3)


def sweep_every(ttl_s: float) -> float:
    """How often the reconciler runs so recovery stays within one TTL."""
    return max(0.2, min(5.0, ttl_s / 4))


def batch_size(mean_turn_s: float | None, *, budget_s: float, cap: int) -> int:
    """How many turns a claim thread takes per commit: as many as run within
    ``budget_s`` at the recent mean handler time, 1..``cap`` (1 while the mean
    is unknown, so a slow handler never holds claimed turns back)."""
    if mean_turn_s is None or budget_s <= 0 or cap <= 1:
        return 1
    return max(1, min(cap, int(budget_s / max(mean_turn_s, 1e-6))))


@functools.lru_cache(maxsize=65_536)
def opaque_ref(key: bytes, *parts: str) -> str:
    """A keyed hash of ``parts``: a scheduling reference that hides names."""
    msg = "\x1f".join(parts).encode()
    return hmac.digest(key, msg, "sha256").hex()[:24]  # the one-shot C digest


@dataclass
class Backpressure:
    """Slows claiming when recent handler failures or latency cross a budget.

    Pure apart from its window: feed ``record`` with each turn's result and ask
    ``claim_delay`` before each claim. Shared by a worker's claim threads, so
    the window and its running sums change under one lock.
    """

    window: int = 50
    max_failure_rate: float = 0.5
    latency_budget_s: float = 30.0
    max_delay_s: float = 2.0
    _recent: deque[tuple[bool, float]] = field(default_factory=deque)
    _failures: int = 0
    _latency: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, ok: bool, latency_s: float) -> None:
        """Remember one turn's outcome and duration."""
        with self._lock:
            self._recent.append((ok, latency_s))
            self._failures += not ok
            self._latency += latency_s
            while len(self._recent) > self.window:
                old_ok, old_latency = self._recent.popleft()
                self._failures -= not old_ok
                self._latency -= old_latency

    def mean_latency(self) -> float | None:
        """Mean handler time over the window (None before 10 turns)."""
        with self._lock:
            n = len(self._recent)
            return None if n < 10 else max(0.0, self._latency) / n

    def claim_delay(self) -> float:
        """Seconds to wait before the next claim (0 when healthy)."""
        with self._lock:
            n = len(self._recent)
            if n < 10:
                return 0.0
            failure_rate = self._failures / n
            mean_latency = max(0.0, self._latency) / n
        over = max(
            failure_rate / self.max_failure_rate,
            mean_latency / self.latency_budget_s,
        )
        if over <= 1.0:
            return 0.0
        return min(self.max_delay_s, (over - 1.0) * self.max_delay_s)


@dataclass
class ConcurrencyLimit:
    """How many turns a worker runs at once, under backpressure from a model
    gateway (AIMD, as TCP does). Pure: every method takes ``now`` (monotonic
    seconds).

    * **Slow start.** The limit starts at ``initial`` and grows by
      ``ramp_factor`` ``ramp_every_s`` after the turns in flight first filled
      it, if no overload came (see :meth:`tick`; long enough for
      the turns just started to reach the gateway and be refused), up to
      ``ceiling``, until the first overload: a worker whose gateway takes
      fewer calls than its ceiling overshoots by one step (at most half the
      gateway's capacity), not by the whole ceiling at once. Not every turn in
      flight is calling the gateway at a given moment, so a step can pass the
      gateway's capacity unnoticed: a gentler factor than TCP's doubling keeps
      that overshoot small.
    * **Multiplicative decrease**, once per burst: a handler's overload cuts
      the limit to ``decrease`` of the turns in flight when the gateway
      refused (the limit may have run ahead of them: that count is what the
      gateway could not take), and claims wait out the gateway's retry-after.
      A refusal of a turn that started before the last cut belongs to the
      burst that caused it and cuts nothing more (TCP cuts once per window),
      but lowers the cut's base by one; without the turn's start,
      ``cooldown_s`` separates bursts. The cut is
      shallow: a refusal costs one quick failed call and the turn is retried,
      while every slot a deep cut leaves empty costs a whole turn of goodput.
    * **Increase**, once per ``increase_every_s`` in which turns succeeded and
      none was refused: half the way back to where the gateway last refused
      (the best estimate of its capacity, so it is regained in a few periods,
      as BIC and CUBIC do), and past it ``step`` at a time (default 2% of the
      limit in force, at least 1): each time the limit crosses the gateway's
      capacity again about one step of calls is refused. Only while the turns
      in flight come within a step of the limit: one they do not fill says
      nothing of the gateway."""

    ceiling: int
    floor: int = 1
    decrease: float = 0.9
    cooldown_s: float = 1.0
    increase_every_s: float = 1.0
    step: int = 0  # 0: two percent of the limit in force, at least 1
    limit: int = 0  # 0: slow start from ``initial``
    initial: int = 256
    ramp_every_s: float = 0.5
    ramp_factor: float = 1.5
    _hold_until: float = 0.0
    _quiet_since: float | None = None  # None: no turn ended yet
    _cool_until: float = 0.0
    _cut_at: float = float("-inf")
    #: The turns in flight the last cut started from, less its burst's later
    #: refusals (0: no cut yet).
    _refused_at: int = 0
    #: The most turns in flight seen since the limit last rose (None: unknown).
    _peak: int | None = None
    _full_since: float | None = None
    _ramping: bool = True
    _succeeded: bool = False

    def __post_init__(self) -> None:
        if self.ceiling < 1:
            raise ValueError("the concurrency ceiling must be at least 1")
        self.floor = max(1, min(self.floor, self.ceiling))
        if self.limit:
            self._ramping = False
        else:
            self.limit = max(self.floor, min(self.ceiling, self.initial))
        self._ramping = self._ramping and self.limit < self.ceiling

    def tick(self, now: float, in_flight: int) -> None:
        """Slow start: raise the limit by ``ramp_factor`` ``ramp_every_s``
        after ``in_flight`` first reached it (a limit that claims have not
        filled yet has not been tried against the gateway)."""
        self._peak = in_flight if self._peak is None else max(self._peak, in_flight)
        if not self._ramping:
            return
        if self._full_since is None:
            # Dips below the limit later do not restart the wait: turns end
            # and are replaced all the time, and the gateway saw the limit.
            if in_flight >= self.limit:
                self._full_since = now
        elif now - self._full_since >= self.ramp_every_s:
            self.limit = min(self.ceiling, max(self.limit + 1, round(self.limit * self.ramp_factor)))
            self._full_since = None
            self._ramping = self.limit < self.ceiling

    def ramp_in(self, now: float) -> float | None:
        """Seconds to the next step while the limit stays full (None: the
        slow start is over)."""
        if not self._ramping:
            return None
        return self.ramp_every_s if self._full_since is None else max(0.0, self._full_since + self.ramp_every_s - now)

    def overloaded(
        self, now: float, retry_after_s: float = 0.0, started_at: float | None = None, in_flight: int | None = None
    ) -> None:
        """A handler reported overload: cut the limit (once per burst), hold claims.
        ``started_at``: when the refused turn started (the worker's clock);
        ``in_flight``: the turns running when it was refused, itself included."""
        new_burst = now >= self._cool_until if started_at is None else started_at >= self._cut_at
        if new_burst:
            self._refused_at = self.limit if in_flight is None else max(1, min(self.limit, in_flight))
            # At least one less: a shallow cut of a small limit must still cut.
            cut = min(self._refused_at - 1, round(self._refused_at * self.decrease))
            self.limit = max(self.floor, cut)
            self._cut_at = now
            self._cool_until = now + max(self.cooldown_s, retry_after_s)
        elif self._refused_at > 1:
            # Another refusal of the burst: one more turn was in flight than the
            # gateway took, so the cut is not repeated but its base is one less
            # (a slow-start step that overshot by hundreds lands near the
            # capacity at once, not after a cascade of cuts and refused claims).
            self._refused_at -= 1
            self.limit = max(self.floor, min(self.limit, round(self._refused_at * self.decrease)))
        self._ramping = False
        self._hold_until = max(self._hold_until, now + retry_after_s)
        self._quiet_since = now
        self._succeeded = False

    def succeeded(self, now: float, in_flight: int | None = None) -> None:
        """A turn finished without overload: raise the limit once per period,
        if the turns in flight (``in_flight``, this one included) came near it."""
        if in_flight is not None:
            self._peak = in_flight if self._peak is None else max(self._peak, in_flight)
        if self._quiet_since is None:
            self._quiet_since = now
        self._succeeded = True
        if self._ramping:
            return
        if self.limit < self.ceiling and now >= self._cool_until and now - self._quiet_since >= self.increase_every_s:
            probe = self.step or max(1, self.limit // 50)
            # A limit the turns did not fill (claims lagged, the loop was
            # starved) was not tried against the gateway: raising it would only
            # let the next burst of claims overshoot (as RFC 7661 keeps TCP's
            # window from growing while the sender is application-limited).
            if self._peak is not None and self._peak < self.limit - probe:
                self._peak = None
                self._quiet_since = now
                return
            self.limit = min(self.ceiling, self.limit + max(probe, (self._refused_at - self.limit) // 2))
            self._peak = None
            self._quiet_since = now
            self._succeeded = False

    def claim_delay(self, now: float) -> float:
        """Seconds before the next claim (0: claim now)."""
        return max(0.0, self._hold_until - now)
