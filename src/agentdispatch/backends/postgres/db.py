"""PostgreSQL connections shared by the PostgreSQL store and transport.

A :class:`psycopg_pool.ConnectionPool` of autocommit connections. Every write
is one explicit transaction run by :meth:`PgDb.run`, which retries it when the
database certainly rolled it back (a stale pooled connection after a restart,
a deadlock, a serialization failure) and otherwise raises
:class:`TaskQueueUnavailable`. No session state is used on the correctness
path (transaction-level locks and settings only), so a PgBouncer in
transaction mode in front of the database changes nothing.

Error messages never echo the connection URI: they name the error class only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.abc import Params, Query
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool

from ...errors import TaskQueueUnavailable, explained
from .deadline import Deadlines

T = TypeVar("T")
log = logging.getLogger("agentdispatch.postgres")
INTRANS, INERROR = TransactionStatus.INTRANS, TransactionStatus.INERROR


class Conn(psycopg.Connection[DictRow]):
    """An autocommit connection whose ``BEGIN``, and whose deferred writes,
    travel with the next statement (or the ``COMMIT``) in one simple-protocol
    message: one round trip instead of two or three. Order is kept: pending
    text always runs before the statement it rides with. A statement that must
    stay server-side prepared (``prepare=True``: a costly plan) or binary goes
    alone, after the pending text."""

    _begin: str | None = None
    _tail: list[str] | None = None
    _mogrifier: psycopg.ClientCursor[DictRow] | None = None

    def _mogrify(self, query: Query, params: Params | None) -> str:
        """Client-side binding into SQL text, by one cursor kept per connection
        (a new cursor copies the adapters map: several times a turn)."""
        if self._mogrifier is None:
            self._mogrifier = psycopg.ClientCursor(self)
        return self._mogrifier.mogrify(query, params)

    def hold_begin(self, sql: str) -> None:
        """Send ``sql`` (a BEGIN) with the next statement."""
        self._begin = sql

    def defer(self, query: str, params: Params | None) -> None:
        """Send a write with the next statement or the COMMIT (its errors
        surface there: the transaction fails as a whole either way)."""
        if self._tail is None:
            self._tail = []
        self._tail.append(self._mogrify(query, params))

    def discard(self) -> bool:
        """Forget pending text; True when the BEGIN was never sent."""
        unsent = self._begin is not None
        self._begin, self._tail = None, None
        return unsent

    def send_pending(self) -> None:
        """Send pending text now (before a statement that cannot carry it)."""
        parts = self._pending()
        if parts:
            super().execute("\n;\n".join(parts).encode())

    def _pending(self) -> list[str]:
        parts = ([] if self._begin is None else [self._begin]) + (self._tail or [])
        self._begin, self._tail = None, None
        return parts

    def fetch_sets(self, reads: list[tuple[str, Params | None]]) -> list[list[DictRow]]:
        """The rows of each of ``reads`` (statements that return rows), sent
        after any pending text in one simple-protocol message: one round trip
        for all of them, run in order."""
        texts = [self._mogrify(query, params) for query, params in reads]
        cur = super().execute("\n;\n".join([*self._pending(), *texts]).encode())
        sets: list[list[DictRow]] = []
        while True:
            if cur.description is not None:
                sets.append(cur.fetchall())
            if not cur.nextset():
                break
        return sets[len(sets) - len(reads) :]  # the pending text returns no rows

    def execute(
        self, query: Query, params: Params | None = None, *, prepare: bool | None = None, binary: bool = False
    ) -> psycopg.Cursor[DictRow]:
        if (self._begin is not None or self._tail) and not prepare and not binary and isinstance(query, str):
            text = query if params is None else self._mogrify(query, params)
            cur = super().execute("\n;\n".join([*self._pending(), text]).encode())
            while cur.nextset():
                pass  # the answer is the last statement's
            return cur
        self.send_pending()
        return super().execute(query, params, prepare=prepare, binary=binary)  # type: ignore[arg-type]


#: Errors after which the transaction certainly rolled back: run it again. A
#: unique violation is a concurrent insert of the same key (two submissions of
#: one job id): run again, the transaction finds that row and answers with it.
_RETRY_NOW = (
    pg_errors.DeadlockDetected,
    pg_errors.SerializationFailure,
    pg_errors.LockNotAvailable,
    pg_errors.UniqueViolation,
)
#: A pooler in transaction mode lost (or mixed up) a server-side prepared statement.
_PREPARED_LOST = (pg_errors.InvalidSqlStatementName, pg_errors.DuplicatePreparedStatement)
#: A transaction whose client stops answering in the middle of it (a paused
#: worker: SIGSTOP, a frozen VM) loses its session after this long, so the
#: queue rows and items it locked do not hold every other worker up while the
#: kernel keeps its connection alive. Ours never wait this long between
#: statements; set per transaction, so it works through PgBouncer too.
IDLE_IN_TX = "SET LOCAL idle_in_transaction_session_timeout = 5000"
#: Claims and renewals may commit asynchronously: a lost one is redone.
BEGIN_ASYNC = f"BEGIN; SET LOCAL synchronous_commit = off; {IDLE_IN_TX}"
BEGIN_DURABLE = f"BEGIN; SET LOCAL synchronous_commit = on; {IDLE_IN_TX}"
SYNC_COMMIT = "SET LOCAL synchronous_commit = on"
NOW_SQL = "SELECT extract(epoch FROM clock_timestamp())::float8 AS now"
FLUSH_WAL = "BEGIN; SET LOCAL synchronous_commit = on; SELECT pg_current_xact_id(); COMMIT"


def describe(exc: BaseException) -> str:
    """A credential-free description of a database error."""
    if isinstance(exc, psycopg.Error) and exc.sqlstate:
        return f"{type(exc).__name__}, SQLSTATE {exc.sqlstate}"
    return type(exc).__name__


#: What to do about an error the server reported, by SQLSTATE: an operator
#: told to check the URI while the server's disk is full looks in the wrong place.
_HINTS = {
    "53100": "the database server's disk is full: free space on its data volume",
    "53200": "the database server is out of memory",
    "53300": "the database server has no connection slot left: raise its max_connections or run fewer processes",
    "57P01": "the database server is shutting down",
    "57P02": "the database server is shutting down",
    "57P03": "the database server is starting up",
    # A table of ours is missing: the schema was never created where
    # STATE_DB_URI points (its search_path included).
    "42P01": "a table is missing: run `agentdispatch migrate`",
}


def hint(exc: BaseException) -> str:
    """What an operator should look at for ``exc``."""
    state = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    if state is None or state.startswith("08"):
        return "check STATE_DB_URI and that the server is up"
    return _HINTS.get(state, "see the PostgreSQL server's log")


def rolled_back(exc: psycopg.Error, conn: psycopg.Connection[Any] | None) -> bool:
    """Whether a statement or COMMIT that failed with ``exc`` certainly did not
    commit: the server answered with an error and the session lives on. A lost
    connection (or one the server ended) leaves a COMMIT's outcome unknown."""
    state = exc.sqlstate
    return conn is not None and not conn.broken and state is not None and not state.startswith(("08", "57P"))


