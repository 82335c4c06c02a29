"""Which errors a worker thread backs off from and tries again, and how long
it waits: a store error must never end a claim thread silently."""

from __future__ import annotations

import random
import sqlite3

from .errors import AgentDispatchError, TaskQueueUnavailable

# The tables are made before a process starts work: one missing later means the
# file was replaced or damaged under it, which no retry mends.
_SCHEMA_GONE = ("no such table", "no such column")


def unavailable(exc: BaseException) -> bool:
    """The store or transport failed (unreachable, disk full, locked, I/O):
    whatever the operation was, it may succeed later as it is."""
    if isinstance(exc, sqlite3.OperationalError) and str(exc).startswith(_SCHEMA_GONE):
        return False
    return isinstance(exc, (TaskQueueUnavailable, OSError, sqlite3.OperationalError))


def recoverable(exc: BaseException) -> bool:
    """An error a claim thread reports, backs off from and survives. Anything
    else (a bug, a corrupt database) ends the process with a non-zero status,
    so that its supervisor restarts it."""
    return unavailable(exc) or isinstance(exc, AgentDispatchError)


class Backoff:
    """Exponential back-off with jitter between failed attempts, reset by a
    success (``first_s`` doubling up to ``cap_s``)."""

    def __init__(self, first_s: float = 0.1, cap_s: float = 5.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0

    def failed(self) -> float:
        """Count a failure; the seconds to wait before the next attempt."""
        self.failures += 1
        delay: float = min(self.cap_s, self.first_s * 2.0 ** min(self.failures - 1, 32))
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> int:
        """A success: start over; returns the failures it ended."""
        failures, self.failures = self.failures, 0
        return failures
