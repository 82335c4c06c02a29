"""SQLite connections shared by the SQLite store and transport: WAL,
``BEGIN IMMEDIATE`` for every write, ``busy_timeout``, and
``synchronous=FULL`` on the connections whose commits precede an
acknowledgement."""

from __future__ import annotations

import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path

from ...errors import TaskQueueUnavailable, explained
from .fs import network_type

BUSY_TIMEOUT_MS = 30_000
#: Free bytes under which an error opening or writing the file is read as a full disk.
FULL_DISK_BYTES = 1 << 20
#: WAL pages between automatic checkpoints. Hot pages (queue head, index
#: leaves) are rewritten by every turn: checkpointing less often writes each
#: of them to the file once.
WAL_CHECKPOINT_PAGES = 10_000
#: WAL pages between checkpoints while the disk has less free room than
#: :data:`LOW_ROOM_BYTES`: a checkpoint lets the WAL start over in the room it
#: already holds, so the turns' own commits cannot fill a small disk for good.
LOW_ROOM_CHECKPOINT_PAGES = 100
#: Twice the WAL's size at a usual checkpoint (4 KiB pages).
LOW_ROOM_BYTES = 2 * WAL_CHECKPOINT_PAGES * 4096
#: Bytes a WAL that starts over is cut back to while the room is low: the
#: room it took while the disk filled goes back to the database file.
LOW_ROOM_WAL_BYTES = 2 * LOW_ROOM_CHECKPOINT_PAGES * 4096
#: Seconds between two looks at the free room of the data dir.
ROOM_CHECK_S = 1.0


def clock() -> float:
    """The database clock of a SQLite file: the host's clock (SQLite's own
    ``julianday('now')`` reads the same one, at millisecond resolution, and
    costs a statement). Every process sharing the file shares this host."""
    return time.time()


