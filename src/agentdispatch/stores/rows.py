"""Mapping between SQL rows and :class:`WorkItem` (shared by SQL stores)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..envelope import Envelope
from ..workitem import Status, WorkItem
from .base import Effect, OutboxRow, Schedule, WorkerRow

_STATUS = {s.value: s for s in Status}


def item_from_row(row: Mapping[str, Any]) -> WorkItem:
    """Build a WorkItem from a ``work_items`` row (twice a turn: a dict lookup
    for the status, no JSON parse of an empty dependency list)."""
    payload = row["payload"]
    result = row["result"]
    deps = row["dependencies"]
    saved = row["checkpoint"]
    return WorkItem(
        id=row["id"],
        tenant=row["tenant"],
        session_id=row["session_id"],
        kind=row["kind"],
        payload=json.loads(payload) if isinstance(payload, str) else payload,
        status=_STATUS[row["status"]],
        created_at=float(row["created_at"]),
        ready_at=float(row["ready_at"]),
        updated_at=float(row["updated_at"]),
        max_attempts=int(row["max_attempts"]),
        agent_name=row["agent_name"],
        priority=int(row["priority"]),
        attempt=int(row["attempts"]),
        dependencies=() if deps == "[]" else tuple(json.loads(deps) if isinstance(deps, str) else deps),
        deadline_unix=row["deadline_unix"],
        reason=row["reason"],
        seq=int(row["seq"]),
        lease_owner=row["lease_owner"],
        lease_epoch=int(row["lease_epoch"]),
        lease_token=row["lease_token"],
        lease_expires_at=row["lease_expires_at"],
        result=json.loads(result) if isinstance(result, str) else result,
        error=row["error"],
        completed_at=row["completed_at"],
        checkpoint=None if saved is None else json.loads(saved),
        timeout_s=row["timeout_s"],
    )


#: One encoder for every column (``json.dumps`` with options builds one per call).
_COLUMN_JSON = json.JSONEncoder(separators=(",", ":"), default=str)


def dumps(value: Any) -> str:
    """Compact JSON for a column."""
    return _COLUMN_JSON.encode(value)


def mutable_params(item: WorkItem) -> dict[str, Any]:
    """The columns a transition may change, keyed for named parameters."""
    return {
        "id": item.id,
        "status": item.status.value,
        "reason": item.reason,
        "attempts": item.attempt,
        "max_attempts": item.max_attempts,
        "ready_at": item.ready_at,
        "updated_at": item.updated_at,
        "completed_at": item.completed_at,
        "lease_owner": item.lease_owner,
        "lease_epoch": item.lease_epoch,
        "lease_token": item.lease_token,
        "lease_expires_at": item.lease_expires_at,
        "result": None if item.result is None else dumps(item.result),
        "error": item.error,
    }


def insert_params(item: WorkItem, session_ref: str) -> dict[str, Any]:
    """Every column of a new item, keyed for named parameters (``seq`` is the
    caller's: assigned by the database or reserved ahead)."""
    params = mutable_params(item)
    params.update(
        tenant=item.tenant,
        session_id=item.session_id,
        session_ref=session_ref,
        kind=item.kind,
        agent_name=item.agent_name,
        payload=dumps(item.payload),
        priority=item.priority,
        dependencies=dumps(list(item.dependencies)) if item.dependencies else "[]",
        deadline_unix=item.deadline_unix,
        created_at=item.created_at,
    )
    return params


def blocker_wait(status: str | None, lease_expires_at: float | None, now: float) -> float | None:
    """Seconds to wait before a session's next turn may be claimed, from the
    item that blocks it (None: nothing blocks). A running blocker is waited
    for until its lease ends (bounded to 0.05-5 s); a queued earlier turn,
    briefly."""
    if status is None:
        return None
    if status in ("leased", "running") and lease_expires_at is not None:
        return max(0.05, min(5.0, float(lease_expires_at) - now))
    return 0.5


def effect_from_row(row: Mapping[str, Any]) -> Effect:
    """A ``side_effects`` row as an :class:`Effect`."""
    result = row["result"]
    return Effect(
        key=row["key"],
        job_id=row["job_id"],
        state=row["state"],
        epoch=int(row["epoch"]),
        result=json.loads(result) if isinstance(result, str) else result,
        updated_at=float(row["updated_at"]),
    )


def effect_params(tenant: str, effect: Effect, now: float) -> dict[str, Any]:
    """Named parameters of the ``effect_put`` upsert."""
    return {
        "tenant": tenant,
        "key": effect.key,
        "job_id": effect.job_id,
        "state": effect.state,
        "epoch": effect.epoch,
        "result": None if effect.result is None else dumps(effect.result),
        "now": now,
    }


def worker_from_row(row: Mapping[str, Any]) -> WorkerRow:
    """A ``dispatch_workers`` row as a :class:`WorkerRow`."""
    sessions = row["active_sessions"]
    return WorkerRow(
        worker_id=row["worker_id"],
        host=row["host"],
        capacity=int(row["capacity"]),
        active_sessions=tuple(json.loads(sessions) if isinstance(sessions, str) else sessions),
        queue_backend=row["queue_backend"],
        started_at=float(row["started_at"]),
        last_heartbeat=float(row["last_heartbeat"]),
        process=row["process"],
        counters=json.loads(row["counters"]),
    )


def schedule_from_row(row: Mapping[str, Any]) -> Schedule:
    """A ``dispatch_schedules`` row as a :class:`Schedule`."""
    return Schedule(
        tenant=row["tenant"],
        name=row["name"],
        cron=row["cron"],
        tz=row["tz"],
        kind=row["kind"],
        payload=json.loads(row["payload"]),
        next_at=float(row["next_at"]),
        session_id=row["session_id"],
        priority=int(row["priority"]),
        agent_name=row["agent_name"],
        paused=bool(row["paused"]),
        last_tick=None if row["last_tick"] is None else float(row["last_tick"]),
        last_job_id=row["last_job_id"],
        created_at=float(row["created_at"]),
    )


def schedule_params(s: Schedule) -> dict[str, Any]:
    """Named parameters of ``schedule_add``."""
    return {
        "tenant": s.tenant,
        "name": s.name,
        "cron": s.cron,
        "tz": s.tz,
        "kind": s.kind,
        "payload": dumps(s.payload),
        "session_id": s.session_id,
        "priority": s.priority,
        "agent_name": s.agent_name,
        "paused": s.paused,
        "next_at": s.next_at,
    }


def advance_params(s: Schedule, next_at: float, last_tick: float, last_job_id: str) -> dict[str, Any]:
    """Named parameters of ``schedule_advance``."""
    return {
        "tenant": s.tenant,
        "name": s.name,
        "expected": s.next_at,
        "next_at": next_at,
        "last_tick": last_tick,
        "last_job_id": last_job_id,
    }


def outbox_row_of(row: Mapping[str, Any]) -> OutboxRow:
    """An ``agent_dispatch_queue`` row read as the outbox of an external transport."""
    return OutboxRow(int(row["id"]), Envelope.from_json(row["envelope"]), int(row["item_seq"]))
