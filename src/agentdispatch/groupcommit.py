"""Group commit: concurrent durable writes of one process share one
transaction and one fsync (leader/follower, each write in its own savepoint)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C")


class _Slot:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class GroupCommit(Generic[C]):
    """Run ``fn(tx)`` inside a shared transaction opened by ``open_tx``.

    The first caller becomes the leader and runs every pending write in one
    transaction; the others wait for that commit. A write that raises is rolled
    back to its savepoint and its exception re-raised to its own caller only.
    """

    def __init__(
        self,
        open_tx: Callable[[], AbstractContextManager[C]],
        savepoint: Callable[[C], Any],
        joined: Callable[[], bool] = lambda: False,
    ) -> None:
        self._open_tx = open_tx
        self._joined = joined
        self._savepoint = savepoint
        self._lock = threading.Lock()
        self._pending: list[_Slot] = []
        self._leading = False
        self.batches = 0
        self.writes = 0

    def run(self, fn: Callable[[C], T]) -> T:
        """Execute ``fn`` durably; returns once its transaction committed (or,
        inside an enclosing transaction of this thread, as part of it)."""
        if self._joined():
            with self._open_tx() as tx:
                return fn(tx)
        slot = _Slot(fn)
        with self._lock:
            self._pending.append(slot)
            lead = not self._leading
            self._leading = True
        if lead:
            self._lead()
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[no-any-return]

    def _lead(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._leading = False
                    return
            self._execute(batch)

    def _execute(self, batch: list[_Slot]) -> None:
        try:
            with self._open_tx() as tx:
                for slot in batch:
                    with self._savepoint(tx):
                        try:
                            slot.result = slot.fn(tx)
                        except BaseException as exc:  # re-raised to its own caller
                            slot.error = exc
                            raise _Rollback from None
            self.batches += 1
            self.writes += len(batch)
        except _Rollback:  # pragma: no cover - savepoints swallow it
            pass
        except BaseException as exc:  # the commit itself failed: every write failed
            for slot in batch:
                if slot.error is None:
                    slot.error = exc
        finally:
            for slot in batch:
                slot.done.set()


class _Rollback(Exception):
    """Raised inside a savepoint to undo one write."""


def savepoint_factory(execute: Callable[[Any, str], Any]) -> Callable[[Any], AbstractContextManager[None]]:
    """Savepoint context managers over a connection's ``execute``."""
    from contextlib import contextmanager

    @contextmanager
    def savepoint(tx: Any) -> Iterator[None]:
        execute(tx, "SAVEPOINT w")
        try:
            yield
        except _Rollback:
            execute(tx, "ROLLBACK TO w")
            execute(tx, "RELEASE w")
        else:
            execute(tx, "RELEASE w")

    return savepoint