class SqliteDb:
    """Thread-local connections to one WAL file (two per thread: a durable one
    with ``synchronous=FULL`` and a fast one with ``NORMAL``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        #: Every open connection with the thread it belongs to (None: shared).
        self._all: list[tuple[threading.Thread | None, sqlite3.Connection]] = []
        self._lock = threading.Lock()
        # Threads of one process queue on this mutex rather than on SQLite's
        # busy handler, which sleeps in steps of milliseconds.
        self._writer = threading.Lock()
        # Group commit: durable transactions of concurrent threads share one.
        self._batches = threading.Condition()
        self._batch: _Batch | None = None
        # One connection for every durable batch, whichever thread leads it:
        # its page cache stays valid from batch to batch (a connection that
        # finds the file changed by another one starts with an empty cache).
        self._batch_conn: sqlite3.Connection | None = None
        # The checkpoint interval the free room asks for, and the one each
        # connection (by id) was last given.
        self._checkpoint_pages = WAL_CHECKPOINT_PAGES
        self._room_checked = -ROOM_CHECK_S
        self._conn_pages: dict[int, int] = {}
        self._fs_checked = False

    def _open(self, durable: bool, owner: threading.Thread | None) -> sqlite3.Connection:
        if not self._fs_checked:
            kind = network_type(self.path)
            if kind is not None:
                raise TaskQueueUnavailable(
                    f"the SQLite file is on a network file system ({kind}), where WAL cannot keep "
                    "processes of two hosts apart; set AGENT_DISPATCH_DATA_DIR to a local disk or use PostgreSQL"
                )
            self._fs_checked = True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
            )
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise TaskQueueUnavailable(
                    "the SQLite file system does not support WAL; set AGENT_DISPATCH_DATA_DIR to a local disk"
                )
            conn.execute(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
            self._conn_pages.pop(id(conn), None)  # an id a closed connection had
            self._fit_checkpoints(conn)
            conn.execute("PRAGMA foreign_keys = OFF")
            # Statement journals in memory: inside a group commit's savepoint a
            # statement's journal is not truncated at its end but grows with
            # the savepoint, and past 64 KiB it spilled to a temporary file,
            # costing a write syscall per page every statement touched.
            conn.execute("PRAGMA temp_store = MEMORY")
        except (sqlite3.Error, OSError) as exc:
            if _corrupt(exc):
                raise  # no retry mends it: callers stop (a worker exits non-zero)
            raise self._unavailable("cannot open the SQLite queue", exc) from None
        with self._lock:
            self._close_orphans()
            self._all.append((owner, conn))
        return conn

    def _fit_checkpoints(self, conn: sqlite3.Connection) -> None:
        """Give ``conn`` the checkpoint interval the disk's free room allows
        (checked at most once per :data:`ROOM_CHECK_S`). Without it a disk
        with less room than the WAL grows to between checkpoints filled up
        with WAL frames, and every later write failed even after space was
        freed: no checkpoint ever came to let the WAL start over."""
        now = time.monotonic()
        if now - self._room_checked >= ROOM_CHECK_S:
            self._room_checked = now
            try:
                free = shutil.disk_usage(self.path.parent).free
            except OSError:
                free = 0
            self._checkpoint_pages = WAL_CHECKPOINT_PAGES if free >= LOW_ROOM_BYTES else LOW_ROOM_CHECKPOINT_PAGES
        pages = self._checkpoint_pages
        if self._conn_pages.get(id(conn)) != pages:
            conn.execute(f"PRAGMA wal_autocheckpoint = {pages}")
            limit = LOW_ROOM_WAL_BYTES if pages == LOW_ROOM_CHECKPOINT_PAGES else -1
            conn.execute(f"PRAGMA journal_size_limit = {limit}")
            self._conn_pages[id(conn)] = pages

    def _close_orphans(self) -> None:
        """Close the connections of threads that have ended. A server's thread
        pool retires idle threads and starts new ones, each opening its own
        connections: kept open, those piled up until the process ran out of
        file descriptors and stopped accepting connections."""
        kept = []
        for owner, conn in self._all:
            if owner is None or owner.is_alive():
                kept.append((owner, conn))
            else:
                self._conn_pages.pop(id(conn), None)
                with suppress(sqlite3.Error):
                    conn.close()
        self._all = kept

    def _unavailable(self, what: str, exc: BaseException) -> TaskQueueUnavailable:
        """One line for the operator: a full disk said plainly (SQLite reports
        it as several different errors), an error already explained as is."""
        if isinstance(exc, TaskQueueUnavailable):
            return exc
        try:
            full = shutil.disk_usage(self.path.parent).free < FULL_DISK_BYTES
        except OSError:
            full = False
        if full:
            message = f"{what}: the disk is full; free space under AGENT_DISPATCH_DATA_DIR"
            return explained(TaskQueueUnavailable(message))
        # SQLite's messages name no path; an OSError's would (kept out of logs).
        detail = str(exc) if isinstance(exc, sqlite3.Error) else type(exc).__name__
        return explained(TaskQueueUnavailable(f"{what} ({detail}); check AGENT_DISPATCH_DATA_DIR"))

    def conn(self, durable: bool = False) -> sqlite3.Connection:
        """This thread's connection of the given durability."""
        attr = "durable" if durable else "fast"
        conn: sqlite3.Connection | None = getattr(self._local, attr, None)
        if conn is None:
            conn = self._open(durable, threading.current_thread())
            setattr(self._local, attr, conn)
        return conn

    def tx(self, durable: bool = False) -> AbstractContextManager[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` write transaction on this thread's connection;
        durable ones are group-committed with those of other threads. A
        caller that writes store and queue rows together passes the
        connection on (see ``flow.py``): nothing here joins it implicitly."""
        return self._durable() if durable else self._immediate()

    @contextmanager
    def _immediate(self) -> Iterator[sqlite3.Connection]:
        conn = self.conn(durable=False)
        with self._writer:
            try:
                self._fit_checkpoints(conn)
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                if _corrupt(exc):
                    raise
                raise self._unavailable("SQLite queue unavailable", exc) from None
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                # A failed COMMIT (a full disk) may leave the transaction open,
                # holding the write lock on a connection this thread reuses.
                with suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise self._unavailable("SQLite commit failed", exc) from None

    @contextmanager
    def _durable(self) -> Iterator[sqlite3.Connection]:
        """Group commit with a ``with`` block: the first thread opens a
        ``synchronous=FULL`` transaction (the leader); threads arriving before
        it commits run their blocks in it too, each in its own savepoint, one
        at a time; one COMMIT (one fsync) makes them all durable, and only then
        does any of them return. A block that raises is rolled back alone."""
        with self._batches:
            batch = self._batch
            lead = batch is None or batch.sealed
            if lead:
                batch = self._batch = _Batch()
            assert batch is not None
            batch.joined += 1
        if lead:
            self._open_batch(batch)
        else:
            batch.opened.wait()
        ok = False
        try:
            if batch.error is not None:
                if _corrupt(batch.error):
                    raise batch.error
                raise self._unavailable("SQLite queue unavailable", batch.error)
            assert batch.conn is not None
            with batch.turn:
                conn = batch.conn
                conn.execute("SAVEPOINT member")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK TO member")
                    conn.execute("RELEASE member")
                    raise
                conn.execute("RELEASE member")
                ok = True
        finally:
            with self._batches:
                batch.finished += 1
                if batch.finished == batch.joined:  # only the leader waits for this
                    self._batches.notify_all()
            if lead:
                self._commit_batch(batch)
        if ok:
            batch.committed.wait()
            if batch.error is not None:
                raise self._unavailable("SQLite commit failed", batch.error)

    def _open_batch(self, batch: _Batch) -> None:
        try:
            self._writer.acquire()
            try:
                conn = self._batch_conn
                if conn is None:
                    conn = self._batch_conn = self._open(durable=True, owner=None)
                self._fit_checkpoints(conn)
                conn.execute("BEGIN IMMEDIATE")
            except BaseException:
                self._writer.release()
                raise
            batch.conn = conn
        except (sqlite3.Error, TaskQueueUnavailable) as exc:
            batch.error = exc
        finally:
            batch.opened.set()

    def _commit_batch(self, batch: _Batch) -> None:
        with self._batches:
            self._batches.wait_for(lambda: batch.finished == batch.joined)
            batch.sealed = True
        if batch.conn is None:  # never opened: nothing to commit
            batch.committed.set()
            return
        try:
            batch.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            batch.error = exc
            with suppress(sqlite3.Error):
                batch.conn.execute("ROLLBACK")
        finally:
            self._writer.release()
            batch.committed.set()

    def now(self) -> float:
        """Database time (the host clock, as SQLite reads it)."""
        return clock()

    def close(self) -> None:
        """Close every connection this object opened."""
        with self._lock:
            for _, conn in self._all:
                with suppress(sqlite3.Error):
                    conn.close()
            self._all.clear()
            self._conn_pages.clear()
            self._batch_conn = None
        self._local = threading.local()


def _corrupt(exc: BaseException) -> bool:
    """The file is damaged or not a database at all (not busy, locked or full)."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


class _Batch:
    """One group-committed durable transaction and its members."""

    def __init__(self) -> None:
        self.conn: sqlite3.Connection | None = None
        self.error: BaseException | None = None
        self.opened = threading.Event()
        self.committed = threading.Event()
        self.turn = threading.Lock()  # one member's block at a time
        self.joined = 0
        self.finished = 0
        self.sealed = False
