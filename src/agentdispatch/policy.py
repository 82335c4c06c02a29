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
    gateway: halved when a handler reports overload (at most once per
    ``cooldown_s``, so one burst of refusals counts once), raised by ``step``
    per ``increase_every_s`` in which turns succeeded and none was refused,
    up to ``ceiling`` (AIMD, as TCP does). Claims wait out the gateway's
    retry-after. Pure: every method takes ``now`` (monotonic seconds)."""

    ceiling: int
    floor: int = 1
    decrease: float = 0.5
    cooldown_s: float = 1.0
    increase_every_s: float = 1.0
    step: int = 0  # 0: one percent of the ceiling, at least 1
    limit: int = 0  # 0: start at the ceiling
    _hold_until: float = 0.0
    _quiet_since: float = 0.0
    _cool_until: float = 0.0
    _succeeded: bool = False

    def __post_init__(self) -> None:
        if self.ceiling < 1:
            raise ValueError("the concurrency ceiling must be at least 1")
        self.floor = max(1, min(self.floor, self.ceiling))
        self.step = self.step or max(1, self.ceiling // 100)
        self.limit = self.limit or self.ceiling

    def overloaded(self, now: float, retry_after_s: float = 0.0) -> None:
        """A handler reported overload: cut the limit, hold claims."""
        if now >= self._cool_until:
            self.limit = max(self.floor, int(self.limit * self.decrease))
            self._cool_until = now + max(self.cooldown_s, retry_after_s)
        self._hold_until = max(self._hold_until, now + retry_after_s)
        self._quiet_since = now
        self._succeeded = False

    def succeeded(self, now: float) -> None:
        """A turn finished without overload: raise the limit once per period."""
        if not self._quiet_since:
            self._quiet_since = now
        self._succeeded = True
        if self.limit < self.ceiling and now >= self._cool_until and now - self._quiet_since >= self.increase_every_s:
            self.limit = min(self.ceiling, self.limit + self.step)
            self._quiet_since = now
            self._succeeded = False

    def claim_delay(self, now: float) -> float:
        """Seconds before the next claim (0: claim now)."""
        return max(0.0, self._hold_until - now)
