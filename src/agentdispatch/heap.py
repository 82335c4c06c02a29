"""The cyclic garbage collector while a worker or a gateway serves.

Python's collector walks every tracked object a full collection reaches, with
the GIL held: the startup heap (modules, classes, models, routes) on every full
collection, and, at the default young threshold of 700, every object of a turn
in flight several times over before it dies (a turn that waits seconds on a
model outlives many young collections). A serving process therefore freezes
what startup built (it is never garbage) and collects the young generation
less often. Both are undone when the last server of the process stops, so an
embedding process gets its collector back as it was.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: Young-generation threshold while serving (the default is 700): allocations
#: net of deallocations between young collections.
YOUNG_THRESHOLD = 50_000

_lock = threading.Lock()
_serving = 0
_saved: tuple[int, int, int] | None = None


def _enter() -> None:
    global _serving, _saved
    with _lock:
        _serving += 1
        if _serving > 1:
            return
        young, middle, old = gc.get_threshold()
        _saved = (young, middle, old)
        # Garbage first: a frozen object is never collected.
        gc.collect()
        gc.freeze()
        if gc.isenabled() and 0 < young < YOUNG_THRESHOLD:
            gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def _exit() -> None:
    global _serving, _saved
    with _lock:
        _serving -= 1
        if _serving > 0:
            return
        gc.unfreeze()
        if _saved is not None:
            gc.set_threshold(*_saved)
            _saved = None


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """While the block runs: the heap built so far frozen, young collections
    rarer. Nested and concurrent blocks share one setting; the last to end
    restores the collector."""
    _enter()
    try:
        yield
    finally:
        _exit()
