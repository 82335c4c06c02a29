"""Which ready items a worker whose consumer the group cannot serve claims
from the store, and in what order (no broker needed)."""

from __future__ import annotations

import dataclasses

from agentdispatch.backends.kafka.direct import claim_order
from agentdispatch.workitem import Status, WorkItem, new_item

NOW = 1_000.0


def _item(seq: int, tenant: str = "t", session: str | None = None, **kw: object) -> WorkItem:
    it = new_item(
        job_id=f"j{seq}", tenant=tenant, session_id=session or f"s{seq}", kind="k", payload={}, now=NOW - 10,
        max_attempts=3,
    )  # fmt: skip
    return dataclasses.replace(it, seq=seq, **kw)  # type: ignore[arg-type]


def _ids(items: list[WorkItem]) -> list[str]:
    return [i.id for i in items]


def test_only_the_first_ready_item_of_each_session_due_now():
    items = [
        _item(3, session="a"),
        _item(1, session="a"),
        _item(2, session="b", ready_at=NOW + 5),  # a retry not due yet
        _item(4, session="c", status=Status.RUNNING),
        _item(5, session="d"),
    ]
    assert _ids(claim_order(items, NOW, rotate=0)) == ["j1", "j5"]


def test_tenants_take_turns_whatever_their_backlog():
    items = [_item(i, tenant="big") for i in range(1, 7)] + [_item(10, tenant="small"), _item(11, tenant="small")]
    order = [i.tenant for i in claim_order(items, NOW, rotate=0)]
    assert order[:4] == ["big", "small", "big", "small"]
    assert order[4:] == ["big"] * 4


def test_expired_deadlines_then_priority_come_first_within_a_tenant():
    items = [
        _item(1),
        _item(2, priority=5),
        _item(3, deadline_unix=NOW - 1),
        _item(4, priority=5),
    ]
    assert _ids(claim_order(items, NOW, rotate=0)) == ["j3", "j2", "j4", "j1"]


def test_processes_start_at_different_items_of_one_urgency():
    items = [_item(i) for i in range(1, 5)] + [_item(9, priority=1)]
    first = claim_order(items, NOW, rotate=0)
    other = claim_order(items, NOW, rotate=2)
    assert _ids(first) == ["j9", "j1", "j2", "j3", "j4"]
    assert _ids(other) == ["j9", "j3", "j4", "j1", "j2"]  # the urgent one still first
