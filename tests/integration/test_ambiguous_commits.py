"""Reliability scenario 3: a store call that commits and then reports a
timeout. The worker's own transactions (claim, commit and acknowledge) and the
store's submit, renew and side-effect verbs commit, then raise
TaskQueueUnavailable one time in twenty; the caller retries a timed-out submit
under the same idempotency key. Nothing is lost, no key gets two items and no
effect is applied twice."""

from __future__ import annotations

import contextlib
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentdispatch import Status, Submission
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import LeaseGuard
from backends import postgres_harness, sqlite_harness
from contract.helpers import wait_until

TURNS = 300
RATE = 0.05
STORE_VERBS = ("submit", "renew", "effect_begin", "effect_end")


class Injector:
    """Decides, under a fixed seed, which committed calls report a timeout."""

    def __init__(self) -> None:
        self._rng = random.Random(3)
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()

    def after(self, name: str) -> None:
        """Called once ``name`` committed: raise a timeout RATE of the time."""
        with self._lock:
            self.calls[name] += 1
            hit = self._rng.random() < RATE
            self.faults[name] += hit
        if hit:
            raise TaskQueueUnavailable(f"injected: timed out after {name} committed")


def _inject(monkeypatch: pytest.MonkeyPatch, backend: str, inj: Injector) -> None:
    if backend == "postgres":
        from agentdispatch.backends.postgres.flow import PostgresSides as Sides
        from agentdispatch.backends.postgres.store import PostgresStore as Store
    else:
        from agentdispatch.backends.sqlite.flow import SqliteSides as Sides  # type: ignore[assignment]
        from agentdispatch.backends.sqlite.store import SqliteStore as Store  # type: ignore[assignment]
    tx = Sides.tx

    @contextlib.contextmanager
    def committed_then_timeout(self: Any, durable: bool) -> Iterator[Any]:
        with tx(self, durable) as c:
            yield c
        inj.after("durable tx" if durable else "tx")

    monkeypatch.setattr(Sides, "tx", committed_then_timeout)
    for name in STORE_VERBS:

        def wrap(verb: Callable[..., Any], name: str = name) -> Callable[..., Any]:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                out = verb(self, *args, **kwargs)
                inj.after(name)
                return out

            return call

        monkeypatch.setattr(Store, name, wrap(getattr(Store, name)))


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_timeouts_after_commits_lose_and_duplicate_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    build = postgres_harness if backend == "postgres" else sqlite_harness
    # Attempts are spent by claims whose answer was lost (the turn waits out
    # its TTL): ten of them make a dead letter here vanishingly unlikely.
    h = build(tmp_path, claim_ttl_s=3.0, renew_interval_s=1.0, max_attempts=10)
    inj = Injector()
    _inject(monkeypatch, backend, inj)
    applied: Counter[str] = Counter()
    lock = threading.Lock()
    reg = Registry()

    @reg.register("send")
    def send(turn: Turn, guard: LeaseGuard) -> str:
        key = f"send:{turn.job_id}"

        def apply() -> str:
            with lock:
                applied[key] += 1
            return "sent"

        # A plain effect (no verify, not idempotent downstream): a begin whose
        # answer was lost must not leave a mark that reads as unknown later.
        guard.renew()
        return guard.side_effect(key, apply)

    worker = h.worker(reg, threads=4)
    assert type(worker.flow).__name__ == "Shared"  # the production path, not the composed one
    worker.start()
    try:
        d = h.dispatcher()
        ids: dict[str, set[str]] = {}
        for i in range(TURNS):
            key = f"order-{i}"
            while True:
                try:
                    handle = d.submit(Submission(kind="send", tenant="t", session_id=f"s{i % 30}", idempotency_key=key))
                except TaskQueueUnavailable:
                    continue  # the caller retries under the same key
                ids.setdefault(key, set()).add(handle.job_id)
                break
        jobs = [next(iter(v)) for v in ids.values()]
        wait_until(lambda: all(h.store.get(j, "t").status.terminal for j in jobs), timeout=240, every=0.5)
        items = [h.store.get(j, "t") for j in jobs]
        counts = h.store.counts("t")
    finally:
        worker.stop(grace_s=10)
        h.close()
    assert {k: v for k, v in ids.items() if len(v) != 1} == {}
    assert Counter(i.status for i in items) == {Status.SUCCEEDED: TURNS}
    assert {k: n for k, n in applied.items() if n != 1} == {}
    assert len(applied) == TURNS
    assert counts == {"succeeded": TURNS}
    # Every kind of call met the fault, so each recovery path was taken.
    assert all(inj.faults[name] > 0 for name in ("durable tx", "tx", *STORE_VERBS)), inj.faults
