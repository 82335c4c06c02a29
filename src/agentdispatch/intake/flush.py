"""One WAL flush shared by the concurrent intakes of a process (PostgreSQL).

An intake commits asynchronously (``dispatch_intake_admit``) and answers
only after :meth:`GroupFlush.wait` returns: once a flush that *began after*
its commit has finished, its commit record is on disk (WAL is flushed in
order). One flush runs at a time; every caller that arrives while it runs
waits for the next one, which then covers all of them with one fsync.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

_FLUSHERS: weakref.WeakKeyDictionary[object, GroupFlush] = weakref.WeakKeyDictionary()
_FLUSHERS_LOCK = threading.Lock()


class GroupFlush:
    """Leader/follower flushing: ``flush`` makes every earlier commit durable."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._cond = threading.Condition()
        self._started = 0  # generations of flushes begun
        self._done = 0  # the newest generation finished (in order: one runs at a time)
        self._running = False
        self._failed: dict[int, BaseException] = {}

    def wait(self) -> None:
        """Return once a flush begun after this call has finished; raise its error."""
        with self._cond:
            mine = self._started + 1
            while self._done < mine:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._started += 1
                gen = self._started
                self._cond.release()
                error: BaseException | None = None
                try:
                    self._flush()
                except BaseException as exc:  # every waiter of this generation sees it
                    error = exc
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._done = gen
                    if error is not None:
                        self._failed[gen] = error
                    for old in [g for g in self._failed if g < gen - 1000]:
                        del self._failed[old]
                    self._cond.notify_all()
            error = self._failed.get(mine)
        if error is not None:
            raise error


def group_flush(owner: object, flush: Callable[[], None]) -> GroupFlush:
    """The :class:`GroupFlush` of ``owner`` (a connection pool), made once."""
    with _FLUSHERS_LOCK:
        flusher = _FLUSHERS.get(owner)
        if flusher is None:
            flusher = _FLUSHERS[owner] = GroupFlush(flush)
        return flusher
