"""Group liveness (a consumer group that stopped consuming) and what the
reconciler may take as lost (:class:`Drained`, :class:`Backlog`).

A broker that lost its group state can leave every member of the group with
an empty (stale) assignment while messages wait: librdkafka sees nothing
wrong, and the reconciler's re-publications only lengthen the log. The watch
reads the group's committed offsets (the lag probe): when a process holds no
partition, partitions have lag, and no committed offset has moved for
``stall_s``, its consumers leave and rejoin the group, which forces a fresh
assignment.
"""

from __future__ import annotations

from collections import deque

#: Per partition: (committed offset, high watermark).
Positions = dict[int, tuple[int, int]]


def with_ends(positions: Positions, ends: dict[int, int]) -> Positions:
    """The probe with each partition's end raised to what a consumer's fetch
    saw. A committed offset beyond the end the broker gave means its answer
    left records out (Tansu's ListOffsets omits the last record batch): the
    end is unknown, taken as one past the commit, so the group is never read
    as caught up on that partition from such an answer."""
    out: Positions = {}
    for p, (done, high) in positions.items():
        high = max(high, ends.get(p, high))
        out[p] = (done, high if done <= high else done + 1)
    return out


class StallWatch:
    """Decides, from successive probes, when this process should rejoin."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._last: Positions | None = None
        self._since: float | None = None
        # The last probe before the stall began: unlike ``_since``, a rejoin
        # does not move it (a group that stays stalled across rejoins).
        self._stalled_after: float | None = None

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
            self._stalled_after = None
            return False
        if self._stalled_after is None:
            self._stalled_after = self._since
        if now - self._since < self.stall_s:
            return False
        self._since = now  # give the new assignment a whole period to show progress
        return True

    def stalled_for(self, now: float) -> float:
        """How long this process has held no partition while the group's
        backlog did not move (0 when it is not stalled)."""
        after = self._stalled_after
        return 0.0 if after is None else max(0.0, now - after)


class Backlog:
    """The group's lag and consumption rate per partition, from successive
    probes: how long a message published now waits before the group reaches
    it (on the slowest partition: a message's key picks its partition, and a
    copy lands behind the original)."""

    #: Never extend the redelivery wait beyond this (a stalled group is the
    #: watch's business; lost messages must still come back).
    MAX_WAIT_S = 300.0
    #: A probe older than this says nothing about now.
    STALE_S = 60.0

    def __init__(self, still_s: float = 3.0) -> None:
        self.still_s = still_s
        self._last: tuple[float, Positions] | None = None
        self._rates: dict[int, float] = {}  # messages/s per partition, smoothed
        self._lags: dict[int, int] = {}
        # Per partition: when its commit last moved, or it last had no lag.
        self._moved: dict[int, float] = {}
        self._at = 0.0

    def observe(self, now: float, positions: Positions) -> None:
        """One probe of the group's positions."""
        self._lags = {p: max(0, h - d) for p, (d, h) in positions.items()}
        before = self._last[1] if self._last is not None else {}
        then = self._last[0] if self._last is not None else now
        for p, (done, high) in positions.items():
            prev = before.get(p)
            if prev is None or done < prev[0] or done > prev[0] or high <= done:
                # First seen, offsets went back (a broker that lost its log:
                # the group gets a rejoin's time), moved, or nothing to do.
                self._moved[p] = now
            if prev is None or done < prev[0] or now <= then or prev[1] <= prev[0]:
                # No rate from a restart's reset (keep the last one: the group
                # consumes as fast as before once it has rejoined), nor from
                # an idle partition (it says nothing of the pace).
                continue
            sample = (done - prev[0]) / (now - then)
            rate = self._rates.get(p, 0.0)
            self._rates[p] = sample if rate == 0 else 0.7 * rate + 0.3 * sample
        self._last, self._at = (now, positions), now

    def _still(self, p: int) -> bool:
        # Judged at the last probe: a gap between probes is no stall.
        return self._at - self._moved.get(p, self._at) >= self.still_s

    def wait_s(self, now: float) -> float:
        """Twice the time to consume the backlog at the recent rate, on the
        slowest partition the group is consuming (0 when unknown, stale or
        empty; a partition not consumed is :meth:`stalled`'s)."""
        if now - self._at > self.STALE_S:
            return 0.0
        worst = 0.0
        for p, lag in self._lags.items():
            rate = self._rates.get(p, 0.0)
            if lag and rate > 0 and not self._still(p):
                worst = max(worst, lag / rate)
        return min(self.MAX_WAIT_S, 2 * worst)

    def stalled(self, now: float) -> bool:
        """A partition has a backlog the group has not consumed from for
        ``still_s`` (a group still joining or rejoining, wedged, or a turn
        longer than that holding its commit back)."""
        if now - self._at > self.STALE_S:
            return False
        return any(lag and (self._rates.get(p, 0.0) <= 0 or self._still(p)) for p, lag in self._lags.items())


