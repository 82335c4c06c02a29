"""The PostgreSQL transport: the store's ``agent_dispatch_queue`` table,
claimed with ``FOR UPDATE SKIP LOCKED`` in fair order (one statement).

Idle workers are woken by ``LISTEN``/``NOTIFY`` on one dedicated connection
per process; notifications are a hint only (they are lost behind PgBouncer in
transaction mode or when the listener dies), so waiting workers also poll.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from ...errors import DepthUnavailable, TaskQueueUnavailable
from ...sqlfiles import Queries
from ...transports.base import Delivery, Receipt
from .db import Conn, PgDb, describe, with_link_defaults
from .deadline import Deadlines

if TYPE_CHECKING:
    from ...stores.base import Outbox, Store

Q = Queries("agentdispatch.backends.postgres.sql", "transport.sql")
CHANNEL = "agent_dispatch_queue"
log = logging.getLogger("agentdispatch.backends.postgres.transport")
#: How often the listener probes its connection: a half-open one delivers
#: no notification and raises no error, however long it stays so.
PROBE_EVERY_S = 15.0
#: Seconds the listener waits for the answer of any of its statements before
#: it cuts the connection and starts a new one. TCP keepalives and
#: ``tcp_user_timeout`` end a link whose peer's kernel is gone, but not one
#: whose peer still acknowledges bytes and never answers (a paused server, a
#: stuck proxy or pooler); without this bound the listener waited on such a
#: link for good and never listened again.
PROBE_ANSWER_S = 10.0
#: Seconds the listener waits, after its LISTEN, for a notification that
#: another connection sent it. Until it arrives waiters poll at the fallback
#: rate, so a slow arrival only delays the longer poll interval.
HEAR_S = 5.0


class _Wakeup:
    """A generation counter: waiters return when it moves or on timeout.
    Subscribers are called at each move instead (an event loop waits on its
    own thread rather than parking one of ours)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._gen = 0
        self._subscribers: list[Callable[[int | None], None]] = []

    def subscribe(self, fn: Callable[[int | None], None]) -> Callable[[], None]:
        with self._cond:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._subscribers.remove(fn)

        return unsubscribe

    def generation(self) -> int:
        with self._cond:
            return self._gen

    def bump(self, waiters: int | None = None) -> None:
        """Move the counter; wake every waiter, or ``waiters`` of them (a
        notification says how many rows came: more waiters would only race
        the woken ones for them)."""
        with self._cond:
            self._gen += 1
            if waiters is None:
                self._cond.notify_all()
            else:
                self._cond.notify(waiters)
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(waiters)
            except Exception:  # a subscriber's failure must not stop the listener
                log.exception("a queue wake subscriber failed")

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._gen != seen, timeout=timeout)


class _Silent(Exception):
    """The listener's connection was cut: the server did not answer in time."""


