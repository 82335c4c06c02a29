"""The SQLite transport: the store's ``agent_dispatch_queue`` table, claimed
with one ``BEGIN IMMEDIATE; UPDATE ... RETURNING; COMMIT``."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...errors import DepthUnavailable, TaskQueueUnavailable
from ...sqlfiles import Queries
from ...transports.base import Delivery, Receipt, ack_each, get_each
from .db import SqliteDb, clock

if TYPE_CHECKING:
    from ...stores.base import Outbox

Q = Queries("agentdispatch.backends.sqlite.sql", "transport.sql")


class SqliteTransport:
    """Envelopes in the same SQLite file as the WorkItems."""

    name = "sqlite"
    redeliver_after_s = 1.0

    def __init__(self, db: SqliteDb, *, poll_s: float = 0.05) -> None:
        self.db = db
        self.poll_s = poll_s
        self._wake = threading.Event()

    def ping(self) -> None:
        try:
            self.db.conn().execute("SELECT count(*) FROM agent_dispatch_queue WHERE 0").fetchone()
        except sqlite3.Error:
            raise TaskQueueUnavailable("the SQLite queue table is missing; run `agentdispatch migrate`") from None

    def admit(self, n: int, max_depth: int) -> None:
        """Admission happens inside the store's submit transaction."""

    def relay(self, store: Outbox) -> int:
        """The store writes this table directly: nothing to relay."""
        return 0

    def _get_once(self, owner: str, visibility_s: float) -> Delivery | None:
        with self.db.tx() as c:
            return get_on(c, owner, visibility_s)

    def get(self, owner: str, *, visibility_s: float, wait_s: float) -> Delivery | None:
        deadline = time.monotonic() + wait_s
        while True:
            got = self._get_once(owner, visibility_s)
            if got is not None or time.monotonic() >= deadline:
                return got
            self.wait(deadline - time.monotonic())

    def wait(self, timeout_s: float) -> None:
        """Until the next poll is due (at most ``timeout_s``)."""
        self._wake.wait(min(self.poll_s, max(0.0, timeout_s)))
        self._wake.clear()

    def ack(self, delivery: Delivery) -> bool:
        with self.db.tx() as c:
            return ack_on(c, delivery)

    def get_many(self, owner: str, n: int, *, visibility_s: float) -> list[Delivery]:
        return get_each(self, owner, n, visibility_s=visibility_s)

    def ack_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        return ack_each(self, deliveries)

    def release(self, delivery: Delivery, delay_s: float) -> None:
        with self.db.tx() as c:
            release_on(c, delivery, delay_s)

    def depth(self) -> int:
        try:
            c = self.db.conn()
            now = clock()
            return int(c.execute(Q["depth"], {"now": now}).fetchone()[0])
        except (sqlite3.Error, TaskQueueUnavailable) as exc:
            raise DepthUnavailable(f"queue depth unavailable ({type(exc).__name__})") from None

    def close(self) -> None:
        """The connections belong to the shared :class:`SqliteDb` (closed by the store)."""


# The queue's statements on an open transaction's connection: the transport's
# own, and the batch verbs' (see ``flow.py``), which run them in a transaction
# with the store's.


def get_on(c: sqlite3.Connection, owner: str, visibility_s: float) -> Delivery | None:
    """Deliver the next envelope in claim order to ``owner``."""
    now = clock()
    # Rows whose visibility ran out by now are searched again (see unhide); a
    # read finds whether any did for less than an update finding none.
    if c.execute(Q["hidden_due"], (now,)).fetchone() is not None:
        c.execute(Q["unhide"], (now,))
    row = c.execute(Q["get"], {"owner": owner, "now": now, "vis": visibility_s}).fetchone()
    if row is None:
        return None
    return Delivery(
        raw=row["envelope"],
        receipt=Receipt(owner=owner, claimed_at=now, ref=int(row["id"])),
        deliveries=int(row["deliveries"]),
    )


def _receipt_params(delivery: Delivery) -> dict[str, object]:
    r = delivery.receipt
    return {"id": r.ref, "owner": r.owner, "claimed_at": r.claimed_at}


def ack_on(c: sqlite3.Connection, delivery: Delivery) -> bool:
    """Delete the delivery's row if its receipt still owns it."""
    return c.execute(Q["ack"], _receipt_params(delivery)).rowcount == 1


def ack_many_on(c: sqlite3.Connection, deliveries: Sequence[Delivery]) -> None:
    """:func:`ack_on` for each delivery, one ``executemany``."""
    c.executemany(Q["ack"], [_receipt_params(d) for d in deliveries])


def release_on(c: sqlite3.Connection, delivery: Delivery, delay_s: float) -> None:
    """Make the delivery's row visible again after ``delay_s``."""
    c.execute(Q["release"], {**_receipt_params(delivery), "now": clock(), "delay": delay_s})
