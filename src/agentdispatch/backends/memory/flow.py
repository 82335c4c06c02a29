"""The worker's batch verbs in memory: queue and store writes of one
transaction, on the tables it passes them."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ...errors import LeaseLost
from ...stores.base import Claim, Store
from ...transports.base import Delivery, Transport
from ...transports.flow import Flow, Shared, one_by_one
from ...workitem import Lease, Outcome, WorkItem
from .db import Tables
from .store import MemoryStore
from .transport import MemoryTransport

#: One transaction at a time (the database's lock): as on SQLite, a claim
#: riding with a commit holds nothing back from other claimants.
RIDES = 1_000


class MemorySides:
    """The :class:`~agentdispatch.transports.flow.Sides` of one :class:`MemoryDb`."""

    def __init__(self, store: MemoryStore, transport: MemoryTransport) -> None:
        self.store = store
        self.transport = transport

    def tx(self, durable: bool) -> AbstractContextManager[Tables]:
        return self.store.db.tx()

    def get(self, c: Tables, owner: str, n: int, visibility_s: float) -> list[tuple[Delivery, Any]]:
        return one_by_one(lambda: self.transport.get_on(c, owner, visibility_s), n)

    def claim(self, c: Tables, jobs: Sequence[tuple[str, str, Any]], owner: str, ttl_s: float) -> list[Claim]:
        return self.store.claim_on(c, [(j, t) for j, t, _ in jobs], owner=owner, ttl_s=ttl_s)

    def commit(self, c: Tables, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        return self.store.commit_on(c, done)

    def poison(self, c: Tables, raw: str, reason: str) -> None:
        self.store.poison_on(c, raw, reason)

    def ack(self, c: Tables, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self.transport.ack_on(c, d)

    def release(self, c: Tables, delivery: Delivery, delay_s: float) -> None:
        self.transport.release_on(c, delivery, delay_s)

    def give_up(self, c: Tables, leases: Sequence[Lease]) -> None:
        self.store.renew_on(c, leases, 0.0)

    def wait(self, timeout_s: float) -> None:
        self.transport.wait(timeout_s)


def open_flow(store: Store, transport: Transport) -> Flow | None:
    """The batch verbs over a memory store and the queue of its database; None
    unless both are that (the caller composes them apart)."""
    if isinstance(store, MemoryStore) and isinstance(transport, MemoryTransport) and transport.db is store.db:
        return Shared(MemorySides(store, transport), rides=RIDES)
    return None