class _QuietPool(logging.Filter):
    """psycopg_pool logs connection failures with host and port: keep only a
    credential-free line (the pool retries in the background), and only one
    every :data:`POOL_WARN_EVERY_S`. During an outage every pool of a process
    fails each retry, which buried the lines that say what is going on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.last = -POOL_WARN_EVERY_S

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        record.msg = "PostgreSQL pool: a connection attempt failed (will retry)"
        record.args = ()
        now = self.clock()
        if now - self.last >= POOL_WARN_EVERY_S:
            self.last = now
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("psycopg.pool").isEnabledFor(logging.DEBUG)


#: At most one pool connection-failure warning a process this often.
POOL_WARN_EVERY_S = 30.0


def _quiet_pool_logs() -> None:
    logger = logging.getLogger("psycopg.pool")
    if not any(isinstance(f, _QuietPool) for f in logger.filters):
        logger.addFilter(_QuietPool())


#: Seconds the pool retries a lost connection (doubling its delay each time)
#: before it gives up; the next request that finds no connection starts again
#: at once. Over a long chain the delays grew to minutes, so after a long
#: outage the pool kept failing for about as long again.
RECONNECT_S = 5.0

#: Seconds a transaction waits for the server's answers before its connection
#: is cut (see deadline.py); ``AGENT_DISPATCH_PG_ANSWER_TIMEOUT_S``.
ANSWER_S = 30.0


class ServerSilent(Exception):
    """A transaction's connection was cut: the server did not answer in time."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no answer within {seconds:g} s")
        self.seconds = seconds


