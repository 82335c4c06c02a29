"""Time as a parameter: the monotonic clock that schedulers read and wait on.

A component that wakes at given times takes ``clock=`` and calls
``clock.wait_until(cv, at)`` where it would sleep, so a test can pass
:class:`agentdispatch.testing.FakeClock` and move time by hand instead of
sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale, and a wait for a time on that scale."""

    def __call__(self) -> float:
        """The current time."""
        ...

    def wait_until(self, cv: threading.Condition, at: float) -> None:
        """Wait on ``cv`` (held by the caller) until ``at``, a notify or a
        spurious wake-up; callers re-check their state in a loop."""
        ...


class MonotonicClock:
    """The process's monotonic clock (``time.monotonic``)."""

    def __call__(self) -> float:
        return time.monotonic()

    def wait_until(self, cv: threading.Condition, at: float) -> None:
        cv.wait(max(0.0, at - time.monotonic()))
