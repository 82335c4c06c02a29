"""Small, hot PostgreSQL tables back to their size after a long transaction.

The admission counters, the waiting claimers' marks and the fairness rows are
a few rows each, updated in place by every submission and claim. While a
transaction holds the cleanup horizon every update leaves a row version
behind and these tables grow to hundreds of pages. Vacuum frees the versions
afterwards but truncates only empty pages at the end, and the live rows sit
wherever they were updated last: every submission and claim then keeps
reading all those pages. A rewrite (``VACUUM FULL``) gives a table back the
pages its rows need, in milliseconds at these sizes.

A rewrite holds the table's exclusive lock, so it asks with ``SKIP_LOCKED``:
it never waits in the lock queue, where every submission and claim would wait
behind it; it tries again a moment later instead. Nothing is rewritten while
an old transaction is open (the rewrite would have to copy every version it
may still see), nor a table that is not far larger than its rows need, which
also makes concurrent workers' passes harmless: the second finds the table
small. Plain autocommit statements only: nothing here needs a session.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial

from psycopg import sql

from .db import Conn, PgDb
from .tx import Q

#: The tables a pass looks at: a few rows each whatever the load, read by
#: every submission or claim.
HOT_TABLES = ("dispatch_depth", "dispatch_waiting", "dispatch_fair_groups", "dispatch_fair_tenants")
#: A table this small is left alone whatever its rows need: reading it costs little.
MIN_PAGES = 32
#: A table is rewritten once it is more than this many times the pages its rows need.
SLACK = 4
#: Tries per table and pass at its lock, and the pause between tries: each
#: submission or claim holds it for a moment only.
TRIES = 40
PAUSE_S = 0.005
#: How long a table found full of live rows is not counted again.
RECOUNT_S = 60.0
#: Page bytes for rows, and the per-row cost besides ``pg_column_size``'s (the line pointer).
PAGE_BYTES, ROW_EXTRA = 8000, 4


def _rewrite(conn: Conn, table: str) -> bool | None:
    """``VACUUM FULL`` of ``table`` if its lock is free this instant: True when
    it was rewritten (a rewrite gives the table a new file), False when its lock
    was busy, None when it is small already (another worker rewrote it)."""
    file_of = sql.SQL("SELECT pg_relation_filenode({t}) AS f, pg_relation_size({t}) / 8192 AS pages").format(
        t=sql.Literal(table)
    )
    before = conn.execute(file_of).fetchone()
    if before is None or int(before["pages"]) < MIN_PAGES:
        return None
    conn.execute(sql.SQL("VACUUM (FULL, SKIP_LOCKED) {}").format(sql.Identifier(table)), prepare=False)
    after = conn.execute(file_of).fetchone()
    return after is not None and before["f"] != after["f"]


class Compactor:
    """Rewrites the hot tables far larger than their rows need (see the
    module). A table past :data:`MIN_PAGES` that its rows do fill (a large
    backlog's fairness rows) is counted again only after :data:`RECOUNT_S`."""

    def __init__(
        self, db: PgDb, *, clock: Callable[[], float] = time.monotonic, pause: Callable[[float], None] = time.sleep
    ) -> None:
        self.db = db
        self.clock = clock
        self.pause = pause
        self._full_until: dict[str, float] = {}

    def __call__(self, quiet_s: float) -> list[str]:
        """Rewrite what needs it, unless a transaction open ``quiet_s`` or
        longer remains; the tables rewritten. A table whose lock stayed busy
        is left to the next call."""
        done: list[str] = []
        for table in self.db.read(lambda c: self._bloated(c, quiet_s)):
            for attempt in range(TRIES):
                if attempt:
                    self.pause(PAUSE_S)
                rewritten = self.db.read(partial(_rewrite, table=table))
                if rewritten:
                    done.append(table)
                if rewritten is not False:  # rewritten, or by another worker meanwhile
                    break
        return done

    def _bloated(self, conn: Conn, quiet_s: float) -> list[str]:
        """The hot tables worth a rewrite now; none while an old transaction is open."""
        oldest = conn.execute(Q["oldest_snapshot"]).fetchone()
        if oldest is not None and float(oldest["age_s"]) >= quiet_s:
            return []
        rows = conn.execute(Q["hot_table_pages"], {"names": list(HOT_TABLES), "min_pages": MIN_PAGES}).fetchall()
        now = self.clock()
        out: list[str] = []
        for row in rows:
            table = str(row["relname"])
            if self._full_until.get(table, now) > now:
                continue
            # Exact, and read only for a table already past MIN_PAGES.
            live = conn.execute(
                sql.SQL("SELECT count(*) AS n, coalesce(sum(pg_column_size(t.*)), 0) AS bytes FROM {} t").format(
                    sql.Identifier(table)
                )
            ).fetchone()
            used = 0 if live is None else int(live["bytes"]) + ROW_EXTRA * int(live["n"])
            if int(row["pages"]) > SLACK * max(1, math.ceil(used / PAGE_BYTES)):
                out.append(table)
            else:
                self._full_until[table] = now + RECOUNT_S
        return out