#: Seconds the start-up probe waits for a connection when the URI sets no connect_timeout.
PROBE_TIMEOUT_S = 5

#: libpq settings for every connection whose URI leaves them unset. A link
#: that goes silent (a dead host, a dropped NAT entry, a blackholed route)
#: then fails its connection within seconds, and the pool or the listener
#: starts a new one; without them a statement waits out the kernel's
#: retransmissions (about 15 minutes) and a connect never ends.
LINK_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


def with_link_defaults(uri: str) -> str:
    """``uri`` with :data:`LINK_DEFAULTS` for what it leaves unset; an
    invalid URI is returned as it is, for libpq to refuse."""
    try:
        given = conninfo_to_dict(uri)
    except psycopg.ProgrammingError:
        return uri
    return make_conninfo(uri, **{k: v for k, v in LINK_DEFAULTS.items() if k not in given})


#: Known causes of a failed connection, by the libpq message; never echoes
#: the host, port, user or database name.
_CAUSES = (
    ("Connection refused", "connection refused (is PostgreSQL running and listening there?)"),
    ("password authentication failed", "authentication failed"),
    ("no password supplied", "authentication failed (no password supplied)"),
    ("pg_hba.conf", "authentication failed (no pg_hba.conf entry for this client)"),
    ("role", "authentication failed (no such role)"),
    ("database", "no such database (create it, then run `agentdispatch migrate`)"),
    ("resolve host", "host name not found"),
    ("translate host name", "host name not found"),
    ("timeout expired", "connection timed out"),
    ("timed out", "connection timed out"),
    ("SSL negotiation", "the server there does not speak the PostgreSQL protocol"),
    ("No route to host", "no route to host"),
    ("Network is unreachable", "network unreachable"),
    ("too many clients", "the server has no free connection slots"),
    ("remaining connection slots", "the server has no free connection slots"),
    ("starting up", "the server is starting up"),
    ("shutting down", "the server is shutting down"),
    ("recovery mode", "the server is in recovery"),
    ("closed the connection", "the server closed the connection (is it PostgreSQL, and accepting connections?)"),
)


def connection_cause(exc: BaseException) -> str:
    """Why a connection failed, in a few credential-free words."""
    text = str(exc)
    for needle, cause in _CAUSES:
        if needle in text and (needle not in ("role", "database") or "does not exist" in text):
            return cause
    return describe(exc)


def probe(uri: str) -> None:
    """Open and close one connection, so an unreachable or missing database is
    reported at once with its cause (the pool would retry in the background
    and answer a timeout after many seconds)."""
    try:
        conninfo = uri
        if "connect_timeout" not in conninfo_to_dict(uri):
            conninfo = make_conninfo(uri, connect_timeout=PROBE_TIMEOUT_S)
    except psycopg.ProgrammingError:
        raise TaskQueueUnavailable("STATE_DB_URI is not a valid PostgreSQL connection URI") from None
    try:
        psycopg.connect(conninfo).close()
    except psycopg.Error as exc:
        raise explained(
            TaskQueueUnavailable(f"cannot connect to PostgreSQL at STATE_DB_URI: {connection_cause(exc)}")
        ) from None


