"""A claim thread's lane: the turns it claimed and has not started yet, and
the finished ones whose batch has not been committed yet (pure bookkeeping)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .envelope import Envelope
from .stores.base import Claim
from .transports.base import Delivery
from .transports.flow import Finished

#: A claimed turn: its envelope, the claim (item and lease), and when the
#: claim was asked for (monotonic): a turn waiting in its lane is not renewed.
Step = tuple[Envelope, Claim, float]


@dataclass
class Lane:
    """One claim thread's turns: claimed and not started yet (each already
    running under its lease), and finished ones not committed yet."""

    claimed: deque[tuple[Delivery, Step]] = field(default_factory=deque)
    done: list[Finished] = field(default_factory=list)
    since: float = 0.0  # when the oldest finished turn finished (monotonic)
    #: Wall seconds from one turn's start to the next within a batch (the
    #: handler and whatever else the thread waits for, such as other threads;
    #: not the commit and claims between batches, which a bigger batch shares
    #: out): what sizes the next batch so that a claimed turn starts within
    #: the budget. Counting the commit in kept a slow machine at batches of one.
    pace: float | None = None
    mark: float = 0.0  # when the last turn started (0: the lane was idle)
    running: bool = False  # a turn of this lane is executing now
    #: The last claim found the queue empty: the next waits for news first.
    dry: bool = False

    def step(self, now: float, *, chained: bool) -> None:
        """A turn starts now; ``chained``: straight after the previous one."""
        if chained and self.mark:
            sample = now - self.mark
            self.pace = sample if self.pace is None else self.pace * 0.8 + sample * 0.2
        self.mark = now

    def committed(self, *, dry: bool) -> None:
        """The lane's finished turns were committed (and its next ones claimed);
        ``dry``: the claims found the queue empty. The next start is not a step
        within a batch: it does not count towards the pace."""
        self.mark = 0.0
        self.dry = dry and not self.claimed

    def stalled(self, now: float, after_s: float) -> bool:
        """Whether the running turn has held the claimed ones up for ``after_s``."""
        return self.running and bool(self.claimed) and now - self.mark > after_s

    def steal(self) -> tuple[Delivery, Step] | None:
        """The last claimed turn, for another claim thread (None: none left).
        The owner takes from the other end; each end's pop is atomic."""
        try:
            return self.claimed.pop()
        except IndexError:
            return None
