"""Re-delivers stranded ready items and reclaims expired leases (one pass per
``sweep_every(TTL)``, so recovery stays within one lease TTL)."""

from __future__ import annotations

import logging
import threading

from .errors import AgentDispatchError
from .policy import sweep_every
from .stores.base import Store, SweepReport
from .transports.base import Transport

log = logging.getLogger("agentdispatch.reconciler")


def reconcile_once(store: Store, transport: Transport) -> SweepReport:
    """One pass: repair the store, then publish whatever it re-enqueued."""
    report = store.sweep(redeliver_after_s=transport.redeliver_after_s)
    transport.relay(store)
    return report


class Reconciler:
    """A background thread running :func:`reconcile_once` periodically."""

    def __init__(self, store: Store, transport: Transport, ttl_s: float) -> None:
        self.store = store
        self.transport = transport
        self.every = sweep_every(ttl_s)
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
        while not self._stop.wait(self.every):
            try:
                report = reconcile_once(self.store, self.transport)
                self.passes += 1
                if report.total:
                    log.info("reconciler repaired %s", report)
            except AgentDispatchError as exc:
                log.warning("reconciler pass failed: %s", exc)