class PgDb:
    """A pool of autocommit connections and the transaction runner."""

    def __init__(
        self,
        uri: str,
        *,
        max_size: int = 32,
        timeout_s: float = 10.0,
        prepared: bool = True,
        answer_s: float | None = ANSWER_S,
    ) -> None:
        _quiet_pool_logs()
        self.uri = uri
        #: How long a transaction may wait for the server's answers (None: for good).
        self.answer_s = answer_s or None
        self.deadlines = Deadlines()
        # Server-side prepared statements outlive a transaction: behind a pooler
        # in transaction mode (PgBouncer before 1.21) the next transaction gets
        # another server connection. The first such failure turns them off for
        # this process (the failed transaction certainly rolled back: retried).
        self.prepared = prepared
        self.pool: ConnectionPool[Conn] = ConnectionPool(
            with_link_defaults(uri),
            kwargs={"autocommit": True, "row_factory": dict_row, "prepare_threshold": 5 if prepared else None},
            connection_class=Conn,
            min_size=1,
            max_size=max_size,
            timeout=timeout_s,
            open=False,
            name="agentdispatch",
            reconnect_timeout=RECONNECT_S,
        )
        self.pool.open(wait=False)

    def close(self) -> None:
        """Close the pool and every connection."""
        self.pool.close(timeout=5.0)

    def _unavailable(self, exc: BaseException, what: str) -> TaskQueueUnavailable:
        """The error to raise for ``exc``; a lost prepared statement also turns
        them off, so the caller's next transaction works."""
        if isinstance(exc, _PREPARED_LOST):
            self._unprepare()
        return explained(TaskQueueUnavailable(f"PostgreSQL {what} failed ({describe(exc)}); {hint(exc)}"))

    @contextmanager
    def _connection(self, timeout: float | None = None, answer_s: float | None = None) -> Iterator[Conn]:
        """A pooled connection; a transaction on it still waiting for the
        server after ``answer_s`` (default :attr:`answer_s`) has it cut."""
        with self.pool.connection(timeout=timeout) as conn:
            if not self.prepared and conn.prepare_threshold is not None:
                conn.prepare_threshold = None
            with self.deadlines.watch(conn, answer_s or self.answer_s) as ticket:
                try:
                    yield conn
                except psycopg.Error:
                    if ticket is not None and ticket.expired:
                        raise ServerSilent(ticket.seconds) from None
                    raise

    def _silent(self, exc: ServerSilent, committing: bool) -> TaskQueueUnavailable:
        unknown = "; the outcome is unknown" if committing else ""
        return TaskQueueUnavailable(
            f"PostgreSQL did not answer within {exc.seconds:g} s (AGENT_DISPATCH_PG_ANSWER_TIMEOUT_S): "
            f"the server may be paused, overloaded or waiting on a lock; the connection was cut{unknown}"
        )

    def _unprepare(self) -> None:
        if self.prepared:
            self.prepared = False
            log.warning(
                "a server-side prepared statement was lost (a pooler in transaction mode?): "
                "turned them off; set AGENT_DISPATCH_PG_PREPARED_STATEMENTS=0 to start that way"
            )

    def read(self, fn: Callable[[Conn], T]) -> T:
        """Run an idempotent read; after a connection error, check the pool
        (dropping connections a restart broke) and try once more."""
        for attempt in (1, 2):
            try:
                with self._connection() as conn:
                    return fn(conn)
            except ServerSilent as exc:
                raise self._silent(exc, False) from None
            except _PREPARED_LOST as exc:
                self._unprepare()
                if attempt == 2:
                    raise self._unavailable(exc, "read") from None
            except psycopg.OperationalError as exc:
                if attempt == 2:
                    raise self._unavailable(exc, "read") from None
                self._check()
            except psycopg.Error as exc:
                raise self._unavailable(exc, "read") from None
        raise AssertionError("unreachable")

    def _check(self) -> None:
        with contextlib.suppress(psycopg.Error):  # the next attempt reports it
            self.pool.check()

    @staticmethod
    @contextmanager
    def _begin(conn: Conn, durable: bool) -> Iterator[None]:
        """BEGIN ... COMMIT on an autocommit connection. BEGIN and the commit
        mode travel in one simple-protocol message with the first statement.
        (psycopg's pipeline mode was measured slower here: it syncs on entry
        and exit and polls the socket more often than a plain round trip.)"""
        # Lazily: the BEGIN rides with the first statement (and a deferred
        # last write with the COMMIT).
        conn.hold_begin(BEGIN_DURABLE if durable else BEGIN_ASYNC)
        try:
            yield
        except BaseException:
            if not conn.discard() and not conn.closed and conn.info.transaction_status in (INTRANS, INERROR):
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
            raise
        if conn.info.transaction_status == INERROR:
            # A failed statement whose error was swallowed: COMMIT would roll back silently.
            conn.discard()
            conn.execute("ROLLBACK")
            raise psycopg.errors.InFailedSqlTransaction("transaction aborted by an earlier error")
        if conn._begin is not None and not conn._tail:
            conn.discard()  # nothing ran: no transaction to end
            return
        conn.execute("COMMIT")

    @contextmanager
    def transaction(self, durable: bool) -> Iterator[Conn]:
        """One transaction on a pooled connection (no retry), whose connection
        the caller passes to every statement of it (the worker's batch verbs
        run queue and store statements so: see ``flow.py``). Non-durable
        transactions commit asynchronously: losing one in a crash is safe,
        because the next durable commit flushes the WAL written before it."""
        try:
            with self._connection() as conn, self._begin(conn, durable):
                yield conn
        except ServerSilent as exc:
            raise self._silent(exc, True) from None
        except psycopg.Error as exc:
            raise self._unavailable(exc, "transaction") from None

    def run(
        self,
        fn: Callable[[Conn], T],
        *,
        durable: bool = False,
        idempotent: bool = False,
        patience_s: float = 0.0,
        single: bool = False,
        answer_s: float | None = None,
    ) -> T:
        """Run ``fn`` in one transaction. A transaction that certainly rolled
        back is retried: at once after a deadlock or a stale pooled connection,
        and for up to ``patience_s`` seconds while the database restarts. When
        the connection dies during COMMIT the outcome is unknown: only an
        ``idempotent`` transaction is retried then. ``single``: ``fn`` runs one
        statement in autocommit (one round trip; always durable). A server
        that does not answer within ``answer_s`` (default :attr:`answer_s`)
        fails it at once, with no retry."""
        deadline = time.monotonic() + patience_s
        attempt = 0
        while True:
            attempt += 1
            committing = False
            used: Conn | None = None
            # Waiting for a pooled connection counts against the patience too
            # (while the database is down the pool cannot hand one out).
            wait_s = max(1.0, min(self.pool.timeout, deadline - time.monotonic()))
            try:
                with self._connection(timeout=wait_s, answer_s=answer_s) as conn:
                    used = conn
                    if single:
                        committing = True
                        return fn(conn)
                    with self._begin(conn, durable):
                        result = fn(conn)
                        committing = True
                    return result
            except ServerSilent as exc:
                raise self._silent(exc, committing and not idempotent) from None
            except _PREPARED_LOST as exc:
                self._unprepare()
                if attempt >= 5:
                    raise self._unavailable(exc, "transaction") from None
            except _RETRY_NOW as exc:
                if attempt >= 5:
                    raise self._unavailable(exc, "transaction") from None
            except psycopg.OperationalError as exc:
                if committing and not idempotent and not rolled_back(exc, used):
                    raise TaskQueueUnavailable(
                        f"PostgreSQL connection lost during COMMIT ({describe(exc)}); the outcome is unknown"
                    ) from None
                if attempt > 1 and time.monotonic() >= deadline:
                    raise self._unavailable(exc, "transaction") from None
                if attempt > 1:
                    time.sleep(min(0.5, 0.05 * attempt))
                self._check()
            except psycopg.Error as exc:
                raise self._unavailable(exc, "transaction") from None

    def flush_wal(self) -> None:
        """Return once every commit made before this call is on disk: a
        transaction with an id commits durably, and WAL is flushed in order.
        A transaction that committed asynchronously (``durable=False``) is
        durable after this."""
        self.run(lambda conn: conn.execute(FLUSH_WAL), single=True)

    def now(self) -> float:
        """Database time, seconds since the epoch."""

        def q(conn: Conn) -> float:
            row = conn.execute(NOW_SQL).fetchone()
            assert row is not None
            return float(row["now"])

        return self.read(q)


