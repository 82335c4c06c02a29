"""The reconciler thread is a process's recovery: a pass that fails, with
whatever error, is reported and the next pass runs."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from agentdispatch.reconciler import Reconciler
from agentdispatch.stores.base import SweepReport
from backends import sqlite_harness


class _Failing:
    """The real SQLite store, whose first sweeps raise the given errors."""

    def __init__(self, store: Any, errors: list[BaseException]) -> None:
        self._store = store
        self._errors = errors
        self.calls = 0
        self.recovered = threading.Event()

    def sweep(self, **kw: Any) -> SweepReport:
        self.calls += 1
        if self._errors:
            raise self._errors.pop(0)
        report: SweepReport = self._store.sweep(**kw)
        self.recovered.set()
        return report

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_failed_passes_are_reported_and_the_next_pass_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = sqlite_harness(tmp_path)
    store = _Failing(h.store, [sqlite3.OperationalError("disk I/O error"), RuntimeError("a bug in a pass")])
    rec = Reconciler(store, h.transport, ttl_s=0.8).start()  # type: ignore[arg-type]
    try:
        assert store.recovered.wait(30), f"no pass succeeded after {store.calls} attempt(s)"
    finally:
        rec.stop()
        h.close()
    assert rec.passes >= 1 and store.calls >= 3
    messages = [r.getMessage() for r in caplog.records if r.name == "agentdispatch.reconciler"]
    assert any("disk I/O error" in m for m in messages), messages
    assert any(r.exc_info and "a bug in a pass" in str(r.exc_info[1]) for r in caplog.records), messages
