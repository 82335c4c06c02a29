"""Re-delivers stranded ready items and reclaims expired leases (one pass per
``sweep_every(TTL)``, so recovery stays within one lease TTL), and ends at once
the leases of workers on this host whose process is gone (every second)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from .dispatch import Dispatcher
from .errors import AgentDispatchError
from .faults import recoverable
from .fleet import INCARNATION, earlier_incarnations, process_gone
from .horizon import HorizonWatch
from .policy import sweep_every
from .schedules import FIRE_EVERY_S, Schedules
from .settings import Settings, load_settings
from .stores.base import Fleet, Outbox, Repair, Store, SweepReport
from .transports.base import Sender, Transport

log = logging.getLogger("agentdispatch.reconciler")


class Repairable(Repair, Outbox, Protocol):
    """What one reconciler pass uses: the sweep, and the outbox it publishes."""


class Reapable(Repair, Outbox, Fleet, Protocol):
    """What a reaping pass uses: the workers' rows as well."""


#: Workers whose rows a reaping pass reads, by the age of their last heartbeat:
#: every row, so that the rows of killed workers do not pile up.
REAP_ROWS_S = 1e9


def _reap(store: Reapable, transport: Sender, worker_ids: list[str], why: str) -> SweepReport:
    """End the leases of the workers ``worker_ids`` (see :meth:`Repair.reap`),
    then publish what went back to ready. ``why`` tells the log what became
    of each worker (``{worker}`` stands for its id)."""
    report = SweepReport()
    for worker_id in worker_ids:
        got = store.reap(worker_id)
        if got.total:
            back, dead = got.reclaimed, got.dead_lettered
            log.warning("%s: %d turn(s) back to ready, %d dead-lettered", why.format(worker=worker_id), back, dead)
        report.reclaimed += got.reclaimed
        report.dead_lettered += got.dead_lettered
    if report.total:
        transport.relay(store)
    return report


def take_over(store: Reapable, transport: Sender, worker_id: str) -> SweepReport:
    """A named worker starting: end the leases of its name's earlier
    incarnations, which its start says are gone (a pod restarted under its
    name, in a new container whose processes no peer can check)."""
    rows = [w.worker_id for w in store.workers(max_age_s=REAP_ROWS_S)]
    return _reap(
        store, transport, earlier_incarnations(worker_id, rows), f"worker {worker_id} took over from {{worker}}"
    )


def release_at_stop(store: Reapable, transport: Sender, worker_id: str) -> SweepReport:
    """A worker stopping with turns it gave up (the grace period ran out):
    their items go back to ready now, as a gone worker's do, instead of
    reading ``running`` until some worker claims them; a store error leaves
    them to the next claim or reconciler pass (their leases already ran out)."""
    try:
        report = store.reap(worker_id)
        if report.total:
            transport.relay(store)
        return report
    except Exception as exc:
        if not recoverable(exc):
            raise
        log.warning("giving back the leases of the turns left at stop failed: %s", exc)
        return SweepReport()


def take_over_at_start(store: Reapable, transport: Sender, worker_id: str) -> None:
    """:func:`take_over` for a worker that starts, if it has a name; a store
    error only delays the turns (their leases run out)."""
    if INCARNATION not in worker_id:
        return
    try:
        take_over(store, transport, worker_id)
    except Exception as exc:
        if not recoverable(exc):
            raise
        log.warning("taking over from earlier incarnations failed (their leases run out): %s", exc)


def reap_dead_workers(store: Reapable, transport: Sender) -> SweepReport:
    """End the leases of the workers whose process, on this host, is gone (a
    SIGKILL, a crash, an out-of-memory kill), so their turns run again now
    rather than after the lease TTL; then publish what went back to ready.
    Workers on other hosts, or paused ones, are left to their TTL."""
    rows = store.workers(max_age_s=REAP_ROWS_S)
    gone = [w.worker_id for w in rows if w.process and process_gone(w.process)]
    return _reap(store, transport, gone, "worker {worker} is gone (its process ended)")


def reconcile_once(store: Repairable, transport: Sender) -> SweepReport:
    """One pass: repair the store, then publish whatever it re-enqueued."""
    report = store.sweep(redeliver_after_s=transport.redeliver_after_s)
    transport.relay(store)
    return report


class Reconciler:
    """A background thread running :func:`reconcile_once` periodically, and
    firing due periodic schedules (:mod:`agentdispatch.schedules`) every
    second between passes. ``settings`` bound the jobs it fires (admission,
    attempts); without them the process's environment is read on first use."""

    def __init__(self, store: Store, transport: Transport, ttl_s: float, settings: Settings | None = None) -> None:
        self.store = store
        self.transport = transport
        self.settings = settings
        self.every = sweep_every(ttl_s)
        self._schedules: Schedules | None = None
        self._horizon: HorizonWatch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)
        self.passes = 0

    def start(self) -> Reconciler:
        """Start the thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the current pass."""
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        next_sweep = time.monotonic() + self.every
        self._reap()
        while not self._stop.wait(max(0.0, min(FIRE_EVERY_S, next_sweep - time.monotonic()))):
            self._fire()
            self._reap()
            if time.monotonic() < next_sweep:
                continue
            next_sweep = time.monotonic() + self.every
            try:
                report = reconcile_once(self.store, self.transport)
                self.passes += 1
                if report.total:
                    log.info("reconciler repaired %s", report)
                self._watch_horizon()
            except Exception as exc:  # the thread must outlive any failed pass: it is the process's recovery
                if recoverable(exc):
                    log.warning("reconciler pass failed: %s", exc)
                else:
                    log.exception("reconciler pass failed")

    def _reap(self) -> None:
        try:
            reap_dead_workers(self.store, self.transport)
        except Exception as exc:  # as a failed pass: the next one tries again
            if recoverable(exc):
                log.warning("reaping dead workers failed: %s", exc)
            else:
                log.exception("reaping dead workers failed")

    def _watch_horizon(self) -> None:
        if self._horizon is None:
            settings = self.settings if self.settings is not None else load_settings()
            self._horizon = HorizonWatch(self.store, settings.pg_xmin_alert_s)
        self._horizon.check()

    def _fire(self) -> None:
        try:
            if self._schedules is None:
                settings = self.settings if self.settings is not None else load_settings()
                self._schedules = Schedules(Dispatcher(self.store, self.transport, settings))
            self._schedules.fire_due()
        except AgentDispatchError as exc:
            log.warning("schedule pass failed: %s", exc)
        except Exception:  # the reconciler must outlive a bad schedule row
            log.exception("schedule pass failed")
