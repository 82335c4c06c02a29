"""Contract: the leases of a worker whose process is gone end at once, on
every backend: its turns go back to ready with the attempt counted (or to the
dead-letter queue on their last one) and its row goes; a live worker's leases
and row stay."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from agentdispatch import LeaseLost, Status, Submission
from agentdispatch.fleet import process_label
from agentdispatch.reconciler import reap_dead_workers, take_over
from agentdispatch.stores.base import ClaimKind, WorkerRow
from agentdispatch.workitem import Outcome

from .helpers import wait_until


def _row(worker_id: str, process: str) -> WorkerRow:
    return WorkerRow(worker_id, "host-x", 4, (), "test", 0.0, process=process)


def _dead_label() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    label = process_label(child.pid)
    child.wait()
    return label


def test_a_dead_workers_leases_end_and_a_live_ones_stay(harness, caplog: pytest.LogCaptureFixture):
    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="echo", tenant="t", session_id=f"s{i}")).job_id for i in range(3)]
    harness.store.heartbeat(_row("w-dead", _dead_label()))
    harness.store.heartbeat(_row("w-live", process_label()))
    harness.store.heartbeat(_row("w-elsewhere", "another-host/1/1"))
    owners = ["w-dead:0", "w-dead:1", "w-live:0"]
    for job, owner in zip(jobs, owners, strict=True):
        wait_until(lambda j=job, o=owner: harness.store.claim(j, "t", owner=o, ttl_s=300).kind is ClaimKind.CLAIMED)

    with caplog.at_level(logging.WARNING, logger="agentdispatch.reconciler"):
        report = reap_dead_workers(harness.store, harness.transport)

    assert (report.reclaimed, report.dead_lettered) == (2, 0)
    assert [r.getMessage() for r in caplog.records if r.name == "agentdispatch.reconciler"] == [
        "worker w-dead is gone (its process ended): 2 turn(s) back to ready, 0 dead-lettered"
    ]
    for job in jobs[:2]:
        item = harness.store.get(job, "t")
        assert (item.status, item.reason, item.attempt) == (Status.READY, "lease_expired", 1)
    assert harness.store.get(jobs[2], "t").status is Status.RUNNING
    assert {w.worker_id for w in harness.store.workers()} == {"w-live", "w-elsewhere"}
    # The turns run again at once, not after their 300 s lease.
    for job in jobs[:2]:
        wait_until(lambda j=job: harness.store.claim(j, "t", owner="w-next:0", ttl_s=30).kind is ClaimKind.CLAIMED)
        assert harness.store.get(job, "t").attempt == 2
    assert reap_dead_workers(harness.store, harness.transport).total == 0


def test_a_turn_on_its_last_attempt_goes_to_the_dead_letter_queue(make_harness):
    h = make_harness(max_attempts=1)
    job = h.dispatcher().submit(Submission(kind="echo", tenant="t")).job_id
    h.store.heartbeat(_row("w-dead", _dead_label()))
    wait_until(lambda: h.store.claim(job, "t", owner="w-dead:0", ttl_s=300).kind is ClaimKind.CLAIMED)

    report = reap_dead_workers(h.store, h.transport)

    assert (report.reclaimed, report.dead_lettered) == (0, 1)
    item = h.store.get(job, "t")
    assert (item.status, item.reason) == (Status.DEAD_LETTER, "lease_exhausted")


def test_a_worker_starting_under_a_name_takes_over_its_earlier_incarnation(harness, caplog: pytest.LogCaptureFixture):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t")).job_id
    harness.store.heartbeat(_row("pod-0@old", ""))  # its process cannot be checked from here
    wait_until(lambda: harness.store.claim(job, "t", owner="pod-0@old:0", ttl_s=300).kind is ClaimKind.CLAIMED)

    assert reap_dead_workers(harness.store, harness.transport).total == 0
    assert take_over(harness.store, harness.transport, "pod-1@new").total == 0  # another name
    with caplog.at_level(logging.WARNING, logger="agentdispatch.reconciler"):
        assert take_over(harness.store, harness.transport, "pod-0@new").reclaimed == 1
    assert [r.getMessage() for r in caplog.records if r.name == "agentdispatch.reconciler"] == [
        "worker pod-0@new took over from pod-0@old: 1 turn(s) back to ready, 0 dead-lettered"
    ]

    assert harness.store.get(job, "t").status is Status.READY
    assert "pod-0@old" not in {w.worker_id for w in harness.store.workers()}


def _claim(h, job: str, owner: str):
    claims = []

    def claimed() -> bool:
        claims.append(h.store.claim(job, "t", owner=owner, ttl_s=300))
        return claims[-1].kind is ClaimKind.CLAIMED

    wait_until(claimed)
    return claims[-1].lease


def test_a_late_commit_of_a_lease_exhausted_turn_is_fenced_and_costs_its_batch_nothing(make_harness):
    # The worker was only slow (paused, or its commit waited out a database
    # outage): its commit comes after the reaper dead-lettered the turn. It
    # must be fenced like any lost lease, not fail the whole commit batch
    # (which the worker would retry, with every later turn, for good).
    h = make_harness(max_attempts=1)
    d = h.dispatcher()
    late, other = (d.submit(Submission(kind="echo", tenant="t", session_id=s)).job_id for s in ("a", "b"))
    h.store.heartbeat(_row("w-dead", _dead_label()))
    leases = {late: _claim(h, late, "w-dead:0"), other: _claim(h, other, "w-live:0")}
    assert reap_dead_workers(h.store, h.transport).dead_lettered == 1

    done = h.store.commit_many(
        [(leases[late], Outcome(ok=True, result=1)), (leases[other], Outcome(ok=True, result=2))]
    )

    assert isinstance(done[0], LeaseLost)
    assert not isinstance(done[1], LeaseLost) and done[1].status is Status.SUCCEEDED
    item = h.store.get(late, "t")
    assert (item.status, item.reason) == (Status.DEAD_LETTER, "lease_exhausted")
