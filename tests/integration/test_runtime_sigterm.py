"""SIGTERM with async turns in flight: the worker stops claiming, waits the
grace period, cancels what is left and releases those leases at once, so
another worker finishes them without waiting out the TTL; nothing is
committed falsely, and the turns left read ready again."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from agentdispatch import Status, Submission
from backends import Harness, kafka_harness, postgres_harness, sqlite_harness
from contract.helpers import wait_until
from runtimekit import runtime_worker, sink_lines


def _worker(env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    return runtime_worker(env, *extra, stderr=subprocess.PIPE)


def _sink_env(h: Harness, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The sink dir and a worker environment with the harness's long TTL."""
    sink = tmp_path / "sink"
    sink.mkdir()
    return sink, {**h.env, "AGENT_DISPATCH_CLAIM_TTL_S": "280", "RUNTIME_SINK_DIR": str(sink)}


def _stopped_mid_turns(env: dict[str, str], sink: Path, jobs: list[str], grace: str) -> bytes:
    """Run a worker until every job started, SIGTERM it; its stderr (it exits 0)."""
    worker = _worker(env, "--grace", grace)
    wait_until(lambda: len(sink_lines(sink, "start")) == len(jobs), timeout=60)
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err.decode()
    return err


def _finished_by_another(h: Harness, env: dict[str, str], sink: Path, jobs: list[str]) -> None:
    """A second worker (fast turns) runs every job to success, each effect once."""
    second = _worker({**env, "RUNTIME_APP_FAST": "1"}, "--grace", "5")
    try:
        wait_until(lambda: all(h.store.get(j, "t").status is Status.SUCCEEDED for j in jobs), timeout=120)
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=60)
    assert sorted(sink_lines(sink, "effect")) == sorted(jobs)


def test_sigterm_releases_turns_in_flight_to_another_worker(tmp_path: Path) -> None:
    # A TTL far beyond the test's patience: only a release lets the second worker in.
    h = sqlite_harness(tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink, env = _sink_env(h, tmp_path)
    try:
        d = h.dispatcher()
        jobs = [d.submit(Submission(kind="think", tenant="t")).job_id for _ in range(20)]
        assert b"released" in _stopped_mid_turns(env, sink, jobs, "1")
        for job in jobs:  # nothing committed: every turn is still to do, and reads so
            item = h.store.get(job, "t")
            assert item.status is Status.READY and item.result is None
        assert sink_lines(sink, "effect") == []
        _finished_by_another(h, env, sink, jobs)
    finally:
        h.close()


def test_a_sync_handler_past_the_grace_does_not_hold_the_process(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink, env = _sink_env(h, tmp_path)
    try:
        job = h.dispatcher().submit(Submission(kind="block", tenant="t")).job_id
        worker = _worker(env, "--grace", "1")
        try:
            wait_until(lambda: sink_lines(sink, "start") == [job], timeout=60)
            worker.send_signal(signal.SIGTERM)
            # The handler sleeps an hour: only an exit that abandons it ends in time.
            _, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert worker.returncode == 0, err.decode()
        assert b"released" in err and b"Traceback" not in err
        item = h.store.get(job, "t")
        # Released: back to ready, so the next claimer need not wait out the TTL.
        assert item.status is Status.READY and item.result is None and item.lease_expires_at is None
    finally:
        h.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "kafka"])
def test_turns_released_at_stop_read_ready_then_run_once(tmp_path: Path, backend: str) -> None:
    # No other worker runs: only the stopping worker can say its turns are no
    # longer running (the status view, `jobs --status`, the in-flight gauge).
    makers = {"sqlite": sqlite_harness, "postgres": postgres_harness, "kafka": kafka_harness}
    h = makers[backend](tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink, env = _sink_env(h, tmp_path)
    try:
        d = h.dispatcher()
        jobs = [d.submit(Submission(kind="think", tenant="t")).job_id for _ in range(3)]
        _stopped_mid_turns(env, sink, jobs, "0.5")
        for job in jobs:
            item = h.store.get(job, "t")
            assert (item.status, item.reason, item.attempt, item.result) == (Status.READY, "lease_expired", 1, None)
        assert h.store.workers() == []
        assert sink_lines(sink, "effect") == []

        # Back in the queue once each (Kafka: the given-back delivery and the
        # relayed envelope meet one item; one runs it, the other is skipped).
        _finished_by_another(h, env, sink, jobs)
    finally:
        h.close()
