"""Retention off the request path: terminal intake bodies are scrubbed once
they are older than the retention (SPEC 9.7: 7 days by default,
``AGENT_DISPATCH_INTAKE_SCRUB_AGE_S``), while identities,
references and outcomes stay, so a late duplicate is still recognised."""

from __future__ import annotations

import logging
import threading

from ..errors import AgentDispatchError
from .base import IntakeStore

log = logging.getLogger(__name__)

#: Bodies of terminal receipts older than this are cleared.
RETENTION_S = 7 * 86400.0
#: How often the gateway looks (the first pass runs at start-up).
EVERY_S = 3600.0


class Scrubber:
    """A daemon thread that scrubs expired intake bodies every ``every_s``."""

    def __init__(self, istore: IntakeStore, *, every_s: float = EVERY_S, retention_s: float = RETENTION_S) -> None:
        self.istore = istore
        self.every_s = every_s
        self.retention_s = retention_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> int:
        """One pass; returns how many receipts were scrubbed."""
        n = self.istore.scrub(self.retention_s)
        if n:
            log.info("scrubbed the bodies of %d terminal intake receipts", n)
        return n

    def _loop(self) -> None:
        while True:
            try:
                self.run_once()
            except AgentDispatchError as exc:  # the store is down: try again next time
                log.warning("intake scrub failed (%s); retrying in %.0f s", type(exc).__name__, self.every_s)
            if self._stop.wait(self.every_s):
                return

    def start(self) -> Scrubber:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="intake-scrub", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread; a pass in progress finishes first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
