"""A check of a server that the caller can stop waiting for: a thread blocked
on a server that is down cannot be interrupted, so the check runs on a daemon
thread of its own and the caller waits on its future for as long as it has.
A check still running from an earlier call is waited on again, not started
twice, so checks repeated during an outage add no threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class Probe(Generic[T]):
    """One named check (``/readyz``'s pings, a scrape's queue depth)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._running: Future[T] | None = None
        self._lock = threading.Lock()

    def start(self, fn: Callable[[], T]) -> Future[T]:
        """The future of ``fn()``, or of the call still running."""
        with self._lock:
            fut = self._running
            if fut is None or fut.done():
                fut = self._running = Future()
                threading.Thread(target=_settle, args=(fut, fn), name=f"probe-{self.name}", daemon=True).start()
            return fut


def _settle(fut: Future[T], fn: Callable[[], T]) -> None:
    try:
        result = fn()
    except BaseException as exc:  # the caller decides what it means
        fut.set_exception(exc)
    else:
        fut.set_result(result)
