"""Group liveness: notice a consumer group that stopped consuming.

A broker that lost its group state can leave every member of the group with
an empty (stale) assignment while messages wait: librdkafka sees nothing
wrong, and the reconciler's re-publications only lengthen the log. The watch
reads the group's committed offsets (the lag probe): when a process holds no
partition, partitions have lag, and no committed offset has moved for
``stall_s``, its consumers leave and rejoin the group, which forces a fresh
assignment.
"""

from __future__ import annotations

#: Per partition: (committed offset, high watermark).
Positions = dict[int, tuple[int, int]]


class StallWatch:
    """Decides, from successive probes, when this process should rejoin."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._last: Positions | None = None
        self._since: float | None = None

    def observe(self, now: float, positions: Positions, holding: bool) -> bool:
        """One probe; True when the consumers should rejoin now. ``holding``:
        some consumer of this process has partitions (it sees its own work,
        and a rebalance it needs reaches it through librdkafka)."""
        lagging = any(high > done for done, high in positions.values())
        moved = self._last is None or any(
            self._last.get(p, (None, None))[0] != done for p, (done, _high) in positions.items()
        )
        self._last = positions
        if holding or not lagging or moved or self._since is None:
            self._since = now
            return False
        if now - self._since < self.stall_s:
            return False
        self._since = now  # give the new assignment a whole period to show progress
        return True


class Backlog:
    """The group's lag and consumption rate, from successive probes: how long
    a message published now waits before the group reaches it."""

    #: Never extend the redelivery wait beyond this (a stalled group is the
    #: watch's business; lost messages must still come back).
    MAX_WAIT_S = 300.0
    #: A probe older than this says nothing about now.
    STALE_S = 60.0

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None  # (when, sum of committed offsets)
        self._rate = 0.0  # messages/s, smoothed
        self._lag = 0
        self._at = 0.0

    def observe(self, now: float, positions: Positions) -> None:
        """One probe of the group's positions."""
        done = sum(d for d, _h in positions.values())
        self._lag = sum(max(0, h - d) for d, h in positions.values())
        if self._last is not None and now > self._last[0]:
            sample = max(0.0, (done - self._last[1]) / (now - self._last[0]))
            self._rate = sample if self._rate == 0 else 0.7 * self._rate + 0.3 * sample
        self._last, self._at = (now, done), now

    def wait_s(self, now: float) -> float:
        """Twice the time to consume the backlog at the recent rate (0 when
        unknown, stale or empty)."""
        if not self._lag or self._rate <= 0 or now - self._at > self.STALE_S:
            return 0.0  # a group that consumes nothing gets no extra wait
        return min(self.MAX_WAIT_S, 2 * self._lag / self._rate)
