"""SIGTERM with async turns in flight: the worker stops claiming, waits the
grace period, cancels what is left and releases those leases at once, so
another worker finishes them without waiting out the TTL; nothing is
committed falsely."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from agentdispatch import Status, Submission
from backends import sqlite_harness
from contract.helpers import wait_until
from runtimekit import runtime_worker, sink_lines


def _worker(env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    return runtime_worker(env, *extra, stderr=subprocess.PIPE)


def test_sigterm_releases_turns_in_flight_to_another_worker(tmp_path: Path) -> None:
    # A TTL far beyond the test's patience: only a release lets the second worker in.
    h = sqlite_harness(tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {**h.env, "AGENT_DISPATCH_CLAIM_TTL_S": "280", "RUNTIME_SINK_DIR": str(sink)}
    try:
        d = h.dispatcher()
        jobs = [d.submit(Submission(kind="think", tenant="t")).job_id for _ in range(20)]
        first = _worker(env, "--grace", "1")
        wait_until(lambda: len(sink_lines(sink, "start")) == len(jobs), timeout=60)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
        assert first.returncode == 0, err.decode()
        assert b"released" in err
        for job in jobs:  # nothing committed: every turn is still to do
            item = h.store.get(job, "t")
            assert item.status in (Status.RUNNING, Status.READY) and item.result is None
        assert sink_lines(sink, "effect") == []

        second = _worker({**env, "RUNTIME_APP_FAST": "1"}, "--grace", "5")
        try:
            wait_until(lambda: all(h.store.get(j, "t").status is Status.SUCCEEDED for j in jobs), timeout=120)
        finally:
            second.send_signal(signal.SIGTERM)
            second.communicate(timeout=60)
        assert sorted(sink_lines(sink, "effect")) == sorted(jobs)  # each effect once
    finally:
        h.close()


def test_a_sync_handler_past_the_grace_does_not_hold_the_process(tmp_path: Path) -> None:
    h = sqlite_harness(tmp_path, claim_ttl_s=280.0, renew_interval_s=5.0)
    sink = tmp_path / "sink"
    sink.mkdir()
    env = {**h.env, "AGENT_DISPATCH_CLAIM_TTL_S": "280", "RUNTIME_SINK_DIR": str(sink)}
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
        assert item.result is None and item.lease_expires_at is not None
        assert item.lease_expires_at <= time.time()  # released: the next claimer need not wait out the TTL
    finally:
        h.close()
