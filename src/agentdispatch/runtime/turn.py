"""One turn under its guard: the handler awaited as a task (or run in the
worker's thread pool), its timeout, and how it ended."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from ..envelope import Envelope
from ..errors import Overloaded
from ..handlers import Handler, Registry, failure_outcome, turn_of, unknown_kind
from ..lease import LeaseGuard, jsonable
from ..transports.base import Delivery
from ..transports.flow import TurnEnd
from ..workitem import Outcome, WorkItem


@dataclass(eq=False)
class Running:
    """A claimed turn while its handler runs."""

    delivery: Delivery
    envelope: Envelope
    item: WorkItem
    guard: LeaseGuard
    #: When the worker started it (its clock): which overload burst it belongs to.
    started_at: float = 0.0
    task: asyncio.Task[None] | None = None
    #: The handler is running: the only time the worker cancels the task.
    in_handler: bool = False
    #: Why the worker cancelled the task (None: it did not).
    stop: TurnEnd | None = None
    outcome: Outcome | None = None
    overload: Overloaded | None = field(default=None, repr=False)


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (``async def``, also behind
    a partial or as a callable object's ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


async def call_handler(fn: Handler, r: Running, pool: Executor) -> Any:
    """The handler's result: awaited on the loop, or run in ``pool``."""
    loop = asyncio.get_running_loop()
    # Parents' results are store reads: off the loop, which serves every turn.
    turn = await loop.run_in_executor(pool, turn_of, r.item, r.guard.store) if r.item.dependencies else turn_of(r.item)
    if is_async(fn):
        result = await fn(turn, r.guard)
    else:
        # In the turn's context: its log fields and trace span reach the handler's thread.
        result = await loop.run_in_executor(pool, contextvars.copy_context().run, fn, turn, r.guard)
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            result = await result
    return result


async def run_turn(registry: Registry, r: Running, pool: Executor, timeout_s: float | None) -> Outcome | None:
    """Run the turn's handler: its outcome (a timeout fails it retryably with
    reason ``timeout``), or None when nothing may be committed (the lease was
    lost, or the worker cancelled the turn)."""
    fn = registry.get(r.item.kind)
    if fn is None:
        return unknown_kind(r.item.kind)
    try:
        async with asyncio.timeout(timeout_s):
            result = await call_handler(fn, r, pool)
        return Outcome(ok=True, result=jsonable(result))
    except TimeoutError:
        # A sync handler's thread cannot be interrupted: refuse its effects.
        r.guard.revoke(f"job {r.item.id}: timed out after {timeout_s:g} s")
        return Outcome(ok=False, error=f"timeout: the turn ran past {timeout_s:g} s", reason="timeout")
    except asyncio.CancelledError:
        if r.stop is None:
            raise  # not ours: the loop is going down
        return None
    except Overloaded as exc:
        r.overload = exc
        return Outcome(ok=False, error=str(exc), reason="overloaded")
    except Exception as exc:
        return failure_outcome(exc)
