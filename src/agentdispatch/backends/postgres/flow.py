"""The worker's batch verbs on PostgreSQL: queue and store statements of one
transaction, on the pooled connection it passes them. The get that delivers
a turn also reads and locks its item, and the claim uses that read: one round
trip fewer per claim, and the read cannot outlive its transaction."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ...errors import LeaseLost
from ...stores.base import Claim, Store
from ...transports.base import Delivery, Transport
from ...transports.flow import Flow, Shared
from ...workitem import Lease, Outcome, WorkItem
from .db import Conn
from .store import PostgresStore
from .transport import PostgresTransport, ack_deferred, release_on

#: The fair claim marks tenant and group rows: one claim at most rides in a
#: commit's transaction, which holds those marks until it ends.
RIDES = 1


class PostgresSides:
    """The :class:`~agentdispatch.transports.flow.Sides` of one PostgreSQL database."""

    def __init__(self, store: PostgresStore, transport: PostgresTransport) -> None:
        self.store = store
        self.transport = transport

    def tx(self, durable: bool) -> AbstractContextManager[Conn]:
        # No retry of its own: a failed verb raises, and the worker retries it
        # after its back-off (a commit whose lease lapsed meanwhile is fenced).
        return self.store.db.transaction(durable)

    def get(self, c: Conn, owner: str, n: int, visibility_s: float) -> list[tuple[Delivery, Any]]:
        return self.transport.get_on(c, owner, visibility_s, n, read=True) if n > 0 else []

    def claim(self, c: Conn, jobs: Sequence[tuple[str, str, Any]], owner: str, ttl_s: float) -> list[Claim]:
        return self.store.claim_on(c, jobs, owner=owner, ttl_s=ttl_s)

    def commit(self, c: Conn, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        return self.store.commit_on(c, done)

    def poison(self, c: Conn, raw: str, reason: str) -> None:
        self.store.poison_on(c, raw, reason)

    def ack(self, c: Conn, deliveries: Sequence[Delivery]) -> None:
        ack_deferred(c, deliveries)

    def release(self, c: Conn, delivery: Delivery, delay_s: float) -> None:
        release_on(c, delivery, delay_s)

    def give_up(self, c: Conn, leases: Sequence[Lease]) -> None:
        self.store.renew_on(c, leases, 0.0)

    def wait(self, timeout_s: float) -> None:
        self.transport.wait(timeout_s)


def open_flow(store: Store, transport: Transport) -> Flow | None:
    """The batch verbs over a PostgreSQL store and the queue in its database;
    None unless both are that (the caller composes them apart)."""
    if isinstance(store, PostgresStore) and isinstance(transport, PostgresTransport) and transport.db is store.db:
        return Shared(PostgresSides(store, transport), rides=RIDES)
    return None
