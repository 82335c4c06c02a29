"""Contract: the batch verbs of the async runtime on every backend.
``ledger_many`` answers each ledger write as its own call would, in one
transaction; ``cancelled_since`` lists the jobs cancelled since a time."""

from __future__ import annotations

import dataclasses

from agentdispatch import LeaseLost, Submission
from agentdispatch.errors import EffectUnknown
from agentdispatch.stores.base import ClaimKind, LedgerOp


def _claimed(harness, n: int):
    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="echo", tenant="t")) for _ in range(n)]
    claims = [harness.store.claim(j.job_id, "t", owner="w:1", ttl_s=30) for j in jobs]
    assert all(c.kind is ClaimKind.CLAIMED for c in claims)
    return [c.lease for c in claims]


def test_ledger_many_answers_each_op_as_its_own_call_would(harness):
    a, b, c = _claimed(harness, 3)
    harness.store.cancel(c.job_id, "t")
    forged = dataclasses.replace(b, token="0" * 32)
    got = harness.store.ledger_many(
        [LedgerOp(a, "send-a", ttl_s=30), LedgerOp(b, "send-b", ttl_s=30), LedgerOp(c, "send-c", ttl_s=30)]
    )
    assert got[0] is None and got[1] is None  # both marked intended: run them
    assert isinstance(got[2], LeaseLost)  # the cancelled one wrote nothing
    # A second begin of a mark in flight in the same attempt is refused; a
    # forged lease is fenced; the settlements record the results.
    got = harness.store.ledger_many(
        [
            LedgerOp(a, "send-a", ttl_s=30),
            LedgerOp(forged, "send-x", ttl_s=30),
            LedgerOp(a, "send-a", "committed", {"id": 1}),
            LedgerOp(b, "send-b", "failed"),
        ]
    )
    assert isinstance(got[0], EffectUnknown) and isinstance(got[1], LeaseLost)
    assert got[2] is True and got[3] is True
    effects = {e["key"]: e for e in harness.store.history(a.job_id, "t")["side_effects"]}
    assert effects["send-a"]["state"] == "committed" and effects["send-a"]["result"] == {"id": 1}
    assert harness.store.history(c.job_id, "t")["side_effects"] == []
    assert harness.store.history(b.job_id, "t")["side_effects"][0]["state"] == "failed"
    # A recorded effect is answered, not begun again.
    (again,) = harness.store.ledger_many([LedgerOp(a, "send-a", ttl_s=30)])
    assert again is not None and again.state == "committed" and again.result == {"id": 1}
    assert harness.store.ledger_many([]) == []


def test_cancelled_since_lists_the_cancelled_jobs_after_a_time(harness):
    _, b = _claimed(harness, 2)
    before, listed = harness.store.cancelled_since(float("inf"))
    assert listed == []
    harness.store.cancel(b.job_id, "t")
    now, listed = harness.store.cancelled_since(before - 1.0)
    assert listed == [b.job_id] and now >= before
    assert harness.store.cancelled_since(now + 60.0)[1] == []


def test_ledger_many_ops_naming_one_key_see_each_other_in_order(harness):
    a, b = _claimed(harness, 2)
    assert harness.store.ledger_many([LedgerOp(a, "shared", ttl_s=30)]) == [None]
    # One batch: a settles the key, then b begins it (a key shared by two
    # jobs): b finds a's record, as it would one call later.
    got = harness.store.ledger_many(
        [LedgerOp(a, "shared", "committed", {"n": 1}), LedgerOp(b, "shared", ttl_s=30), LedgerOp(b, "own", ttl_s=30)]
    )
    assert got[0] is True and got[2] is None
    assert got[1] is not None and got[1].state == "committed" and got[1].result == {"n": 1}
    # A repeated settlement is answered True and changes nothing.
    assert harness.store.ledger_many([LedgerOp(a, "shared", "committed", {"n": 1})]) == [True]


def test_ledger_many_renews_every_begin_lease_and_records_each_mark(harness):
    leases = _claimed(harness, 5)
    before = {x.job_id: harness.store.get(x.job_id, "t").lease_expires_at for x in leases}
    # The begins of five turns in one batch: each lease renewed (to the
    # longer TTL) and each mark recorded, as five calls would.
    got = harness.store.ledger_many([LedgerOp(x, f"k-{x.job_id}", ttl_s=300) for x in leases])
    assert got == [None] * 5
    for x in leases:
        assert harness.store.get(x.job_id, "t").lease_expires_at > before[x.job_id] + 100
        marks = harness.store.history(x.job_id, "t")["side_effects"]
        assert [(e["key"], e["state"]) for e in marks] == [(f"k-{x.job_id}", "intended")]
