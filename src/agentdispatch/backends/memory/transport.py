"""The in-memory transport: the queue rows of a :class:`MemoryDb`, claimed in
the fair order of the SQL transports (expired deadlines first, then priority,
least-recently-served tenant, deadline, session order; one turn per session
at a time)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ...transports.base import Delivery, Receipt, ack_each, get_each
from .db import MemoryDb, QueueRow, Tables

if TYPE_CHECKING:
    from ...stores.base import Outbox

_LAST = float("inf")


class MemoryTransport:
    """Envelopes in the same :class:`MemoryDb` as the WorkItems."""

    name = "memory"
    redeliver_after_s = 1.0

    def __init__(self, db: MemoryDb) -> None:
        self.db = db

    def ping(self) -> None:
        """Always answers."""

    def admit(self, n: int, max_depth: int) -> None:
        """Admission happens inside the store's submit transaction."""

    def relay(self, store: Outbox) -> int:
        """The store writes the queue directly: nothing to relay."""
        return 0

    def _pick(self, t: Tables, now: float) -> QueueRow | None:
        visible = [r for r in t.queue.values() if r.visible_at <= now]
        late = [r for r in visible if r.deadline_unix is not None and r.deadline_unix <= now]
        if late:
            return min(late, key=lambda r: (r.deadline_unix, r.id))
        heads: dict[tuple[str, str], QueueRow] = {}
        for r in t.queue.values():
            key = (r.tenant, r.session_id)
            if key not in heads or (r.item_seq, r.id) < (heads[key].item_seq, heads[key].id):
                heads[key] = r
        eligible = [r for r in visible if heads[(r.tenant, r.session_id)] is r]
        if not eligible:
            return None
        return min(
            eligible,
            key=lambda r: (
                -r.priority,
                t.tenant_served.get(r.tenant, 0),
                _LAST if r.deadline_unix is None else r.deadline_unix,
                r.item_seq,
                r.id,
            ),
        )

    def _get_once(self, owner: str, visibility_s: float) -> Delivery | None:
        with self.db.tx() as t:
            return self.get_on(t, owner, visibility_s)

    def get_on(self, t: Tables, owner: str, visibility_s: float) -> Delivery | None:
        """Deliver the next envelope to ``owner`` in the open transaction of ``t``."""
        now = self.db.now()
        row = self._pick(t, now)
        if row is None:
            return None
        row = replace(
            row, claimed_by=owner, claimed_at=now, visible_at=now + visibility_s, deliveries=row.deliveries + 1
        )
        t.queue[row.id] = row
        t.tenant_served[row.tenant] = t.next_id("served")
        return Delivery(raw=row.envelope, receipt=Receipt(owner, now, row.id), deliveries=row.deliveries)

    def get(self, owner: str, *, visibility_s: float, wait_s: float) -> Delivery | None:
        deadline = time.monotonic() + wait_s
        while True:
            got = self._get_once(owner, visibility_s)
            if got is not None or time.monotonic() >= deadline:
                return got
            self.wait(deadline - time.monotonic())

    def get_many(self, owner: str, n: int, *, visibility_s: float) -> list[Delivery]:
        return get_each(self, owner, n, visibility_s=visibility_s)

    def wait(self, timeout_s: float) -> None:
        """Until a transaction commits (it may have enqueued), at most ``timeout_s``."""
        with self.db.arrived:
            self.db.arrived.wait(max(0.0, timeout_s))

    def _owned(self, t: Tables, delivery: Delivery) -> QueueRow | None:
        r = delivery.receipt
        row = t.queue.get(r.ref)
        return row if row is not None and (row.claimed_by, row.claimed_at) == (r.owner, r.claimed_at) else None

    def ack(self, delivery: Delivery) -> bool:
        with self.db.tx() as t:
            return self.ack_on(t, delivery)

    def ack_on(self, t: Tables, delivery: Delivery) -> bool:
        """:meth:`ack` in the open transaction of ``t``."""
        row = self._owned(t, delivery)
        if row is None:
            return False
        del t.queue[row.id]
        return True

    def ack_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        return ack_each(self, deliveries)

    def release(self, delivery: Delivery, delay_s: float) -> None:
        with self.db.tx() as t:
            self.release_on(t, delivery, delay_s)

    def release_on(self, t: Tables, delivery: Delivery, delay_s: float) -> None:
        """:meth:`release` in the open transaction of ``t``."""
        row = self._owned(t, delivery)
        if row is not None:
            t.queue[row.id] = replace(row, visible_at=self.db.now() + delay_s, claimed_by=None, claimed_at=None)

    def depth(self) -> int:
        now = self.db.now()
        with self.db.read() as t:
            return sum(1 for r in t.queue.values() if r.claimed_by is None or r.visible_at <= now)

    def close(self) -> None:
        """Nothing to release."""
