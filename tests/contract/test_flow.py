"""Contract: the worker's batch verbs (claim n, finish many, release many) on
every backend, as the factory composes them."""

from __future__ import annotations

import time

from agentdispatch import Status, Submission
from agentdispatch.factory import open_flow
from agentdispatch.stores.base import ClaimKind
from agentdispatch.transports.flow import Batch, Finished, Flow, TurnEnd
from agentdispatch.workitem import Outcome


def _claim(flow: Flow, n: int, owner: str = "w:1", timeout: float = 30.0) -> Batch:
    """Claim until ``n`` turns are held (a Kafka consumer joins its group first)."""
    deadline = time.monotonic() + timeout
    claimed, ends = [], []
    while len(claimed) < n:
        assert time.monotonic() < deadline, f"only {len(claimed)} of {n} claimed"
        batch = flow.claim(owner, n - len(claimed), ttl_s=30.0, wait_s=0.2)
        claimed += batch.claimed
        ends += batch.ends
    return Batch(claimed, ends, n, n)


def _submit(harness, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    subs = [Submission(kind="echo", tenant="t", session_id=f"s{i}", payload=i) for i in range(n)]
    return [h.job_id for h in harness.dispatcher().submit_many(subs)]


def test_claim_n_holds_each_item_under_a_lease(harness) -> None:  # type: ignore[no-untyped-def]
    ids = _submit(harness, 3)
    flow = open_flow(harness.store, harness.transport)
    batch = _claim(flow, 3)
    assert sorted(c.envelope.job_id for c in batch.claimed) == sorted(ids)
    for c in batch.claimed:
        assert c.claim.kind is ClaimKind.CLAIMED and c.claim.lease is not None
        assert harness.store.get(c.envelope.job_id, "t").status is Status.RUNNING
    # Nothing left: a claim asks for more than comes.
    assert flow.claim("w:1", 2, ttl_s=30.0).dry


def test_finish_many_commits_and_acknowledges_and_fences(harness) -> None:  # type: ignore[no-untyped-def]
    _submit(harness, 3)
    flow = open_flow(harness.store, harness.transport)
    claimed = _claim(flow, 3).claimed
    victim = claimed[1]
    harness.dispatcher().cancel(victim.envelope.job_id, "t")  # fences its lease
    done = [Finished(c.delivery, c.claim.lease, Outcome(ok=True, result=1)) for c in claimed]  # type: ignore[arg-type]
    ends, rode = flow.finish(done)
    assert ends == [TurnEnd.COMPLETED, TurnEnd.FENCED, TurnEnd.COMPLETED]
    assert rode.claimed == [] and not rode.dry
    statuses = [harness.store.get(c.envelope.job_id, "t").status for c in claimed]
    assert statuses == [Status.SUCCEEDED, Status.CANCELLED, Status.SUCCEEDED]
    # The fenced turn's delivery was given back: its next delivery is skipped.
    deadline = time.monotonic() + 30
    ends = []
    while TurnEnd.SKIPPED not in ends:
        assert time.monotonic() < deadline, "the fenced delivery never came back"
        ends += flow.claim("w:1", 1, ttl_s=30.0, wait_s=0.2).ends
    assert flow.claim("w:1", 1, ttl_s=30.0).claimed == []


def test_finish_claims_the_next_turns_where_it_can(harness) -> None:  # type: ignore[no-untyped-def]
    ids = _submit(harness, 4)
    flow = open_flow(harness.store, harness.transport)
    first = _claim(flow, 1).claimed[0]
    ends, rode = flow.finish(
        [Finished(first.delivery, first.claim.lease, Outcome(ok=True))],  # type: ignore[arg-type]
        then=2,
        owner="w:1",
        ttl_s=30.0,
    )
    assert ends == [TurnEnd.COMPLETED]
    # As many as the backend lets ride with the commit (none where the queue
    # lives elsewhere); the caller claims the rest.
    assert rode.asked <= 2 and len(rode.claimed) <= rode.asked
    rest = _claim(flow, 3 - len(rode.claimed)).claimed if len(rode.claimed) < 3 else []
    held = sorted(c.envelope.job_id for c in [*rode.claimed, *rest])
    assert held == sorted(set(ids) - {first.envelope.job_id})


def test_release_many_gives_turns_back_at_once(harness) -> None:  # type: ignore[no-untyped-def]
    _submit(harness, 2)
    flow = open_flow(harness.store, harness.transport)
    claimed = _claim(flow, 2).claimed
    flow.release([c.delivery for c in claimed], [c.claim.lease for c in claimed])  # type: ignore[misc]
    # Claimed again straight away (no TTL to wait out), under new leases.
    again = _claim(flow, 2).claimed
    epochs = {c.envelope.job_id: c.claim.lease.epoch for c in claimed}  # type: ignore[union-attr]
    assert {c.envelope.job_id: c.claim.lease.epoch - 1 for c in again} == epochs  # type: ignore[union-attr]
