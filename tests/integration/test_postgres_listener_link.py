"""A worker's LISTEN connection lost silently (reliability scenario 17): its
backend terminated, or its link blackholed (the sockets stay open and no byte
gets through, so neither an error nor a keepalive failure tells of it).
Turns submitted meanwhile are picked up within two poll intervals, and the
listener listens again on a new connection within 30 s."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from agentdispatch import Submission
from agentdispatch.dispatch import Dispatcher
from agentdispatch.stores.base import Store
from backends import pg_harness_at
from contract.helpers import wait_until
from pg import PrivateCluster
from runtimekit import runtime_worker
from tcpproxy import FaultProxy, fault_proxy

#: The PostgreSQL transport's poll interval while its listener looks healthy.
POLL_S = 0.25


@dataclass
class Rig:
    """A worker process whose every connection goes through ``proxy``."""

    proxy: FaultProxy
    admin: psycopg.Connection[tuple[object, ...]]
    dispatcher: Dispatcher
    store: Store
    sink: Path
    worker: subprocess.Popen[bytes]
    log: Path

    def listener(self) -> int | None:
        """The backend the worker's claims name as their listener (set only
        once its LISTEN took effect), while that backend lives."""
        row = self.admin.execute(
            "SELECT w.listener FROM dispatch_waiting w JOIN pg_stat_activity a ON a.pid = w.listener "
            "WHERE w.until > now() ORDER BY w.until DESC LIMIT 1"
        ).fetchone()
        return None if row is None else int(str(row[0]))

    def pickup_s(self, key: str) -> float:
        """Submit a turn; seconds from its submission to its handler's start."""
        job = self.dispatcher.submit(Submission(kind="stamp", tenant="t", idempotency_key=key)).job_id
        created = self.store.get(job, "t").created_at
        started: list[float] = []

        def seen() -> bool:
            started.extend(
                float(ln.split()[2])
                for f in self.sink.glob("*.log")
                for ln in f.read_text().splitlines()
                if ln.split()[1] == job
            )
            return bool(started)

        wait_until(seen, timeout=30, every=0.01)
        return started[0] - created


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    cluster = PrivateCluster().start()
    try:
        h = pg_harness_at(cluster.uri(), lambda: None)
        try:
            with fault_proxy(cluster.port) as proxy, psycopg.connect(cluster.uri(), autocommit=True) as admin:
                sink = tmp_path / "sink"
                sink.mkdir()
                env = {**h.env, "STATE_DB_URI": proxy.uri(), "RUNTIME_SINK_DIR": str(sink)}
                with (tmp_path / "worker.log").open("wb") as err:
                    worker = runtime_worker(env, stderr=err.fileno())
                try:
                    r = Rig(proxy, admin, h.dispatcher(), h.store, sink, worker, tmp_path / "worker.log")
                    r.pickup_s("warm-up")
                    wait_until(lambda: r.listener() is not None, timeout=30)
                    yield r
                finally:
                    proxy.resume()
                    worker.terminate()
                    assert worker.wait(timeout=60) == 0
        finally:
            h.close()
    finally:
        cluster.destroy()


def _listens_again(r: Rig, old: int) -> float:
    """Seconds until a backend other than ``old`` listens for the worker."""
    t0 = time.monotonic()
    wait_until(lambda: r.listener() not in (None, old), timeout=45, every=0.2)
    return time.monotonic() - t0


def _picked_up_promptly(took: list[float]) -> None:
    # Two poll intervals; the tail gets slack for a shared machine.
    assert statistics.median(took) <= 2 * POLL_S and max(took) < 4 * POLL_S, took


def test_a_terminated_listener_backend_listens_again(rig: Rig) -> None:
    old = rig.listener()
    assert old is not None
    rig.admin.execute("SELECT pg_terminate_backend(%s)", (old,))
    t0 = time.monotonic()
    took = [rig.pickup_s(f"after-kill-{i}") for i in range(5)]
    _picked_up_promptly(took)
    assert time.monotonic() - t0 + _listens_again(rig, old) < 30


def test_a_blackholed_listener_link_is_given_up_and_listens_again(rig: Rig) -> None:
    old = rig.listener()
    row = rig.admin.execute("SELECT client_port FROM pg_stat_activity WHERE pid = %s", (old,)).fetchone()
    assert row is not None
    # Only the listener's link: claims and commits go on through the others.
    assert rig.proxy.blackhole({int(str(row[0]))}) == 1
    t0 = time.monotonic()
    took = [rig.pickup_s(f"while-held-{i}") for i in range(5)]
    _picked_up_promptly(took)
    assert time.monotonic() - t0 + _listens_again(rig, old) < 30
    assert "queue listener lost (no answer within 10 s)" in rig.log.read_text()
    # The new listener wakes the worker: a turn starts well within a poll.
    assert min(rig.pickup_s(f"after-{i}") for i in range(3)) < POLL_S / 2
