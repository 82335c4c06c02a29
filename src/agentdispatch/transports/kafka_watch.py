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
