"""Contract: the outbox a Kafka relay publishes from, read the same from every store.

Every worker process relays the outbox; a row one relay took must not go out
again from another while the first still publishes it (after a broker restart,
when confirmations took a second, every process published every row).
"""

from __future__ import annotations

import uuid

from agentdispatch.stores.base import NewJob


def _stored(harness, n: int) -> list[str]:
    jobs = [
        NewJob(job_id=str(uuid.uuid4()), tenant="t", session_id=f"s{i}", kind="echo", payload=None, max_attempts=3)
        for i in range(n)
    ]
    harness.store.submit(jobs, max_depth=1000)
    return [j.job_id for j in jobs]


def test_a_relay_takes_no_row_another_relay_holds_until_the_hold_ends(harness):
    jobs = _stored(harness, 5)
    store = harness.store

    first = store.outbox_lease("relay-a", 3, hold_s=600)
    assert [r.envelope.job_id for r in first] == jobs[:3]  # oldest first
    second = store.outbox_lease("relay-b", 10, hold_s=600)
    assert [r.envelope.job_id for r in second] == jobs[3:]  # only the rows relay-a does not hold
    assert store.outbox_lease("relay-c", 10, hold_s=600) == []

    # A relay takes its own rows again (a publish that failed is retried).
    assert [r.id for r in store.outbox_lease("relay-a", 10, hold_s=600)] == [r.id for r in first]
    # The plain take still sees every row not yet delivered (the group watch
    # reads an empty outbox from it).
    assert len(store.outbox_take(10)) == 5

    # A relay that died holding rows: once its hold is over they are anyone's.
    assert [r.id for r in store.outbox_lease("relay-c", 10, hold_s=0)] == [r.id for r in first + second]
    store.outbox_done([r.id for r in first + second])
    assert store.outbox_take(10) == [] and store.outbox_lease("relay-a", 10, hold_s=600) == []