def scalar(conn: Conn, sql: str, params: Any = None) -> Any:
    """The first column of the first row (None when no row)."""
    row = conn.execute(sql, params).fetchone()
    return None if row is None else next(iter(row.values()))


def explain_nested(conn: psycopg.Connection[Any], sql: str, params: Any = None, *, analyze: bool = False) -> str:
    """The plans of the statements ``sql`` runs, including those inside its
    functions (``auto_explain``; needs a superuser to LOAD it). Runs ``sql``
    in a transaction that is rolled back: a claim really claims. For
    operators and tests: the fair claim lives in ``dispatch_claim``."""
    plans: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if "plan:" in text and "set_config(" not in text:  # not our own settings
            plans.append(text)

    with conn.transaction(force_rollback=True):
        conn.execute("LOAD 'auto_explain'")
        for name, value in (
            ("auto_explain.log_min_duration", "0"),
            ("auto_explain.log_nested_statements", "on"),
            ("auto_explain.log_analyze", "on" if analyze else "off"),
            ("auto_explain.log_timing", "off"),
            ("client_min_messages", "log"),
        ):
            conn.execute("SELECT set_config(%s, %s, true)", (name, value))
        conn.add_notice_handler(keep)
        try:
            cur = conn.execute(sql, params)
            if cur.description is not None:  # a statement without rows (an INSERT) has none
                cur.fetchall()
        finally:
            conn.remove_notice_handler(keep)
    return "\n".join(plans)
