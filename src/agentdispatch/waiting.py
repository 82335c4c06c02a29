"""Waiting for a job to end: the poll schedule shared by the in-process
:meth:`Dispatcher.wait`, the gateway's long-poll and the CLI.

Workers usually run in other processes, so a waiter cannot be told in-process
when a commit lands; it re-reads the job by primary key on a backoff that
starts short (a quick turn answers quickly) and settles at one read a second
(a long wait costs about one cheap read a second, not a busy loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from .errors import InvalidInput

#: The longest wait one call may ask for (a proxy's idle timeout is often 60 s).
MAX_WAIT_S = 60.0
FIRST_POLL_S = 0.05
LAST_POLL_S = 1.0
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "dead_letter"})


def check_wait(wait_s: float) -> float:
    """A valid wait in seconds, or :class:`InvalidInput`."""
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_S:
        raise InvalidInput(f"wait must be between 0 and {MAX_WAIT_S:g} seconds")
    return float(wait_s)


def pauses() -> Iterator[float]:
    """The pause before each re-read: growing by half each time, capped."""
    pause = FIRST_POLL_S
    while True:
        yield pause
        pause = min(LAST_POLL_S, pause * 1.5)


def is_done(view: dict[str, Any]) -> bool:
    """Whether a job view is in a terminal status."""
    return view.get("status") in TERMINAL


def wait_view(read: Callable[[], dict[str, Any]], wait_s: float) -> dict[str, Any]:
    """Re-read until the job is terminal or ``wait_s`` passed; the last view."""
    deadline = time.monotonic() + check_wait(wait_s)
    view = read()
    for pause in pauses():
        left = deadline - time.monotonic()
        if is_done(view) or left <= 0:
            return view
        time.sleep(min(pause, left))
        view = read()
    raise AssertionError("unreachable")


async def await_view(read: Callable[[], Awaitable[dict[str, Any]]], wait_s: float) -> dict[str, Any]:
    """:func:`wait_view` for an event loop: the pauses hold no thread."""
    deadline = time.monotonic() + check_wait(wait_s)
    view = await read()
    for pause in pauses():
        left = deadline - time.monotonic()
        if is_done(view) or left <= 0:
            return view
        await asyncio.sleep(min(pause, left))
        view = await read()
    raise AssertionError("unreachable")
