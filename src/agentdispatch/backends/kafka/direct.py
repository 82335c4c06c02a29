"""Ready turns read from the store while the consumer group cannot deliver.

After the brokers went away (or lost their log) a consumer has no assignment
until the group has rejoined, which a broker may hold back for seconds (Tansu
holds a restarted group's first JoinGroup about a session's worth) while the
ready items sit in the store; and a broker that lost its log and group may
let it rejoin into nothing (an empty, stale assignment; fetch positions past
the new log's end that get no out-of-range answer) until the stall watch
rejoins the group. A worker thread whose consumer has had no assignment since
then, or is so starved (assigned, no fetch answer since), claims them from
the store instead: each is handed out
as a delivery whose receipt is :class:`StoreRef`, and the worker claims it as
it claims any delivery, fenced by the store's lease. The store keeps the rules
it keeps for every delivery (session order, leases, readiness), so a turn run
this way and its Kafka message delivered later are one claim: the message is
answered busy or skipped.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ...stores.engine import envelope_of
from ...transports.base import Delivery, Receipt
from ...workitem import Status, WorkItem

#: How often a process reads the store's ready items while a consumer needs them.
REFRESH_S = 0.25

#: The most ready items one read takes (the oldest ready; newest first from a
#: store with only the listing).
SCAN = 2000


#: A read of the ready items waits at least this many times the last read's
#: duration after it: the store serves the other workers meanwhile.
COST_FACTOR = 4.0


@runtime_checkable
class ReadyListing(Protocol):
    """The store's listing (every store has it; the transport is handed the store as its outbox)."""

    def list_jobs(self, *, tenant: str | None, status: Status | None, limit: int, offset: int) -> list[WorkItem]:
        """Items newest first."""


@runtime_checkable
class ReadyDue(Protocol):
    """The store's own read of the ready items (the memory, SQLite and
    PostgreSQL stores): on the partial index of ready items, where the
    listing reads every item of the status, newest first."""

    def ready_due(self, *, now: float, limit: int) -> list[WorkItem]:
        """Ready items due by ``now`` (unix), oldest ready first, at most ``limit``."""


@dataclass(frozen=True)
class StoreRef:
    """The receipt reference of a delivery read from the store: nothing to
    acknowledge or give back on Kafka (the lease is the claim)."""

    job_id: str


def claim_order(items: list[WorkItem], now_unix: float, rotate: int) -> list[WorkItem]:
    """The items worth a claim, in claim order: the first ready item of each
    session (the store refuses the others), due now; tenants take turns, and
    within a tenant expired deadlines, then priority, then age come first.
    ``rotate``: where this process starts in the round of tenants and within
    each tenant's list, so that processes reading the same items at once do
    not all claim the same one first."""
    heads: dict[tuple[str, str], WorkItem] = {}
    for it in items:
        if it.status is not Status.READY or it.ready_at > now_unix:
            continue
        key = (it.tenant, it.session_id)
        if key not in heads or it.seq < heads[key].seq:
            heads[key] = it
    by_tenant: dict[str, list[WorkItem]] = {}
    for it in heads.values():
        by_tenant.setdefault(it.tenant, []).append(it)
    queues: list[deque[WorkItem]] = []
    for tenant in sorted(by_tenant):
        mine: list[WorkItem] = []
        # Bands of one urgency (expired deadline, priority), oldest first,
        # each rotated: age orders sessions only loosely anyway.
        for _, band in itertools.groupby(sorted(by_tenant[tenant], key=_urgency(now_unix)), key=_band(now_unix)):
            ordered = list(band)
            k = rotate % len(ordered)
            mine += ordered[k:] + ordered[:k]
        queues.append(deque(mine))
    if queues:
        queues = queues[rotate % len(queues) :] + queues[: rotate % len(queues)]
    out: list[WorkItem] = []
    while queues:
        queues = [q for q in queues if q]
        for q in queues:
            out.append(q.popleft())
    return out


def _band(now_unix: float) -> Callable[[WorkItem], tuple[bool, int]]:
    return lambda i: (not (i.deadline_unix is not None and i.deadline_unix <= now_unix), -i.priority)


def _urgency(now_unix: float) -> Callable[[WorkItem], tuple[bool, int, int]]:
    band = _band(now_unix)
    return lambda i: (*band(i), i.seq)


class DirectClaims:
    """One process's ready items from the store, handed out one per get."""

    def __init__(self, *, refresh_s: float = REFRESH_S, scan: int = SCAN) -> None:
        self.refresh_s = refresh_s
        self.scan = scan
        self._lock = threading.Lock()
        self._pending: deque[WorkItem] = deque()
        self._read_at = float("-inf")
        self._cost = 0.0  # how long the last read took
        self._rotate = random.randrange(1 << 16)
        self.handed = 0

    def take(self, store: object, owner: str) -> Delivery | None:
        """The next ready item as a delivery for ``owner``, or None (none left
        of the last read, made less than ``refresh_s`` ago; or a store with
        neither read of its ready items)."""
        if not isinstance(store, (ReadyDue, ReadyListing)):
            return None
        with self._lock:
            now = time.monotonic()
            # Read again once the last read is ``refresh_s`` old, even with
            # items left: those are largely run by now (every process reads
            # the same ones), and a session's next turn became its head. A
            # slow read (a large table) is repeated less often.
            if now - self._read_at >= max(self.refresh_s, COST_FACTOR * self._cost):
                self._read_at = now
                if isinstance(store, ReadyDue):
                    items = store.ready_due(now=time.time(), limit=self.scan)
                else:
                    items = store.list_jobs(tenant=None, status=Status.READY, limit=self.scan, offset=0)
                self._cost = time.monotonic() - now
                self._rotate += 1
                self._pending = deque(claim_order(items, time.time(), self._rotate))
            if not self._pending:
                return None
            item = self._pending.popleft()
            self.handed += 1
        env = envelope_of(item, time.time())
        return Delivery(raw=env.to_json(), receipt=Receipt(owner, now, StoreRef(item.id)))
