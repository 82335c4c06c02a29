"""The handler registry (one function per ``kind``) and the built-in kinds."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, EffectUnknown, JobNotFound, LeaseLost, NonRetryableError, Retired
from .lease import jsonable
from .workitem import Outcome, WorkItem

if TYPE_CHECKING:
    from .lease import LeaseGuard
    from .stores.base import Jobs

ENTRY_POINT_GROUP = "agentdispatch.handlers"
log = logging.getLogger("agentdispatch.handlers")


@dataclass(frozen=True)
class Turn:
    """What a handler receives besides its lease guard."""

    job_id: str
    session_id: str
    tenant: str
    kind: str
    payload: Any
    attempt: int
    agent_name: str = ""
    deadline_unix: float | None = None
    #: What an earlier attempt saved with ``guard.checkpoint`` (None: start afresh).
    checkpoint: Any = None
    #: The committed result of each job this one depends on, by job id (a
    #: child runs only once every parent succeeded, so these are final).
    parent_results: dict[str, Any] = field(default_factory=dict)


Handler = Callable[[Turn, "LeaseGuard"], Any]


class Registry:
    """Handlers by kind; plain functions, sync or ``async def``."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._timeouts: dict[str, float] = {}

    def register(self, kind: str, *, timeout_s: float | None = None) -> Callable[[Handler], Handler]:
        """Decorator: ``@registry.register("kind", timeout_s=300)``. A turn
        running past ``timeout_s`` is cancelled and retried (reason ``timeout``)."""

        def add(fn: Handler) -> Handler:
            self.add(kind, fn, timeout_s=timeout_s)
            return fn

        return add

    def add(self, kind: str, fn: Handler, *, timeout_s: float | None = None) -> None:
        """Register ``fn`` for ``kind`` (see :meth:`register`)."""
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"handler {kind!r}: timeout_s must be above 0, got {timeout_s!r}")
        self._handlers[kind] = fn
        self._timeouts.pop(kind, None)
        if timeout_s is not None:
            self._timeouts[kind] = float(timeout_s)

    def get(self, kind: str) -> Handler | None:
        """The handler of ``kind``, or None."""
        return self._handlers.get(kind)

    def timeout_of(self, kind: str) -> float | None:
        """The execution timeout of ``kind`` in seconds (None: none)."""
        return self._timeouts.get(kind)

    def update(self, other: Registry) -> None:
        """Take every handler of ``other``."""
        for kind in other._handlers:
            self._timeouts.pop(kind, None)
        self._handlers.update(other._handlers)
        self._timeouts.update(other._timeouts)

    def kinds(self) -> list[str]:
        """Registered kinds, sorted."""
        return sorted(self._handlers)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._handlers))


def run_handler(fn: Handler, turn: Turn, guard: LeaseGuard, loop: asyncio.AbstractEventLoop) -> Any:
    """Call a handler; coroutines run on the worker thread's own loop."""
    result = fn(turn, guard)
    if inspect.isawaitable(result):
        return loop.run_until_complete(result)
    return result


def turn_of(item: WorkItem, store: Jobs | None = None) -> Turn:
    """What the handler of ``item`` receives (its parents' results read from
    ``store`` when it has dependencies)."""
    return Turn(
        job_id=item.id,
        session_id=item.session_id,
        tenant=item.tenant,
        kind=item.kind,
        payload=item.payload,
        attempt=item.attempt,
        agent_name=item.agent_name,
        deadline_unix=item.deadline_unix,
        checkpoint=item.checkpoint,
        parent_results=parent_results(store, item) if store is not None and item.dependencies else {},
    )


def unknown_kind(kind: str) -> Outcome:
    """The outcome of a turn nobody can run: it fails for good."""
    return Outcome(ok=False, error=f"unknown kind {kind!r}: no handler registered", retryable=False)


