"""The in-memory database behind the memory store and transport: plain dicts
under one lock, for tests of code built on agentdispatch (no files, no server).

A transaction holds the lock and snapshots every table; an exception inside it
restores the snapshot, so a failed transaction changes nothing, as on a real
database. A nested transaction of one thread is a savepoint inside the outer one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from ...stores.base import Effect, Schedule, WorkerRow
from ...workitem import WorkItem

#: A clock answering seconds since the epoch (``time.time`` or a fake).
Clock = Callable[[], float]


@dataclass(frozen=True)
class QueueRow:
    """One envelope row of the queue (frozen: a write replaces the row)."""

    id: int
    job_id: str
    item_seq: int
    tenant: str
    session_id: str
    priority: int
    deadline_unix: float | None
    envelope: str
    enqueued_at: float
    visible_at: float
    claimed_by: str | None = None
    claimed_at: float | None = None
    deliveries: int = 0


@dataclass
class Tables:
    """Every table of the in-memory database. Values are immutable, so a
    shallow copy of each container is a full snapshot."""

    items: dict[str, WorkItem] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    #: depends_on -> the jobs waiting on it
    dependants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    queue: dict[int, QueueRow] = field(default_factory=dict)
    #: (tenant, key) -> (row, created_at)
    effects: dict[tuple[str, str], tuple[Effect, float]] = field(default_factory=dict)
    poison: dict[str, dict[str, Any]] = field(default_factory=dict)
    workers: dict[str, WorkerRow] = field(default_factory=dict)
    #: The counts of removed workers (``dispatch_fleet_counters``).
    fleet_counters: dict[str, float] = field(default_factory=dict)
    #: token id -> (hash, tenant, label, revoked)
    tokens: dict[str, tuple[str, str, str, bool]] = field(default_factory=dict)
    schedules: dict[tuple[str, str], Schedule] = field(default_factory=dict)
    #: When each tenant was last served by a get (the fair claim order).
    tenant_served: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {"seq": 0, "queue": 0, "served": 0})

    def snapshot(self) -> Tables:
        """A copy that later writes to ``self`` do not reach."""
        return Tables(**{f.name: type(v)(v) for f in fields(self) for v in [getattr(self, f.name)]})

    def restore(self, snap: Tables) -> None:
        """Put every table back as ``snap`` holds it."""
        for f in fields(self):
            setattr(self, f.name, getattr(snap, f.name))

    def next_id(self, counter: str) -> int:
        """The next number of a sequence (rolled back with the transaction)."""
        self.counters = {**self.counters, counter: self.counters[counter] + 1}
        return self.counters[counter]


class MemoryDb:
    """The shared state of a :class:`MemoryStore` and a :class:`MemoryTransport`."""

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self.tables = Tables()
        self._lock = threading.RLock()
        self._depth = 0
        #: Set whenever an envelope row becomes visible (wakes a waiting get).
        self.arrived = threading.Condition(self._lock)

    def now(self) -> float:
        """The database clock."""
        return self.clock()

    @contextmanager
    def tx(self) -> Iterator[Tables]:
        """One transaction: all or nothing, one at a time."""
        with self._lock:
            outer = self._depth == 0
            # Every level snapshots: a nested one that fails is undone alone
            # (a savepoint), and its caller may carry on.
            snap = self.tables.snapshot()
            self._depth += 1
            try:
                yield self.tables
            except BaseException:
                self.tables.restore(snap)
                raise
            finally:
                self._depth -= 1
                if outer:
                    self.arrived.notify_all()

    @contextmanager
    def read(self) -> Iterator[Tables]:
        """A consistent read (the lock, no snapshot)."""
        with self._lock:
            yield self.tables
