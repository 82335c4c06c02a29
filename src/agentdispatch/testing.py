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

:class:`MemoryBackend` is a store and a transport in process memory: the same
state machine and engine as the database backends, over dicts. A handler test
submits through a :class:`~agentdispatch.Dispatcher` and runs the ready turns
in the calling thread::

    backend = MemoryBackend()
    job = backend.dispatcher().submit(Submission(kind="echo", tenant="t", payload={"x": 1}))
    backend.run_until_idle(registry)
    assert backend.dispatcher().status(job.job_id, "t")["status"] == "succeeded"
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .backends.memory.db import MemoryDb
from .backends.memory.store import MemoryStore
from .backends.memory.transport import MemoryTransport
from .dispatch import Dispatcher
from .handlers import Registry
from .settings import Settings, load_settings
from .worker import Worker, WorkerOptions

__all__ = ["FakeClock", "MemoryBackend", "memory_dispatcher"]


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


class MemoryBackend:
    """A store and a transport sharing one in-memory database (nothing on
    disk, nothing survives the object). ``clock`` is its wall clock: lease
    expiry, backoff and delays read it, so a :class:`FakeClock` (started at a
    unix time, say ``FakeClock(time.time())``) moves them without sleeping."""

    def __init__(self, *, clock: Callable[[], float] = time.time, settings: Settings | None = None) -> None:
        self.db = MemoryDb(clock)
        self.store = MemoryStore(self.db)
        self.transport = MemoryTransport(self.db)
        self.settings = settings if settings is not None else load_settings()

    def dispatcher(self, **kw: Any) -> Dispatcher:
        """A :class:`Dispatcher` over this backend (``kw`` as Dispatcher takes)."""
        return Dispatcher(self.store, self.transport, self.settings, **kw)

    def worker(self, registry: Registry, *, threads: int = 1, **kw: Any) -> Worker:
        """A :class:`Worker` over this backend, to ``start()`` and ``stop()``."""
        options = WorkerOptions(threads=threads, **kw)
        return Worker(self.settings, self.store, self.transport, registry, options=options)

    def run_until_idle(self, registry: Registry, *, max_turns: int = 10_000) -> list[str]:
        """Run every turn that is ready now, in this thread, until none is
        left; returns the outcome label of each (``completed``, ``retry``,
        ...). Turns not ready yet (a delay, a backoff) wait for the clock."""
        worker = self.worker(registry, get_wait_s=0.0, reconcile=False)
        loop = asyncio.new_event_loop()
        labels: list[str] = []
        idle = 0
        try:
            # Two idle polls in a row: the first may only clear the mark of a
            # claim that rode with a commit and found nothing.
            while idle < 2:
                label = worker.poll("memory:0", 0, loop)
                idle = idle + 1 if label is None else 0
                if label is not None and label != "pending":
                    labels.append(label)
                if len(labels) > max_turns:
                    raise RuntimeError(f"more than {max_turns} turns: a handler keeps submitting?")
        finally:
            worker.renewer.close()
            loop.close()
        return labels


def memory_dispatcher(*, clock: Callable[[], float] = time.time) -> tuple[Dispatcher, MemoryBackend]:
    """A :class:`Dispatcher` over a fresh :class:`MemoryBackend`, and the backend
    (whose :meth:`MemoryBackend.run_until_idle` runs what was submitted)."""
    backend = MemoryBackend(clock=clock)
    return backend.dispatcher(), backend