def failure_outcome(exc: Exception) -> Outcome | None:
    """A handler's exception as an :class:`Outcome` (None: the lease was lost,
    nothing may be committed)."""
    if isinstance(exc, LeaseLost):
        return None
    if isinstance(exc, EffectUnknown):
        return Outcome(ok=False, error=str(exc), retryable=False, dead_letter_reason="effect_unknown")
    if isinstance(exc, NonRetryableError):
        error = _text(exc) or "non-retryable failure"
        return Outcome(
            ok=False,
            error=error,
            retryable=False,
            reason=None if exc.reason is None else storable(str(exc.reason)),
            retired=isinstance(exc, Retired),
            traceback=_traceback(exc),
        )
    # A handler's failure is data, not a crash; its traceback tells the
    # on-call where it happened.
    return Outcome(
        ok=False, error=f"{type(exc).__name__}: {_text(exc)}"[:2000], retryable=True, traceback=_traceback(exc)
    )


def _text(exc: BaseException) -> str:
    """``str(exc)``, or a stand-in when the exception's own ``__str__`` fails:
    the failure must still be committed, or the turn would wait out its lease."""
    try:
        return storable(str(exc))
    except Exception:
        return "<the exception's message could not be read>"


def _traceback(exc: BaseException) -> str:
    try:
        return storable("".join(traceback.format_exception(exc)).rstrip())
    except Exception:
        return f"{type(exc).__name__}: <the traceback could not be formatted>"


def storable(text: str) -> str:
    """``text`` as every store can hold it: PostgreSQL refuses a NUL in text
    and neither database takes a lone surrogate (not UTF-8), so both are
    written as escapes. A message of decoded bytes carries them easily, and
    an outcome that cannot be stored would fail its whole commit batch."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def outcome_of(
    registry: Registry, item: WorkItem, guard: LeaseGuard, loop: asyncio.AbstractEventLoop
) -> Outcome | None:
    """Run the item's handler: its result or its failure as an :class:`Outcome`
    (an unknown kind fails for good), or None when the lease was lost."""
    fn = registry.get(item.kind)
    if fn is None:
        return unknown_kind(item.kind)
    try:
        return Outcome(ok=True, result=jsonable(run_handler(fn, turn_of(item, guard.store), guard, loop)))
    except Exception as exc:
        return failure_outcome(exc)


def parent_results(store: Jobs, item: WorkItem) -> dict[str, Any]:
    """The results of ``item``'s parents, read from the store (a parent that
    vanished reads as None)."""
    out: dict[str, Any] = {}
    for parent in item.dependencies:
        try:
            out[parent] = store.get(parent, item.tenant).result
        except JobNotFound:
            out[parent] = None
    return out


def echo(turn: Turn, guard: LeaseGuard) -> Any:
    """Built-in: return the payload."""
    return turn.payload


def sleep(turn: Turn, guard: LeaseGuard) -> Any:
    """Built-in: sleep ``payload["seconds"]`` while keeping the lease alive."""
    seconds = float((turn.payload or {}).get("seconds", 1.0)) if isinstance(turn.payload, dict) else 1.0
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        guard.check()
        time.sleep(min(0.2, left))
    return {"slept": seconds}


def builtins() -> Registry:
    """A registry holding the built-in kinds ``echo`` and ``sleep``."""
    reg = Registry()
    reg.add("echo", echo)
    reg.add("sleep", sleep)
    return reg


def load_app(spec: str) -> Registry:
    """Import ``module:attr``; the attribute is a Registry or a dict of kinds."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"AGENT_DISPATCH_APP / --app must look like module:registry, got {spec!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"AGENT_DISPATCH_APP / --app {spec!r} cannot be loaded: {exc}") from None
    if isinstance(obj, Registry):
        return obj
    if isinstance(obj, dict):
        reg = Registry()
        for kind, fn in obj.items():
            reg.add(str(kind), fn)
        return reg
    raise ConfigError(f"AGENT_DISPATCH_APP / --app {spec!r} is not a Registry or a dict")


def discover(app: str | None) -> Registry:
    """Built-ins, then entry points of ``agentdispatch.handlers``, then ``app``."""
    reg = builtins()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
        except ImportError as exc:  # an optional extra is not installed
            log.info("handler entry point %s skipped: %s", ep.name, exc)
            continue
        if isinstance(loaded, Registry):
            reg.update(loaded)
        elif callable(loaded):
            reg.add(ep.name, loaded)
    if app:
        reg.update(load_app(app))
    return reg