class _Listener:
    """LISTEN on a dedicated connection; reconnects with backoff on failure.
    ``healthy`` tells waiters how often they must poll; ``pid`` (its backend,
    while healthy) is what claims mark their claimers waiting with (see
    ``dispatch_waiting`` in schema.sql)."""

    def __init__(self, uri: str, wake: _Wakeup) -> None:
        self.uri = uri
        self.wake = wake
        self.healthy = False
        self.pid: int | None = None
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._deadlines = Deadlines()
        self._thread = threading.Thread(target=self._run, name="pg-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                conn.cancel_safe(timeout=1.0)
        self._thread.join(timeout=5)

    def _answered(self, conn: psycopg.Connection[Any], sql: str) -> psycopg.Cursor[Any]:
        """Run ``sql``; a connection that gives no answer in time is cut."""
        with self._deadlines.watch(conn, PROBE_ANSWER_S) as ticket:
            try:
                return conn.execute(sql)
            except psycopg.Error:
                if ticket is not None and ticket.expired:
                    raise _Silent(f"no answer within {PROBE_ANSWER_S:g} s") from None
                raise

    def _woken(self, payload: str) -> None:
        # As many waiters as rows came (the payload of a bulk insert).
        self.wake.bump(int(payload) if payload.isdigit() else 1)

    def _hears(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether a notification sent by another connection reaches ``conn``.
        ``pg_listening_channels()`` cannot tell: behind PgBouncer in
        transaction mode the LISTEN stays on the pooled server connection
        that ran it, so the channel is listed while nothing is forwarded.
        The probe has a channel of its own: no other listener hears it."""
        probe = f"{CHANNEL}_probe_{secrets.token_hex(8)}"
        self._answered(conn, f"LISTEN {probe}")
        try:
            with (
                psycopg.connect(with_link_defaults(self.uri), autocommit=True) as other,
                self._deadlines.watch(other, PROBE_ANSWER_S),
            ):
                other.execute(f"NOTIFY {probe}")
            deadline = time.monotonic() + HEAR_S
            while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                for note in conn.notifies(timeout=min(left, 1.0), stop_after=1):
                    if note.channel == probe:
                        return True
                    self._woken(note.payload)
            return False
        finally:
            self._answered(conn, f"UNLISTEN {probe}")

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(with_link_defaults(self.uri), autocommit=True) as conn:
                    self._conn = conn
                    self._answered(conn, f"LISTEN {CHANNEL}")
                    # Behind a transaction-mode pooler LISTEN is a no-op: poll instead.
                    self.healthy = self._hears(conn)
                    if not self.healthy and not self._stop.is_set():  # a probe cut short by a stop says nothing
                        log.warning("LISTEN is not effective on this connection; polling only")
                    # Without LISTEN nobody is marked waiting: nothing would hear.
                    self.pid = conn.info.backend_pid if self.healthy else None
                    self.wake.bump()  # anything enqueued while we were away
                    if backoff > 0.1:
                        log.info("queue listener reconnected")
                    backoff = 0.1
                    last_probe = time.monotonic()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0, stop_after=1):
                            self._woken(note.payload)
                        if time.monotonic() - last_probe > PROBE_EVERY_S:
                            # A half-open connection delivers nothing: probe it,
                            # clearing killed processes' long-expired marks.
                            self._answered(conn, Q["forget_marks"])
                            last_probe = time.monotonic()
            except (psycopg.Error, OSError, _Silent) as exc:
                if self._stop.is_set():
                    break
                # Once an outage: its failed reconnects are only DEBUG.
                level = logging.WARNING if backoff == 0.1 else logging.DEBUG
                cause = str(exc) if isinstance(exc, _Silent) else describe(exc)
                log.log(level, "queue listener lost (%s); polling until it reconnects", cause)
            finally:
                self._conn = None
                self.healthy = False
                self.pid = None
            self._stop.wait(backoff)
            backoff = min(5.0, backoff * 2)


class PostgresTransport:
    """Envelopes in the PostgreSQL store's ``agent_dispatch_queue`` table."""

    name = "postgres"
    redeliver_after_s = 1.0

    def __init__(
        self, store: Store, *, poll_s: float = 0.25, fallback_poll_s: float = 0.05, listen: bool = True
    ) -> None:
        db = getattr(store, "db", None)
        if not isinstance(db, PgDb):
            raise TaskQueueUnavailable("TASK_QUEUE_BACKEND=postgres needs STATE_DB_URI=postgresql://...")
        self.db = db
        self.poll_s = poll_s
        self.fallback_poll_s = fallback_poll_s
        self._wake = _Wakeup()
        self._listener: _Listener | None = None
        self._listen = listen
        self._lock = threading.Lock()
        self._local = threading.local()
        #: The generation of the latest get of any thread: a waiter on a
        #: thread that never gets (the async worker waits off its claim
        #: thread) still returns for a notification that came since.
        self._last_seen: int | None = None

    def _ensure_listener(self) -> _Listener | None:
        if not self._listen:
            return None
        with self._lock:
            if self._listener is None:
                self._listener = _Listener(self.db.uri, self._wake)
                self._listener.start()
            return self._listener

    def ping(self) -> None:
        try:
            self.db.read(lambda c: c.execute(Q["probe"]).fetchall())
        except TaskQueueUnavailable:
            raise TaskQueueUnavailable(
                "the PostgreSQL queue table is unreachable or missing; "
                "check STATE_DB_URI and run `agentdispatch migrate`"
            ) from None

    def admit(self, n: int, max_depth: int) -> None:
        """Admission happens inside the store's submit transaction."""

    def relay(self, store: Outbox) -> int:
        """The store writes this table directly: nothing to relay."""
        return 0

    def _claim(self, owner: str, visibility_s: float, n: int) -> list[Delivery]:
        # One statement in autocommit: one round trip. Retrying after a lost
        # connection is safe: a claim that did commit only delays those rows.
        got = self.db.run(lambda c: self.get_on(c, owner, visibility_s, n, read=False), single=True, idempotent=True)
        return [d for d, _ in got]

    def get_on(
        self, conn: Conn, owner: str, visibility_s: float, n: int, *, read: bool
    ) -> list[tuple[Delivery, dict[str, Any] | None]]:
        """Up to ``n`` turns in fair order on ``conn`` (one statement). With
        ``read`` (inside a transaction that goes on to claim the items), each
        comes with its item row, read and locked by the same statement."""
        self._local.seen = self._last_seen = self._wake.generation()
        listener = self._listener
        mark = {
            "listener": listener.pid if listener is not None else None,
            # Outlives the longest wait between an idle claimer's claims.
            "mark_s": 2 * self.poll_s + 1.0,
        }
        # A function call (its plans are cached inside): a pending BEGIN rides with it.
        rows = conn.execute(Q["get"], {"owner": owner, "vis": visibility_s, "n": n, "read": read, **mark}).fetchall()
        return [
            (
                Delivery(
                    raw=row["envelope"],
                    receipt=Receipt(owner=owner, claimed_at=float(row["claimed_at"]), ref=int(row["id"])),
                    deliveries=int(row["deliveries"]),
                ),
                row if read and row["now"] is not None else None,
            )
            for row in rows
        ]

    def get(self, owner: str, *, visibility_s: float, wait_s: float) -> Delivery | None:
        deadline = time.monotonic() + wait_s
        while True:
            got = self._claim(owner, visibility_s, 1)
            left = deadline - time.monotonic()
            if got or left <= 0:
                return got[0] if got else None
            self.wait(left)

    def get_many(self, owner: str, n: int, *, visibility_s: float) -> list[Delivery]:
        """Up to ``n`` turns in fair order, in one statement."""
        return self._claim(owner, visibility_s, n) if n > 0 else []

    def wait(self, timeout_s: float) -> None:
        """Until a notification arrives after this thread's last empty get, or
        the next poll is due (at most ``timeout_s``)."""
        self._ensure_listener()
        seen = getattr(self._local, "seen", None)
        if seen is None:
            seen = self._last_seen if self._last_seen is not None else self._wake.generation()
        self._wake.wait(seen, min(self.arrival_poll_s(), max(0.0, timeout_s)))

    def on_arrival(self, fn: Callable[[int | None], None]) -> Callable[[], None]:
        """Call ``fn`` on the listener's thread at each notification, with how
        many rows it told of (None: unknown, such as after a reconnect); returns
        the unsubscribe. A hint, as for :meth:`wait`: poll every
        :meth:`arrival_poll_s` as well."""
        self._ensure_listener()
        return self._wake.subscribe(fn)

    def arrival_poll_s(self) -> float:
        """How long a waiter on :meth:`on_arrival` may go without a claim: the
        poll interval, shorter while no LISTEN is in effect (PgBouncer in
        transaction mode, the listener reconnecting)."""
        listener = self._listener
        return self.poll_s if listener is not None and listener.healthy else self.fallback_poll_s

    def ack(self, delivery: Delivery) -> bool:
        return self.ack_many([delivery])[0]

    def ack_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        if not deliveries:
            return []
        # A lost ack is only a redelivery (the store then answers "skipped").
        return self.db.run(lambda c: ack_on(c, deliveries), single=True, idempotent=True, patience_s=5.0)

    def release(self, delivery: Delivery, delay_s: float) -> None:
        self.db.run(lambda c: release_on(c, delivery, delay_s), single=True, idempotent=True)

    def depth(self) -> int:
        try:
            row = self.db.read(lambda c: c.execute(Q["depth"]).fetchone())
        except TaskQueueUnavailable as exc:
            raise DepthUnavailable(f"queue depth unavailable ({exc})") from None
        if row is None:
            raise DepthUnavailable("queue depth unavailable (no answer)")
        return int(row["n"])

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()


# The queue's statements on a connection: the transport's own (autocommit),
# and the batch verbs' (see ``flow.py``) in a transaction with the store's.


def _receipt(delivery: Delivery) -> dict[str, Any]:
    r = delivery.receipt
    return {"id": r.ref, "owner": r.owner, "claimed_at": r.claimed_at}


def ack_on(conn: Conn, deliveries: Sequence[Delivery]) -> list[bool]:
    """Delete the deliveries' rows still owned by their receipts (one statement)."""
    if len(deliveries) == 1:
        return [conn.execute(Q["ack"], _receipt(deliveries[0])).fetchone() is not None]
    params = {
        "ids": [d.receipt.ref for d in deliveries],
        "owners": [d.receipt.owner for d in deliveries],
        "claimed_at": [d.receipt.claimed_at for d in deliveries],
    }
    gone = {int(r["id"]) for r in conn.execute(Q["ack_many"], params, binary=True).fetchall()}
    return [d.receipt.ref in gone for d in deliveries]


def ack_deferred(conn: Conn, deliveries: Sequence[Delivery]) -> None:
    """:func:`ack_on` inside a transaction that does not need the answer. One
    delivery's DELETE rides with the transaction's next statement or its
    COMMIT: a single finished turn costs one round trip fewer (an error still
    fails the transaction as a whole). A batch's goes at once, as binary
    arrays: client-side binding of arrays would cost more than the round trip."""
    if len(deliveries) == 1:
        conn.defer(Q["ack"], _receipt(deliveries[0]))
    else:
        ack_on(conn, deliveries)


def release_on(conn: Conn, delivery: Delivery, delay_s: float) -> None:
    """Make the delivery's row visible again after ``delay_s``."""
    conn.execute(Q["release"], {**_receipt(delivery), "delay": max(0.0, delay_s)})
