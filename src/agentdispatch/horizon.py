"""Warn when a PostgreSQL transaction holds back the database's cleanup
horizon (reliability scenario 15). A forgotten REPEATABLE READ session, a
stuck migration or a paused client keeps every dead queue row from being
vacuumed, and claims slow down behind the bloat long before anything fails.
The fleet gauge ``oldest_xmin_age_seconds`` lets Prometheus alert on it; a
worker also says so in its log. Once no such transaction remains, a worker
also gives the small tables every turn updates in place back their size
(:class:`~agentdispatch.stores.base.Compaction`): vacuum alone leaves them as
large as they grew, and every submission and claim reads them whole."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .stores.base import Compaction, Horizon

log = logging.getLogger("agentdispatch.horizon")
#: How often a worker reads the horizon: one cheap catalog read.
CHECK_EVERY_S = 30.0
#: How often a worker looks for tables to compact: two catalog reads when none is due.
COMPACT_EVERY_S = 5.0
#: No compaction while a transaction this old is open: it could remove nothing
#: that transaction may still see.
QUIET_S = 10.0


class HorizonWatch:
    """Logs a warning once the oldest open transaction is ``alert_s`` old,
    and once more when it ended, and compacts the store's small tables when
    no transaction ``quiet_s`` old is open; :meth:`check` may be called as
    often as convenient (it reads the store at most every
    :data:`CHECK_EVERY_S`, and :data:`COMPACT_EVERY_S`)."""

    def __init__(
        self,
        store: object,
        alert_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        quiet_s: float = QUIET_S,
    ) -> None:
        self.store = store if isinstance(store, Horizon) and alert_s > 0 else None
        self.compactor = store if isinstance(store, Compaction) else None
        self.alert_s = alert_s
        self.quiet_s = quiet_s
        self.clock = clock
        self.held = False
        self._next = self._next_compact = 0.0

    def check(self) -> None:
        """Read the horizon and compact if due; store errors reach the caller."""
        now = self.clock()
        if self.store is not None and now >= self._next:
            self._next = now + CHECK_EVERY_S
            self._alert(self.store)
        if self.compactor is not None and now >= self._next_compact:
            self._next_compact = now + COMPACT_EVERY_S
            done = self.compactor.compact(quiet_s=self.quiet_s)
            if done:
                log.info("compacted %s: far larger than their rows needed (vacuum cannot shrink them)", ", ".join(done))

    def _alert(self, store: Horizon) -> None:
        oldest = store.oldest_snapshot()
        held = oldest is not None and oldest.age_s >= self.alert_s
        if held and not self.held and oldest is not None:
            log.warning(
                "%s has held a transaction open for %.0f s: PostgreSQL cannot vacuum the queue's dead rows "
                "meanwhile, and claims slow down; end it (pg_terminate_backend, or COMMIT/ROLLBACK PREPARED)",
                oldest.holder(),
                oldest.age_s,
            )
        elif self.held and not held:
            log.info("the long-open PostgreSQL transaction ended; vacuum can clean up again")
        self.held = held