class Drained:
    """Up to when every message is consumed or gone, from successive probes:
    the newest probe whose log ends the group's committed offsets have since
    reached on every partition, or the last probe of a log the broker has
    since lost (its offsets went back: a restart without persistent storage).
    A ready item published before that has no message left to reach it: it
    must go out again. One published after it may still wait in the log, and
    a copy would only land behind it (same key, same partition)."""

    #: Probes kept while the group is behind (older ones are superseded by
    #: any newer one that it reaches).
    KEEP = 512

    def __init__(self) -> None:
        self._probes: deque[tuple[float, dict[int, int]]] = deque(maxlen=self.KEEP)
        self._cutoff: float | None = None
        self._last: tuple[float, dict[int, int], dict[int, int]] | None = None
        self.probed = False
        #: The last probe of the latest log the broker lost, if any.
        self.lost_at: float | None = None

    def observe(self, started: float, positions: Positions, reported: Positions | None = None) -> bool:
        """One probe whose watermarks cover every message confirmed before
        ``started`` (they were read after it). ``reported``: the broker's own
        answer, when ``positions`` raised its ends (:func:`with_ends`); a
        loss is read from it (a consumer's last fetch may be of the old log).
        True when this probe is the first of a new log (the broker lost the
        one the previous probe saw)."""
        self.probed = True
        lost = False
        highs = {p: high for p, (_done, high) in positions.items()}
        done = {p: d for p, (d, _high) in positions.items()}
        said = {p: high for p, (_done, high) in (positions if reported is None else reported).items()}
        if self._last is not None:
            last_at, last_said, last_done = self._last
            if any(said.get(p, 0) < h for p, h in last_said.items()) or any(
                done.get(p, 0) < d for p, d in last_done.items()
            ):
                # Offsets went back: the broker lost its log (a restart of a
                # broker without persistent storage). What the last probe of
                # the old log covered is consumed or gone, whether or not the
                # group ever reaches the new log's watermarks (a long turn
                # holds a partition's commit back for as long as it runs).
                self._cutoff = last_at if self._cutoff is None else max(self._cutoff, last_at)
                self.lost_at = last_at
                lost = True
        self._last = (started, said, done)
        self._probes.append((started, highs))
        for i in range(len(self._probes) - 1, -1, -1):
            at, highs = self._probes[i]
            if self._reached(highs, done):
                self._cutoff = at if self._cutoff is None else max(self._cutoff, at)
                for _ in range(i):  # superseded by the newer one reached
                    self._probes.popleft()
                break
        return lost

    def gone(self) -> bool:
        """The topic is gone (a broker that lost its log, topic and all):
        what the last probe covered is consumed or gone, as when offsets go
        back, but known now rather than at the next probe, of the new
        topic. True when a probe had seen the old one."""
        if self._last is None:
            return False
        last_at = self._last[0]
        self._cutoff = last_at if self._cutoff is None else max(self._cutoff, last_at)
        self.lost_at = last_at
        # The old log's ends mean nothing for the new one.
        self._last = None
        self._probes.clear()
        return True

    @staticmethod
    def _reached(highs: dict[int, int], done: dict[int, int]) -> bool:
        return all(done.get(p, 0) >= h for p, h in highs.items())

    def cutoff(self) -> float | None:
        """The newest probe start the group has consumed past, or None."""
        return self._cutoff
