"""Contract: turns whose process died with them run in ever smaller groups near
their last attempt, so a poison turn that kills its worker reaches the
dead-letter queue alone (reliability scenario 9)."""

from __future__ import annotations

import time

from agentdispatch import Status, Submission
from agentdispatch.stores.base import ClaimKind

from .helpers import wait_until


def _crash(harness, job_id: str, times: int) -> None:
    """Claim ``job_id`` ``times`` times by workers that die at once (their
    leases run out), then wait for the last lease to run out."""
    for n in range(times):
        owner = f"gone-{job_id[-6:]}-{n}:0"
        wait_until(lambda o=owner: harness.store.claim(job_id, "t", owner=o, ttl_s=0.05).kind is ClaimKind.CLAIMED)
    item = harness.store.get(job_id, "t")
    assert item.attempt == times and item.lease_expires_at is not None
    wait_until(lambda: time.time() > item.lease_expires_at + 0.05)


def test_a_suspect_on_its_last_attempt_runs_alone_in_its_process(harness):
    d = harness.dispatcher()
    a, b, fresh = (d.submit(Submission(kind="echo", tenant="t", session_id=f"s{i}")).job_id for i in range(3))
    _crash(harness, a, 4)
    _crash(harness, b, 4)

    first = harness.store.claim(a, "t", owner="p1:0", ttl_s=30)
    assert first.kind is ClaimKind.CLAIMED and first.item is not None and first.item.attempt == 5
    # b also has one attempt left: not beside a in the same process ...
    busy = harness.store.claim(b, "t", owner="p1:1", ttl_s=30)
    assert busy.kind is ClaimKind.BUSY and busy.retry_after_s > 0
    assert harness.store.get(b, "t").attempt == 4  # a deferral costs no attempt
    # ... while a fresh turn may, and another process takes b.
    assert harness.store.claim(fresh, "t", owner="p1:2", ttl_s=30).kind is ClaimKind.CLAIMED
    assert harness.store.claim(b, "t", owner="p2:0", ttl_s=30).kind is ClaimKind.CLAIMED
    assert harness.store.get(b, "t").status is Status.RUNNING


def test_suspects_with_attempts_to_spare_run_in_groups(harness):
    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="echo", tenant="t", session_id=f"s{i}")).job_id for i in range(5)]
    for j in jobs:
        _crash(harness, j, 3)  # two attempts left: groups of 4
    kinds = [harness.store.claim(j, "t", owner=f"p1:{i}", ttl_s=30).kind for i, j in enumerate(jobs)]
    assert kinds == [ClaimKind.CLAIMED] * 4 + [ClaimKind.BUSY]
