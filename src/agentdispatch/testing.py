"""Helpers for testing code built on agentdispatch without sleeping.

:class:`FakeClock` stands in for the monotonic clock of a component that takes
``clock=``: time moves only when the test calls :meth:`FakeClock.advance`. A
component that waits through ``clock.wait_until`` (the lease renewer,
:class:`agentdispatch.lease.Renewer`) wakes then, not after real seconds pass;
one that only reads ``clock()`` sees the fake time but waits in real time::

    clock = FakeClock()
    renewer = Renewer(clock=clock)
    guard = LeaseGuard(store, lease, ttl_s=30, renew_interval_s=10, renewer=renewer).start()
    clock.advance(10)  # the renewer renews the lease now

:meth:`FakeClock.wait_for_sleeper` tells a test when a component has gone
back to sleep, so it never has to guess with a real sleep.
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["FakeClock"]


class FakeClock:
    """A monotonic clock that moves only when :meth:`advance` is called."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self._waiters: weakref.WeakSet[threading.Condition] = weakref.WeakSet()
        #: The time each waiting component waits for (by its condition).
        self._asleep: dict[threading.Condition, float] = {}
        self._changed = threading.Condition(self._lock)

    def __call__(self) -> float:
        """The current (fake) time."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every component waiting on this clock
        (each re-checks what is due at the new time)."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            waiters = list(self._waiters)
            self._asleep.clear()  # every sleeper is woken below
        for cv in waiters:
            with cv:
                cv.notify_all()

    def wait_until(self, cv: threading.Condition, at: float) -> None:
        """Wait on ``cv`` (held by the caller) until the clock reaches ``at``
        or ``cv`` is notified; real time plays no part."""
        with self._lock:
            # Registered in the same step as the check: an advance after it
            # notifies ``cv``, which it can only do once this thread waits.
            self._waiters.add(cv)
            if self._now >= at:
                return
            self._asleep[cv] = at
            self._changed.notify_all()
        try:
            cv.wait()
        finally:
            with self._lock:
                self._asleep.pop(cv, None)

    def wait_for_sleeper(self, at: float | None = None, *, timeout_s: float = 10.0) -> None:
        """Block until a component waits on this clock (for the time ``at``,
        when given): then it has done everything due before, and a test can
        act knowing where it stands. ``timeout_s`` (real seconds) only bounds
        a test that went wrong."""
        with self._lock:
            if not self._changed.wait_for(lambda: any(at is None or t == at for t in self._asleep.values()), timeout_s):
                raise TimeoutError(f"no component waits on the clock for {at} (waiting: {list(self._asleep.values())})")
