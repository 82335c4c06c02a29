"""The lease guard a handler receives: renews in the background and before
every side effect, and refuses once the lease is lost."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import AgentDispatchError, EffectUnknown, LeaseLost
from .policy import renew_every
from .workitem import Lease

if TYPE_CHECKING:
    from .stores.base import Store

T = TypeVar("T")


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
        self.every = renew_every(ttl_s, renew_interval_s)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None

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
        # LeaseLost is remembered by renew(); a store hiccup is retried next tick.
        with contextlib.suppress(AgentDispatchError):
            self.renew()

    def _loop(self) -> None:
        while not self._stop.wait(self.every) and self._lost is None:
            self.tick()

    def renew(self) -> None:
        """Renew now; raises :class:`LeaseLost` when fenced."""
        self.check()
        with self._mutex:
            try:
                self.lease = self.store.renew(self.lease, self.ttl_s)
            except LeaseLost as exc:
                self._lost = str(exc)
                raise

    def check(self) -> None:
        """Raise :class:`LeaseLost` if a renewal already failed."""
        if self._lost is not None:
            raise LeaseLost(self._lost)

    def side_effect(self, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` at most once per ``key``: renew and fence first, record
        the result; a redelivered turn gets the recorded result back."""
        self.check()
        with self._mutex:
            try:
                done = self.store.effect_begin(self.lease, key, self.ttl_s)
            except LeaseLost as exc:
                self._lost = str(exc)
                raise
            if done is not None and done.state == "unknown":
                raise EffectUnknown(
                    f"side effect {key!r} was started by attempt epoch {done.epoch} and never "
                    "confirmed; inspect it, then replay the job from the dead-letter queue"
                )
            if done is not None:
                return done.result  # type: ignore[no-any-return]
            try:
                result = fn()
            except BaseException:
                self.store.effect_end(self.lease, key, ok=False, result=None)
                raise
            self.store.effect_end(self.lease, key, ok=True, result=jsonable(result))
            return result


def jsonable(value: Any) -> Any:
    """``value`` when JSON can hold it, else its repr (results are stored as JSON)."""
    import json

    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


class Renewer:
    """One thread that renews every active guard of a worker on schedule
    (instead of a thread per turn)."""

    def __init__(self) -> None:
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
            at = self._due[guard] = time.monotonic() + guard.every
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
                now = time.monotonic()
                due = [g for g, at in self._due.items() if at <= now]
                for g in due:
                    self._due[g] = now + g.every
                if not due:
                    self._wakes_at = min(self._due.values(), default=now + 1.0)
                    self._cv.wait(max(0.0, self._wakes_at - now))
                    self._wakes_at = 0.0  # awake: adders need not notify
                    continue
            for g in due:
                g.tick()
