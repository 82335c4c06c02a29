"""A worker SIGKILLed with turns in flight: the worker started in its place on
the same host sees that the process is gone and runs those turns again at once,
not after the lease TTL (far beyond the test's patience here); so does one
restarted under the same name where the process cannot be checked. A paused
worker keeps its leases."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from agentdispatch import Status, Submission
from agentdispatch.reconciler import reap_dead_workers
from backends import Harness, postgres_harness, sqlite_harness
from contract.helpers import wait_until
from crashkit import pause_between_writes
from runtimekit import runtime_worker, sink_lines

TTL = {"AGENT_DISPATCH_CLAIM_TTL_S": "280", "AGENT_DISPATCH_RENEW_INTERVAL_S": "5"}


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _twenty_running(h: Harness, sink: Path, env: dict[str, str], workers: list[subprocess.Popen[bytes]]) -> list[str]:
    """Twenty turns, each in a session of its own, running in a new worker."""
    d = h.dispatcher()
    jobs = [d.submit(Submission(kind="think", tenant="t", session_id=f"s{i}")).job_id for i in range(20)]
    workers.append(runtime_worker(env))
    wait_until(lambda: sorted(sink_lines(sink, "start")) == sorted(jobs), timeout=60)
    return jobs


@pytest.mark.parametrize("build", [sqlite_harness, postgres_harness], ids=["sqlite", "postgres"])
def test_a_killed_workers_turns_run_again_at_once(tmp_path: Path, build: Callable[..., Harness]) -> None:
    h = build(tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {**h.env, **TTL, "RUNTIME_SINK_DIR": str(sink)}
    workers: list[subprocess.Popen[bytes]] = []
    try:
        jobs = _twenty_running(h, sink, env, workers)
        first = workers[0]
        paused = runtime_worker(env)  # a second worker, paused: alive, so its leases stay
        workers.append(paused)
        wait_until(lambda: len(h.store.workers()) == 2, timeout=60)
        pause_between_writes(paused, h.settings.sqlite_path if h.name == "sqlite" else None)
        first.kill()
        first.wait()

        workers.append(runtime_worker({**env, "RUNTIME_APP_FAST": "1"}))
        wait_until(lambda: all(h.store.get(j, "t").status is Status.SUCCEEDED for j in jobs), timeout=120)
        assert sorted(sink_lines(sink, "effect")) == sorted(jobs)  # each effect once
        assert {h.store.get(j, "t").attempt for j in jobs} == {2}
        alive = {w.worker_id for w in h.store.workers()}
        assert len(alive) == 2  # the killed worker's row went; the paused one's stayed
    finally:
        for w in workers:
            _stop(w)
        h.close()


def test_a_worker_restarted_under_its_name_takes_over_at_once(tmp_path: Path) -> None:
    # The killed incarnation ran where no peer can check its process (another
    # container of the same pod, say): only its name says that it is gone.
    h = sqlite_harness(tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {**h.env, **TTL, "RUNTIME_SINK_DIR": str(sink), "AGENT_DISPATCH_WORKER_NAME": "pod-0"}
    workers: list[subprocess.Popen[bytes]] = []
    try:
        jobs = _twenty_running(h, sink, env, workers)
        first = workers[0]
        [row] = h.store.workers()
        assert row.worker_id.startswith("pod-0@")
        first.kill()
        first.wait()
        with sqlite3.connect(cast(Any, h.store).db.path) as conn:
            conn.execute("UPDATE dispatch_workers SET process = ''")
        # Another name changes nothing: the turns stay with the dead worker.
        assert reap_dead_workers(cast(Any, h.store), h.transport).total == 0
        workers.append(runtime_worker({**env, "RUNTIME_APP_FAST": "1", "AGENT_DISPATCH_WORKER_NAME": "pod-1"}))
        wait_until(lambda: len(h.store.workers()) == 2, timeout=60)
        assert {h.store.get(j, "t").attempt for j in jobs} == {1}

        workers.append(runtime_worker({**env, "RUNTIME_APP_FAST": "1"}))
        wait_until(lambda: all(h.store.get(j, "t").status is Status.SUCCEEDED for j in jobs), timeout=120)
        assert sorted(sink_lines(sink, "effect")) == sorted(jobs)
        assert row.worker_id not in {w.worker_id for w in h.store.workers()}
    finally:
        for w in workers:
            _stop(w)
        h.close()
