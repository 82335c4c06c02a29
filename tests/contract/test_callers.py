"""Contract: what callers of a job system expect (issue 20), on every backend."""

from __future__ import annotations

import pytest

from agentdispatch import IdempotencyConflict, InvalidInput, Submission


def test_a_reused_key_with_another_body_is_a_conflict(harness):
    d = harness.dispatcher()
    first = d.submit(Submission(kind="echo", tenant="acme", payload={"n": 1}, idempotency_key="order-1"))
    # The same body (keys in another order) is the same job.
    again = d.submit(Submission(kind="echo", tenant="acme", payload={"n": 1}, idempotency_key="order-1"))
    assert again.job_id == first.job_id
    before = harness.store.counts("acme")
    with pytest.raises(IdempotencyConflict) as err:
        d.submit(Submission(kind="echo", tenant="acme", payload={"n": 2}, idempotency_key="order-1"))
    assert err.value.job_id == first.job_id and err.value.fields == ("payload",)
    assert isinstance(err.value, InvalidInput)
    with pytest.raises(IdempotencyConflict) as err:
        d.submit(Submission(kind="other", tenant="acme", payload={"n": 1}, idempotency_key="order-1", priority=3))
    assert err.value.fields == ("kind", "priority")
    # A caller-chosen job id is held to the same rule, also inside one batch,
    # and a refused batch writes nothing.
    with pytest.raises(IdempotencyConflict):
        d.submit_many(
            [
                Submission(kind="echo", tenant="acme", job_id="mine-1", payload=1),
                Submission(kind="echo", tenant="acme", job_id="mine-1", payload=2),
            ]
        )
    assert harness.store.counts("acme") == before
    assert harness.store.get(first.job_id, "acme").payload == {"n": 1}
