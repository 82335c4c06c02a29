"""Contract: what an operator reads and purges on every store (the
dashboard's depth table, activity chart, job timeline and DLQ purge)."""

from __future__ import annotations

import time

from agentdispatch import Status, Submission
from agentdispatch.handlers import failure_outcome
from agentdispatch.stores.base import ClaimKind
from agentdispatch.workitem import Outcome


def _dead(h, job_id: str, tenant: str) -> None:
    """Claim and fail ``job_id`` once (max_attempts is 1): a dead letter whose
    attempt raised a real exception."""
    claim = h.store.claim(job_id, tenant, owner="worker-a", ttl_s=30)
    assert claim.kind is ClaimKind.CLAIMED and claim.lease is not None
    try:
        raise RuntimeError("downstream refused")
    except RuntimeError as exc:
        outcome = failure_outcome(exc)
    assert outcome is not None
    assert h.store.commit(claim.lease, outcome).status is Status.DEAD_LETTER


def test_depth_breakdown_counts_active_items_per_tenant_kind_and_status(make_harness):
    h = make_harness()
    d = h.dispatcher()
    for tenant, kind in (("a", "echo"), ("a", "echo"), ("a", "mail"), ("b", "echo")):
        d.submit(Submission(kind=kind, tenant=tenant))
    running = d.submit(Submission(kind="mail", tenant="b"))
    assert h.store.claim(running.job_id, "b", owner="w", ttl_s=30).kind is ClaimKind.CLAIMED
    done = d.submit(Submission(kind="echo", tenant="b"))
    lease = h.store.claim(done.job_id, "b", owner="w", ttl_s=30).lease
    assert lease is not None
    h.store.commit(lease, Outcome(ok=True))

    assert h.store.depth_breakdown(None) == [
        ("a", "echo", "ready", 2),
        ("a", "mail", "ready", 1),
        ("b", "echo", "ready", 1),
        ("b", "mail", "running", 1),
    ]
    assert h.store.depth_breakdown("a") == [("a", "echo", "ready", 2), ("a", "mail", "ready", 1)]
    assert h.store.depth_breakdown("nobody") == []


def test_activity_counts_accepted_and_finished_items_per_bucket(make_harness):
    h = make_harness()
    d = h.dispatcher()
    since = time.time() - 1800
    jobs = [d.submit(Submission(kind="echo", tenant="t")).job_id for _ in range(3)]
    d.submit(Submission(kind="echo", tenant="other"))
    lease = h.store.claim(jobs[0], "t", owner="w", ttl_s=30).lease
    assert lease is not None
    h.store.commit(lease, Outcome(ok=True))
    d.cancel(jobs[1], "t")

    act = h.store.activity("t", since=since, bucket_s=60)
    assert act.open_at_start == 0
    assert sum(act.created.values()) == 3 and all(29 <= b <= 31 for b in act.created)
    finished: dict[str, int] = {}
    for per in act.finished.values():
        for status, n in per.items():
            finished[status] = finished.get(status, 0) + n
    assert finished == {"succeeded": 1, "cancelled": 1}
    # Seen from after the submissions, the one still open counts at the start.
    later = h.store.activity("t", since=time.time() + 1, bucket_s=60)
    assert (later.open_at_start, later.created, later.finished) == (1, {}, {})
    assert sum(h.store.activity(None, since=since, bucket_s=60).created.values()) == 4


def test_history_has_payload_claim_event_and_traceback(make_harness):
    h = make_harness(max_attempts=1)
    job = h.dispatcher().submit(Submission(kind="echo", tenant="t", payload={"order": 7}))
    _dead(h, job.job_id, "t")
    hist = h.store.history(job.job_id, "t")
    assert hist["payload"] == {"order": 7}
    events = hist["events"]
    assert [e["event"] for e in events] == ["submitted", "claimed", "committed"]
    claimed, committed = events[1], events[2]
    assert (claimed["status"], claimed["detail"], claimed["attempt"]) == ("running", "worker-a", 1)
    assert events[0]["at"] <= claimed["at"] <= committed["at"]
    assert committed["detail"].startswith("worker-a: RuntimeError: downstream refused\nTraceback")
    assert 'raise RuntimeError("downstream refused")' in committed["detail"]
    assert hist["job"]["error"] == "RuntimeError: downstream refused"  # the item keeps the short error


def test_purge_deletes_only_the_tenants_dead_letters(make_harness):
    h = make_harness(max_attempts=1)
    d = h.dispatcher()
    dead = [d.submit(Submission(kind="echo", tenant="t")).job_id for _ in range(2)]
    for job_id in dead:
        _dead(h, job_id, "t")
    alive = d.submit(Submission(kind="echo", tenant="t")).job_id
    theirs = d.submit(Submission(kind="echo", tenant="u")).job_id
    _dead(h, theirs, "u")

    assert h.store.purge_dead([alive, theirs, "missing"], "t") == []  # nothing of it may go
    assert h.store.purge_dead([dead[1], dead[0], dead[1]], "t") == [dead[1], dead[0]]
    assert h.store.counts("t") == {"ready": 1}
    assert h.store.get(theirs, "u").status is Status.DEAD_LETTER
    assert h.store.purge_dead(dead, "t") == []  # a repeat finds nothing
    assert h.store.purge_dead([theirs], None) == [theirs]  # an operator purges any tenant's
    # The id is free again: a new job under it starts a fresh history.
    again = d.submit(Submission(kind="echo", tenant="t", job_id=dead[0]))
    assert [e["event"] for e in h.store.history(again.job_id, "t")["events"]] == ["submitted"]
