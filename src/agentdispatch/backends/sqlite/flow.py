"""The worker's batch verbs on SQLite: queue and store statements of one
transaction, on the connection it passes them."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ...errors import LeaseLost
from ...stores.base import Claim, Store
from ...transports.base import Delivery, Transport
from ...transports.flow import Flow, Shared, one_by_one
from ...workitem import Lease, Outcome, WorkItem
from .store import SqliteStore
from .transport import SqliteTransport, ack_many_on, get_on, release_on

#: One writer at a time: a claim riding in a commit's transaction holds no
#: fairness mark back from other claimants (they wait for the write lock anyway).
RIDES = 1_000


class SqliteSides:
    """The :class:`~agentdispatch.transports.flow.Sides` of one SQLite file."""

    def __init__(self, store: SqliteStore, transport: SqliteTransport) -> None:
        self.store = store
        self.transport = transport

    def tx(self, durable: bool) -> AbstractContextManager[sqlite3.Connection]:
        return self.store.db.tx(durable)

    def get(self, c: sqlite3.Connection, owner: str, n: int, visibility_s: float) -> list[tuple[Delivery, Any]]:
        return one_by_one(lambda: get_on(c, owner, visibility_s), n)

    def claim(
        self, c: sqlite3.Connection, jobs: Sequence[tuple[str, str, Any]], owner: str, ttl_s: float
    ) -> list[Claim]:
        return self.store.claim_on(c, [(j, t) for j, t, _ in jobs], owner=owner, ttl_s=ttl_s)

    def commit(self, c: sqlite3.Connection, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        return self.store.commit_on(c, done)

    def poison(self, c: sqlite3.Connection, raw: str, reason: str) -> None:
        self.store.poison_on(c, raw, reason)

    def ack(self, c: sqlite3.Connection, deliveries: Sequence[Delivery]) -> None:
        ack_many_on(c, deliveries)

    def release(self, c: sqlite3.Connection, delivery: Delivery, delay_s: float) -> None:
        release_on(c, delivery, delay_s)

    def give_up(self, c: sqlite3.Connection, leases: Sequence[Lease]) -> None:
        self.store.renew_on(c, leases, 0.0)

    def wait(self, timeout_s: float) -> None:
        self.transport.wait(timeout_s)


def open_flow(store: Store, transport: Transport) -> Flow | None:
    """The batch verbs over a SQLite store and the queue in its file; None
    unless both are that (the caller composes them apart)."""
    if isinstance(store, SqliteStore) and isinstance(transport, SqliteTransport) and transport.db is store.db:
        return Shared(SqliteSides(store, transport), rides=RIDES)
    return None
