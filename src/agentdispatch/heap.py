"""The cyclic garbage collector while a worker or a gateway serves.

Python's collector walks every tracked object a collection reaches, with the
GIL held: the start-up heap (modules, classes, models, routes) on every full
collection, and, at the default young threshold of 700, every object of a turn
in flight several times over before it dies (a turn that waits seconds on a
model outlives many young collections). A serving process therefore freezes
what start-up built (it is never garbage); a worker also collects the young
generation less often. Both are undone when the last server of the process
stops, so an embedding process gets its collector back as it was.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: Young-generation threshold while a worker serves (the default is 700):
#: allocations net of deallocations between young collections.
YOUNG_THRESHOLD = 50_000

_lock = threading.Lock()
_freezers = 0
_raisers = 0
_saved_young: int | None = None


def _freeze() -> None:
    global _freezers
    _freezers += 1
    if _freezers == 1:
        gc.collect()  # garbage first: a frozen object is never collected
        gc.freeze()


def _thaw() -> None:
    global _freezers
    _freezers -= 1
    if _freezers == 0:
        gc.unfreeze()


def _raise_young() -> None:
    global _raisers, _saved_young
    _raisers += 1
    young, middle, old = gc.get_threshold()
    if _raisers == 1 and 0 < young < YOUNG_THRESHOLD:
        _saved_young = young
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def _restore_young() -> None:
    global _raisers, _saved_young
    _raisers -= 1
    if _raisers == 0 and _saved_young is not None:
        _, middle, old = gc.get_threshold()
        gc.set_threshold(_saved_young, middle, old)
        _saved_young = None


@contextlib.contextmanager
def serving(*, rarer_young: bool = True) -> Iterator[None]:
    """While the block runs: the heap built so far frozen and, with
    ``rarer_young``, young collections rarer. Nested and concurrent blocks
    share one setting; the last of them to end restores the collector."""
    with _lock:
        _freeze()
        if rarer_young:
            _raise_young()
    try:
        yield
    finally:
        with _lock:
            if rarer_young:
                _restore_young()
            _thaw()
