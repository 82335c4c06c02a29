"""The lease guard a handler receives: renews in the background and before
every side effect, and refuses once the lease is lost."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import AgentDispatchError, LeaseLost
from .policy import renew_every
from .workitem import Lease

if TYPE_CHECKING:
    from .stores.base import Store

T = TypeVar("T")


class LeaseGuard:
    """Keeps one lease alive and fences every side effect."""

    def __init__(self, store: Store, lease: Lease, *, ttl_s: float, renew_interval_s: float) -> None:
        self.store = store
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
        """Start the background renew thread."""
        self._thread = threading.Thread(target=self._loop, name=f"renew-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (before the commit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.renew()
            except LeaseLost:
                return
            except AgentDispatchError:
                continue  # store hiccup: try again next tick, the TTL gives slack

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
            if done is not None:
                return done.result  # type: ignore[no-any-return]
            try:
                result = fn()
            except BaseException:
                self.store.effect_end(self.lease, key, ok=False, result=None)
                raise
            self.store.effect_end(self.lease, key, ok=True, result=_jsonable(result))
            return result


def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value
