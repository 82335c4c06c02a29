"""Contract: ``renew_many`` renews every live lease in one call, answers a
fenced one with LeaseLost, and ``ttl_s=0`` gives leases up at once."""

from __future__ import annotations

import pytest

from agentdispatch import LeaseLost, Status, Submission
from agentdispatch.stores.base import ClaimKind
from agentdispatch.workitem import Outcome


def _claimed(harness, n: int):
    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="echo", tenant="t")) for _ in range(n)]
    claims = [harness.store.claim(j.job_id, "t", owner="w:1", ttl_s=30) for j in jobs]
    assert all(c.kind is ClaimKind.CLAIMED for c in claims)
    return [c.lease for c in claims]


def test_renew_many_renews_live_and_fences_the_rest(harness):
    leases = _claimed(harness, 4)
    harness.store.cancel(leases[1].job_id, "t")
    forged = type(leases[2])(**{**leases[2].__dict__, "token": "0" * 32})
    got = harness.store.renew_many([leases[0], leases[1], forged, leases[3]], 60)
    assert isinstance(got[1], LeaseLost) and isinstance(got[2], LeaseLost)
    for old, new in ((leases[0], got[0]), (leases[3], got[3])):
        assert not isinstance(new, LeaseLost)
        assert (new.job_id, new.epoch, new.token) == (old.job_id, old.epoch, old.token)
        assert new.expires_at > old.expires_at
        assert harness.store.get(old.job_id, "t").lease_expires_at == pytest.approx(new.expires_at)
    # The fenced ones wrote nothing; the renewed ones still commit.
    assert harness.store.get(leases[1].job_id, "t").status is Status.CANCELLED
    assert harness.store.commit(got[0], Outcome(ok=True)).status is Status.SUCCEEDED
    assert harness.store.renew_many([], 60) == []


def test_renew_many_with_zero_ttl_releases_for_another_claimer(harness):
    (lease,) = _claimed(harness, 1)
    assert harness.store.claim(lease.job_id, "t", owner="w:2", ttl_s=30).kind is ClaimKind.BUSY
    (released,) = harness.store.renew_many([lease], 0)
    assert not isinstance(released, LeaseLost)
    again = harness.store.claim(lease.job_id, "t", owner="w:2", ttl_s=30)
    assert again.kind is ClaimKind.CLAIMED and again.lease is not None and again.lease.epoch == lease.epoch + 1
    with pytest.raises(LeaseLost):  # the old holder is fenced out
        harness.store.commit(lease, Outcome(ok=True))
