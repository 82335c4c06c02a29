"""Contract: every store reads its ready, due items oldest first (the Kafka
transport's store fallback claims from this read)."""

from __future__ import annotations

import time

from agentdispatch import Submission
from agentdispatch.backends.kafka.direct import ReadyDue


def test_ready_due_items_come_oldest_first_without_held_or_later_ones(harness):
    store = harness.store
    assert isinstance(store, ReadyDue)
    d = harness.dispatcher()
    due = [d.submit(Submission(kind="echo", tenant=t)).job_id for t in ("acme", "globex", "acme", "acme")]
    held = store.claim(due[3], "acme", owner="w:1", ttl_s=30)
    assert held.lease is not None
    d.submit(Submission(kind="echo", tenant="acme", delay_s=3600))  # not due yet

    got = store.ready_due(now=time.time() + 1, limit=10)
    assert [i.id for i in got] == due[:3]  # oldest first, every tenant; neither the held nor the later one
    assert [i.id for i in store.ready_due(now=time.time() + 1, limit=2)] == due[:2]
    assert store.ready_due(now=store.get(due[0], "acme").ready_at - 1, limit=10) == []
