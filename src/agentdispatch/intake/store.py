"""Intake tables over the WorkItem store's own transactions, so a receipt and
its WorkItem commit together (SQLite and PostgreSQL share one query file)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, Protocol, TypeVar

from ..sqlfiles import queries
from ..stores.base import Store

T = TypeVar("T")


class IntakeTx(Protocol):
    """What intake code needs from one open store transaction."""

    def now(self) -> float:
        """Database time."""


@cache
def _dialect(name: str) -> dict[str, str]:
    q = queries("agentdispatch.intake", "queries.sql")
    if name == "sqlite":
        return q
    # psycopg's paramstyle; no query of ours has a literal ':' or '%'.
    return {k: re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", v) for k, v in q.items()}


class Sql:
    """Named queries on one open transaction of the WorkItem store."""

    def __init__(self, tx: Any, dialect: str) -> None:
        self.tx = tx
        self.q = _dialect(dialect)
        self.dialect = dialect

    def now(self) -> float:
        """Database time (one value per transaction)."""
        return float(self.tx.now())

    def _exec(self, name: str, /, params: dict[str, Any]) -> Any:
        if self.dialect == "postgres":
            self.tx.flush()  # the engine's buffered writes go first
        return self.tx.c.execute(self.q[name], params)

    def one(self, name: str, /, **params: Any) -> dict[str, Any] | None:
        """The first row, as a dict."""
        row = self._exec(name, params).fetchone()
        return None if row is None else dict(row)

    def all(self, name: str, /, **params: Any) -> list[dict[str, Any]]:
        """Every row, as dicts."""
        return [dict(r) for r in self._exec(name, params).fetchall()]

    def run(self, name: str, /, **params: Any) -> int:
        """Execute a write; the number of rows it touched."""
        return int(self._exec(name, params).rowcount)

    def count(self, name: str, /, **params: Any) -> int:
        """The ``n`` column of a one-row query."""
        row = self.one(name, **params)
        return 0 if row is None else int(row["n"])


class IntakeStore:
    """Intake reads and writes, each in a transaction of ``store``."""

    def __init__(self, store: Store) -> None:
        if store.name not in ("sqlite", "postgres"):
            raise ValueError(f"durable intake needs the SQLite or PostgreSQL store, not {store.name}")
        self.store = store

    @contextmanager
    def tx(self, durable: bool = True) -> Iterator[Sql]:
        """One write transaction of the WorkItem store (the engine may join it)."""
        with self.store.transaction(durable=durable) as tx:  # type: ignore[attr-defined]
            yield Sql(tx, self.store.name)

    def durable(self, fn: Callable[[Sql], T]) -> T:
        """Run ``fn`` in a durable transaction; on SQLite concurrent callers share
        one commit and fsync (the store's group commit, a savepoint each)."""
        group = getattr(self.store, "group", None)
        if group is not None:
            return group.run(lambda tx: fn(Sql(tx, self.store.name)))  # type: ignore[no-any-return]
        if self.store.name == "postgres":
            # A commit that notifies (a new WorkItem wakes workers) holds a
            # cluster-wide lock until it is flushed, so durable intakes took
            # turns at the disk. Commit without waiting for the flush, then
            # wait for it outside that lock: concurrent intakes share flushes.
            with self.tx(durable=False) as sql:
                result = fn(sql)
            self.store.db.flush_wal()  # type: ignore[attr-defined]
            return result
        with self.tx(durable=True) as sql:
            return fn(sql)

    def read(self, name: str, /, **params: Any) -> list[dict[str, Any]]:
        """A short read-only query (runs in its own transaction)."""
        with self.tx(durable=False) as sql:
            return sql.all(name, **params)

    def receipt(self, receipt_id: str) -> dict[str, Any] | None:
        """One receipt row."""
        rows = self.read("receipt_get", id=receipt_id)
        return rows[0] if rows else None

    def receipt_by_source(self, connector: str, source_id: str) -> dict[str, Any] | None:
        """The receipt of one source identity."""
        rows = self.read("receipt_by_source", connector=connector, source_id=source_id)
        return rows[0] if rows else None

    def scrub(self, age_s: float = 7 * 86400.0) -> int:
        """Clear the bodies of terminal receipts older than ``age_s``; identities stay."""
        with self.tx() as sql:
            now = sql.now()
            return sql.run("scrub", now=now, cutoff=now - age_s)
