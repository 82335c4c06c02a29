"""The link of an async worker to PostgreSQL goes silent right after a lease
renewal, as its turn is about to run a side effect (reliability scenario 7).
No effect runs outside a lease the database renewed; the turn stops within
about a second of that lease running out; another worker finishes the turn
once it has; the effect happens once."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from agentdispatch import Status, Submission
from agentdispatch.dispatch import Dispatcher
from agentdispatch.errors import LeaseLost
from agentdispatch.lease import LeaseGuard
from agentdispatch.stores.base import Store
from backends import pg_harness_at
from contract.helpers import wait_until
from pg import PrivateCluster
from runtimekit import runtime_worker
from tcpproxy import FaultProxy, fault_proxy

TTL_S = 3.0
ENV = {"AGENT_DISPATCH_CLAIM_TTL_S": "3", "AGENT_DISPATCH_RENEW_INTERVAL_S": "1"}


@dataclass
class Rig:
    proxy: FaultProxy
    admin: psycopg.Connection[tuple[object, ...]]
    dispatcher: Dispatcher
    store: Store
    env: dict[str, str]
    sink: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def lines(self, word: str) -> list[list[str]]:
        return [ln.split() for f in self.sink.glob("*.log") for ln in f.read_text().splitlines() if ln.startswith(word)]

    def expires_at(self, job: str) -> float:
        at = self.store.get(job, "t").lease_expires_at
        assert at is not None
        return at

    def gate_turn(self, tmp: Path) -> tuple[str, Path]:
        """A turn running on a worker linked through the proxy, waiting for
        its go file before its side effect."""
        self.workers.append(runtime_worker({**self.env, "STATE_DB_URI": self.proxy.uri()}))
        go = tmp / "go"
        job = self.dispatcher.submit(Submission(kind="gate", tenant="t", payload={"go": str(go)})).job_id
        wait_until(lambda: bool(self.lines("start")), timeout=30)
        return job, go

    def right_after_a_renewal(self, job: str) -> None:
        first = self.expires_at(job)
        wait_until(lambda: self.expires_at(job) != first, timeout=10, every=0.005)

    def peer(self) -> None:
        """Another worker, on a link of its own."""
        self.workers.append(runtime_worker(self.env))

    def finished(self, job: str) -> None:
        wait_until(lambda: self.store.get(job, "t").status is Status.SUCCEEDED, timeout=30)

    def effects(self, job: str) -> list[tuple[int, float]]:
        """(epoch, wall time) of each effect of ``job``."""
        return [(int(e[2]), float(e[3])) for e in self.lines("effect") if e[1] == job]

    def stopped(self, job: str) -> float:
        wait_until(lambda: any(s[1] == job for s in self.lines("stopped")), timeout=30)
        return next(float(s[3]) for s in self.lines("stopped") if s[1] == job)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    cluster = PrivateCluster().start()
    try:
        h = pg_harness_at(cluster.uri(), lambda: None, claim_ttl_s=TTL_S, renew_interval_s=1.0)
        try:
            with fault_proxy(cluster.port) as proxy, psycopg.connect(cluster.uri(), autocommit=True) as admin:
                sink = tmp_path / "sink"
                sink.mkdir()
                env = {**h.env, **ENV, "RUNTIME_SINK_DIR": str(sink)}
                r = Rig(proxy, admin, h.dispatcher(), h.store, env, sink)
                try:
                    yield r
                finally:
                    proxy.resume()
                    for w in r.workers:
                        w.terminate()
                    assert [w.wait(timeout=60) for w in r.workers] == [0] * len(r.workers)
        finally:
            h.close()
    finally:
        cluster.destroy()


def _fence_check_held(rig: Rig, query: str = "%side_effects%") -> float:
    """When the transaction of a side effect's fence check (the only one
    whose text is like ``query``) began, once the server ran it and waits
    for the client (its answer held)."""

    def checking() -> list[tuple[object, ...]]:
        return rig.admin.execute(
            "SELECT extract(epoch FROM xact_start)::float8 FROM pg_stat_activity "
            "WHERE state = 'idle in transaction' AND query LIKE %s",
            (query,),
        ).fetchall()

    wait_until(lambda: bool(checking()), timeout=10, every=0.005)
    return float(str(checking()[0][0]))


def test_a_silent_link_stops_the_turn_before_its_effect(rig: Rig, tmp_path: Path) -> None:
    job, go = rig.gate_turn(tmp_path)
    rig.right_after_a_renewal(job)
    rig.proxy.blackhole()
    go.touch()
    rig.peer()
    expiry = rig.expires_at(job)
    stopped = rig.stopped(job)
    assert abs(stopped - expiry) < 1.0, stopped - expiry
    rig.finished(job)
    # The effect once, by the second attempt, after the first one's lease ran out.
    [(epoch, at)] = rig.effects(job)
    assert epoch == 2 and at > expiry


def test_an_effect_confirmed_after_its_lease_ran_out_never_runs(rig: Rig, tmp_path: Path) -> None:
    job, go = rig.gate_turn(tmp_path)
    rig.right_after_a_renewal(job)
    # The server gets the effect's fence check (which renews the lease from
    # the clock it reads) but its answer is held until that lease ran out.
    rig.proxy.blackhole(answers_only=True)
    go.touch()
    rig.peer()

    began = _fence_check_held(rig)
    rig.proxy.blackhole()  # no later renewal gets through either
    while time.time() < began + TTL_S + 0.1:
        time.sleep(0.01)
    rig.proxy.resume()
    stopped = rig.stopped(job)
    assert stopped - (began + TTL_S) < 1.0
    rig.finished(job)
    [(epoch, at)] = rig.effects(job)
    assert epoch == 2 and at > began + TTL_S


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_fence_check_answered_after_its_lease_ran_out_starts_no_effect(rig: Rig, flavour: str) -> None:
    # The guard alone (no worker watchdog, which may or may not stop the turn
    # first): the lease held by a claim of the test's own.
    job = rig.dispatcher.submit(Submission(kind="gate", tenant="t")).job_id
    lease = rig.store.claim(job, "t", owner="w:1", ttl_s=TTL_S).lease
    assert lease is not None
    linked = pg_harness_at(rig.proxy.uri(), lambda: None, claim_ttl_s=TTL_S, renew_interval_s=1.0)
    ran: list[int] = []
    raised: list[BaseException] = []
    try:
        guard = LeaseGuard(linked.store, lease, ttl_s=TTL_S, renew_interval_s=1.0)
        guard.renew()  # the store's connection and lazy reads are done before the fault

        async def effect_async() -> int:
            ran.append(1)
            return 1

        def call() -> None:
            try:
                if flavour == "sync":
                    guard.side_effect("send", lambda: ran.append(1))
                else:
                    asyncio.run(guard.side_effect_async("send", effect_async))
            except BaseException as exc:
                raised.append(exc)

        rig.proxy.blackhole(answers_only=True, new=False)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        began = _fence_check_held(rig, "%")  # the only transaction there is
        rig.proxy.blackhole(new=False)
        while time.time() < began + TTL_S + 0.1:
            time.sleep(0.01)
        rig.proxy.resume()
        caller.join(timeout=30)
        assert not caller.is_alive()
    finally:
        linked.close()
    assert ran == [] and len(raised) == 1 and isinstance(raised[0], LeaseLost), raised
    # Recorded as never run: a later attempt runs it.
    row = rig.admin.execute("SELECT state FROM side_effects WHERE job_id = %s", (job,)).fetchone()
    assert row is not None and row[0] == "failed"
