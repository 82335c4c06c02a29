"""The lease guard a handler receives: renews in the background and before
every side effect, and refuses once the lease is lost."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from . import tracing
from .clock import Clock, MonotonicClock
from .errors import AgentDispatchError, EffectUnknown, InvalidInput, LeaseLost, TaskQueueUnavailable
from .policy import renew_every
from .workitem import Lease

if TYPE_CHECKING:
    from .stores.base import Effect, EffectState, LedgerOp, Store

T = TypeVar("T")
#: The largest checkpoint :meth:`LeaseGuard.checkpoint` saves, as UTF-8 JSON
#: (it is read with the item on every claim and commit: keep bulk elsewhere).
MAX_CHECKPOINT_BYTES = 256 * 1024
log = logging.getLogger("agentdispatch.lease")


@dataclass(frozen=True)
class Fence:
    """A lease's fencing token, for a downstream system that supports
    conditional writes: refuse a write of ``job_id`` whose ``epoch`` is below
    the highest one seen (a stale attempt). An effect function receives it
    when it has a parameter named ``fence``."""

    job_id: str
    epoch: int
    token: str


@functools.lru_cache(maxsize=4096)
def _code_wants_fence(code: Any) -> bool:
    return "fence" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def _wants_fence(fn: Callable[..., Any]) -> bool:
    code = getattr(fn, "__code__", None)
    if code is not None:
        return _code_wants_fence(code)  # lambdas are new objects per call; their code is not
    try:
        return "fence" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _check_key(key: object) -> None:
    """Refuse a ledger key a store cannot hold (PostgreSQL takes no NUL in
    text; neither database a lone surrogate) before anything runs: the write
    would fail as if the database were down."""
    if not isinstance(key, str) or "\x00" in key:
        raise InvalidInput(f"a side effect key must be a string without NUL, not {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"a side effect key must be valid Unicode text, not {key!r}") from None


class LeaseGuard:
    """Keeps one lease alive and fences every side effect."""

    def __init__(
        self,
        store: Store,
        lease: Lease,
        *,
        ttl_s: float,
        renew_interval_s: float,
        renewer: Renewer | None = None,
    ) -> None:
        self.store = store
        self.renewer = renewer
        self.lease = lease
        self.ttl_s = ttl_s
        #: The turn's span (see :mod:`.tracing`): side effects are traced under it.
        self.trace: Any = None
        self.every = renew_every(ttl_s, renew_interval_s)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Called (from the renewing thread) once the guard is lost or revoked:
        #: the async runtime cancels the turn's task there.
        self.on_lost: Callable[[str], None] | None = None
        #: Where :meth:`side_effect_async` runs its store calls (None: the
        #: loop's default executor).
        self.io: Executor | None = None
        #: Times the fence check of a side effect (seconds; monotonic).
        self.clock: Callable[[], float] = time.monotonic
        #: Where :meth:`side_effect_async` queues its ledger writes instead,
        #: to be written with other turns' in one transaction (the async
        #: runtime's :class:`~agentdispatch.runtime.ledger.Ledger`).
        self.ledger: Callable[[LedgerOp], asyncio.Future[Any]] | None = None

    @property
    def fence(self) -> Fence:
        """The lease's fencing token (see :class:`Fence`)."""
        return Fence(self.lease.job_id, self.lease.epoch, self.lease.token)

    @property
    def lost_reason(self) -> str | None:
        """Why the guard refuses (None while it holds)."""
        return self._lost

    def revoke(self, reason: str) -> None:
        """Refuse from now on (a refused renewal, a timeout, a shutdown): no
        side effect starts after this call, and :attr:`on_lost` is told."""
        if self._lost is None:
            self._lost = reason
        callback = self.on_lost
        if callback is not None:
            callback(reason)

    @property
    def job_id(self) -> str:
        """The guarded job."""
        return self.lease.job_id

    @property
    def lost(self) -> bool:
        """True once a renewal was refused."""
        return self._lost is not None

    def start(self) -> LeaseGuard:
        """Start renewing in the background (the worker's shared renewer, or a
        thread of its own)."""
        if self.renewer is not None:
            self.renewer.add(self)
        else:
            self._thread = threading.Thread(target=self._loop, name=f"renew-{self.job_id}", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (before the commit)."""
        self._stop.set()
        if self.renewer is not None:
            self.renewer.remove(self)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def tick(self) -> None:
        """One background renewal; store hiccups are retried next tick."""
        if self._stop.is_set() or self._lost is not None:
            return
        # A store call of this guard in flight (an effect's begin renews too)
        # must not hold up the worker's shared renewer: retry next tick.
        if not self._mutex.acquire(blocking=False):
            return
        try:
            # LeaseLost is remembered by _renew(); a store hiccup is retried
            # next tick (whatever it raised: the shared renewer must not die).
            self._renew()
        except Exception as exc:
            log.debug("renewing %s failed: %s", self.job_id, exc)
        finally:
            self._mutex.release()

    def _loop(self) -> None:
        while not self._stop.wait(self.every) and self._lost is None:
            self.tick()

    def renew(self) -> None:
        """Renew now; raises :class:`LeaseLost` when fenced."""
        self.check()
        with self._mutex:
            self._renew()

    def _renew(self) -> None:
        try:
            self.lease = self.store.renew(self.lease, self.ttl_s)
        except LeaseLost as exc:
            self.revoke(str(exc))
            raise

    def check(self) -> None:
        """Raise :class:`LeaseLost` if a renewal already failed."""
        if self._lost is not None:
            raise LeaseLost(self._lost)

    def checkpoint(self, state: Any) -> None:
        """Durably save ``state`` (any JSON value) as this turn's progress; a
        redelivered turn finds the last one saved as ``turn.checkpoint``.

        Fenced: once another attempt holds the turn (or the lease expired)
        nothing is written and :class:`LeaseLost` is raised. A state that is not
        JSON or is larger than :data:`MAX_CHECKPOINT_BYTES` raises
        :class:`InvalidInput` and changes nothing."""
        text = checkpoint_text(state)
        self.check()
        with self._mutex:
            try:
                self.store.checkpoint(self.lease, text)
            except LeaseLost as exc:
                self._lost = str(exc)
                raise

    def side_effect(
        self,
        key: str,
        fn: Callable[..., T],
        *,
        verify: Callable[[], T | NotHappened] | None = None,
        idempotent: bool = False,
    ) -> T:
        """Run ``fn`` at most once per ``key``: renew and fence first, record
        the result; a redelivered turn gets the recorded result back.

        An attempt that died during ``fn`` leaves its outcome unknown. By
        default the next attempt then raises :class:`EffectUnknown` (the turn
        is dead-lettered for a person). ``verify`` settles it instead: it asks
        the downstream system whether the effect with this key happened and
        returns its result, or :data:`NOT_HAPPENED` (then ``fn`` runs).
        ``idempotent=True`` declares that the downstream deduplicates by
        ``key`` (send the key along): ``fn`` simply runs again.

        ``fn`` runs without holding the guard, so renewals go on however long
        it takes; an ``fn`` that raises is recorded ``failed`` (``unknown``
        with ``verify``, or when interrupted), never committed. An ``fn`` with
        a parameter named ``fence`` receives the lease's :class:`Fence`.

        In an ``async def`` handler use :meth:`side_effect_async`."""
        _check_key(key)
        with tracing.span("side_effect", parent=self.trace, key=key, job_id=self.lease.job_id):
            return self._side_effect(key, fn, verify=verify, idempotent=idempotent)

    def _side_effect(
        self, key: str, fn: Callable[..., T], *, verify: Callable[[], T | NotHappened] | None, idempotent: bool
    ) -> T:
        asked = self.clock()
        done = self._begin(key, retry_unknown=idempotent)
        if done is not None and done.state == "unknown":
            if verify is None:
                raise EffectUnknown(
                    f"side effect {key!r} was started by attempt epoch {done.epoch} and never "
                    "confirmed; inspect it, then replay the job from the dead-letter queue"
                )
            found = verify()
            asked = self.clock()
            done = self._begin(key, retry_unknown=True)
            if done is None and not isinstance(found, NotHappened):
                self._settle(key, "committed", found)
                return found
        if done is not None:
            return done.result  # type: ignore[no-any-return]
        self._revoke_if_late(key, asked)
        if self._lost is not None:  # revoked while the mark was written: fn must not start
            self._settle_quietly(key, "failed")
            raise LeaseLost(self._lost)
        try:
            result = fn(fence=self.fence) if _wants_fence(fn) else fn()
        except Exception:
            self._settle_quietly(key, "failed" if verify is None else "unknown")
            raise
        except BaseException:
            self._settle_quietly(key, "unknown")  # interrupted: the outcome was not seen
            raise
        self._settle(key, "committed", result)
        return result

    async def side_effect_async(
        self,
        key: str,
        fn: Callable[..., Awaitable[T]],
        *,
        verify: Callable[[], Awaitable[T | NotHappened]] | None = None,
        idempotent: bool = False,
    ) -> T:
        """:meth:`side_effect` for ``async def`` handlers: ``fn`` (and
        ``verify``) are coroutine functions, awaited on the turn's loop; the
        ledger writes run off the loop. The same ledger, states and fence: a
        turn cancelled while ``fn`` runs leaves it ``unknown``; one cancelled
        before ``fn`` started never starts it."""
        _check_key(key)
        with tracing.span("side_effect", parent=self.trace, key=key, job_id=self.lease.job_id):
            return await self._side_effect_async(key, fn, verify=verify, idempotent=idempotent)

    async def _side_effect_async(
        self,
        key: str,
        fn: Callable[..., Awaitable[T]],
        *,
        verify: Callable[[], Awaitable[T | NotHappened]] | None,
        idempotent: bool,
    ) -> T:
        asked = self.clock()
        done = await self._abegin(key, retry_unknown=idempotent)
        if done is not None and done.state == "unknown":
            if verify is None:
                raise EffectUnknown(
                    f"side effect {key!r} was started by attempt epoch {done.epoch} and never "
                    "confirmed; inspect it, then replay the job from the dead-letter queue"
                )
            found = await verify()
            asked = self.clock()
            done = await self._abegin(key, retry_unknown=True)
            if done is None and not isinstance(found, NotHappened):
                await self._asettle(key, "committed", found)
                return found
        if done is not None:
            return done.result  # type: ignore[no-any-return]
        self._revoke_if_late(key, asked)
        if self._lost is not None:  # revoked while the mark was written: fn must not start
            await self._asettle_quietly(key, "failed")
            raise LeaseLost(self._lost)
        try:
            result = await (fn(fence=self.fence) if _wants_fence(fn) else fn())
        except asyncio.CancelledError:
            await self._asettle_quietly(key, "unknown")  # interrupted: the outcome was not seen
            raise
        except Exception:
            await self._asettle_quietly(key, "failed" if verify is None else "unknown")
            raise
        await self._asettle(key, "committed", result)
        return result

    def _revoke_if_late(self, key: str, asked: float) -> None:
        """Refuse the effect if its begin's answer took a TTL or more since
        ``asked`` (when it was sent, or later): the begin's transaction reads
        the database clock once, early, and renews the lease from it, so an
        answer held up (a stalled link, a lock, a paused process) can confirm
        a lease that had already run out when it came."""
        took = self.clock() - asked
        if took >= self.ttl_s:
            self.revoke(
                f"job {self.job_id}: side effect {key!r} was confirmed {took:.1f} s after it was asked, "
                f"past the lease TTL of {self.ttl_s:g} s"
            )

    def _op(
        self, key: str, state: EffectState | None = None, result: Any = None, retry_unknown: bool = False
    ) -> LedgerOp:
        from .stores.base import LedgerOp

        return LedgerOp(self.lease, key, state, jsonable(result), self.ttl_s, retry_unknown)

    async def _queued(self, op: LedgerOp) -> Any:
        """The answer of ``op`` from the ledger queue; an answer that is an
        error is raised (a lost lease revokes the guard first). If the turn is
        cancelled meanwhile, the write still finishes (a begin that wrote its
        mark is settled ``failed``: ``fn`` never ran) before the cancel goes on."""
        assert self.ledger is not None
        fut = self.ledger(op)
        try:
            got = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if op.state is None:
                fut.add_done_callback(functools.partial(self._undo_queued_begin, op.key))
            raise
        if isinstance(got, LeaseLost):
            self.revoke(str(got))
        if isinstance(got, Exception):
            raise got
        return got

    def _undo_queued_begin(self, key: str, fut: asyncio.Future[Any]) -> None:
        if self.ledger is not None and not fut.cancelled() and fut.exception() is None and fut.result() is None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the mark reads as unknown
                self.ledger(self._op(key, "failed"))

    async def _abegin(self, key: str, *, retry_unknown: bool) -> Effect | None:
        if self.ledger is None:
            return await self._io(self._begin, key, retry_unknown=retry_unknown)
        self.check()
        try:
            got: Effect | None = await self._queued(self._op(key, retry_unknown=retry_unknown))
        except TaskQueueUnavailable:
            # The batch's COMMIT may have landed (a database restart cut its
            # answer): fn never ran, so its mark must not read as unknown later.
            await self._io(self._settle_quietly, key, "failed")
            raise
        return got

    async def _asettle(self, key: str, state: EffectState, result: Any) -> None:
        if self.ledger is None:
            await self._io(self._settle, key, state, result)
            return
        try:
            recorded = await self._queued(self._op(key, state, result))
        except TaskQueueUnavailable:
            # The batch's COMMIT may or may not have landed (a database restart
            # cut its answer). A settlement is idempotent: write it again alone,
            # with the store's patience for a restart, rather than leave what
            # this attempt saw as unknown.
            await self._io(self._settle, key, state, result)
            return
        if not recorded:
            self.revoke(f"job {self.job_id}: another attempt took over side effect {key!r}")
            raise LeaseLost(f"job {self.job_id}: another attempt took over side effect {key!r}")

    async def _asettle_quietly(self, key: str, state: EffectState) -> None:
        with contextlib.suppress(AgentDispatchError):
            await self._asettle(key, state, None)

    async def _io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking ledger call off the loop. If the turn is cancelled while
        it runs, the call still finishes (a begin that wrote its mark is
        settled ``failed``: ``fn`` never ran) before the cancel goes on."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.io, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fn == self._begin:
                fut.add_done_callback(functools.partial(self._undo_begin, args[0]))
            raise

    def _undo_begin(self, key: str, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result() is None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the mark reads as unknown
                fut.get_loop().run_in_executor(self.io, self._settle_quietly, key, "failed")

    def _begin(self, key: str, *, retry_unknown: bool) -> Effect | None:
        self.check()
        try:
            with self._mutex:
                return self.store.effect_begin(self.lease, key, self.ttl_s, retry_unknown=retry_unknown)
        except LeaseLost as exc:
            self.revoke(str(exc))
            raise
        except TaskQueueUnavailable:
            # Its COMMIT may have landed (a database restart cut the answer):
            # fn never ran, so its mark must not read as unknown later.
            self._settle_quietly(key, "failed")
            raise

    def _settle(self, key: str, state: EffectState, result: Any) -> None:
        with self._mutex:
            try:
                recorded = self.store.effect_end(self.lease, key, state=state, result=jsonable(result))
            except LeaseLost as exc:
                self.revoke(str(exc))
                raise
        if not recorded:
            self.revoke(f"job {self.job_id}: another attempt took over side effect {key!r}")
            raise LeaseLost(f"job {self.job_id}: another attempt took over side effect {key!r}")

    def _settle_quietly(self, key: str, state: EffectState) -> None:
        # The handler gets fn's own exception: if this record cannot be
        # written, the mark stays "intended" and reads as unknown later.
        with contextlib.suppress(AgentDispatchError):
            self._settle(key, state, None)


class NotHappened:
    """The answer of a ``verify`` callback when the effect did not happen (:data:`NOT_HAPPENED`)."""

    def __repr__(self) -> str:
        return "NOT_HAPPENED"


#: What a ``verify`` callback of :meth:`LeaseGuard.side_effect` returns when
#: the downstream system has no effect with the key.
NOT_HAPPENED = NotHappened()


def checkpoint_text(state: Any) -> str:
    """``state`` as the JSON text a checkpoint stores, or :class:`InvalidInput`."""
    try:
        text = json.dumps(state, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"checkpoint state must be JSON (dicts, lists, str, numbers, bools, None): {exc}") from None
    except RecursionError:
        raise InvalidInput("checkpoint state nests too deeply to be stored as JSON") from None
    size = len(text.encode())
    if size > MAX_CHECKPOINT_BYTES:
        raise InvalidInput(
            f"checkpoint state is {size} bytes of JSON, over the {MAX_CHECKPOINT_BYTES} byte limit; "
            "keep large data elsewhere and checkpoint a reference to it"
        )
    return text


#: One strict encoder for every result (``json.dumps`` with an option builds one per call).
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


def jsonable(value: Any) -> Any:
    """``value`` when JSON can hold it, else its repr (results are stored as JSON).

    Strict JSON: a NaN or an infinity would be stored, then break every
    reader that follows the standard (the gateway's views answered 500)."""
    try:
        _STRICT_JSON.encode(value)
    except (TypeError, ValueError):
        return _safe_repr(value)
    except RecursionError:
        return f"<{type(value).__name__} nested too deeply to store as JSON>"
    return value


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # a repr that raises or recurses: the type still tells something
        return f"<{type(value).__name__} that cannot be shown>"


class Renewer:
    """One thread that renews every active guard of a worker on schedule
    (instead of a thread per turn)."""

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or MonotonicClock()
        self._due: dict[LeaseGuard, float] = {}
        self._cv = threading.Condition()
        self._closed = False
        #: When the thread wakes next on its own (it need not be woken for a
        #: guard due later: the usual case, every guard having the same period).
        self._wakes_at = 0.0
        self._thread = threading.Thread(target=self._run, name="renewer", daemon=True)
        self._thread.start()

    def add(self, guard: LeaseGuard) -> None:
        """Renew ``guard`` every ``guard.every`` seconds from now."""
        with self._cv:
            at = self._due[guard] = self._clock() + guard.every
            if at < self._wakes_at:
                self._cv.notify()

    def remove(self, guard: LeaseGuard) -> None:
        """Stop renewing ``guard``."""
        with self._cv:
            self._due.pop(guard, None)

    def close(self) -> None:
        """Stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                now = self._clock()
                due = [g for g, at in self._due.items() if at <= now]
                for g in due:
                    self._due[g] = now + g.every
                if not due:
                    self._wakes_at = min(self._due.values(), default=now + 1.0)
                    self._clock.wait_until(self._cv, self._wakes_at)
                    self._wakes_at = 0.0  # awake: adders need not notify
                    continue
            for g in due:
                g.tick()
