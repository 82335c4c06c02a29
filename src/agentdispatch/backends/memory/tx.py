"""The engine's :class:`~agentdispatch.stores.engine.Tx` over the tables of an
in-memory database: each SQL query of the database stores as a scan of a dict
(the tables of a test are small)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ... import workitem as wi
from ...envelope import Envelope
from ...stores.base import Effect
from ...stores.rows import blocker_wait, dumps
from ...workitem import Status, WorkItem
from .db import QueueRow, Tables


class MemoryTx:
    """:class:`engine.Tx` over the tables of one open :meth:`MemoryDb.tx`."""

    def __init__(self, t: Tables, now: float) -> None:
        self.t = t
        self._now = now

    def now(self) -> float:
        return self._now

    def load(self, job_id: str, *, lock: bool = True) -> WorkItem | None:
        return self.t.items.get(job_id)

    def insert(self, item: WorkItem) -> WorkItem:
        # Through JSON, as a database stores it: a payload that is not JSON
        # fails here, and the caller's object is not shared with the store.
        item = wi.evolve(item, payload=json.loads(dumps(item.payload)), seq=self.t.next_id("seq"))
        self.t.items[item.id] = item
        return item

    def save(self, item: WorkItem) -> None:
        self.t.items[item.id] = item

    def event(self, item: WorkItem, event: str, detail: str | None = None) -> None:
        self.t.events.append(
            {
                "job_id": item.id,
                "at": self._now,
                "event": event,
                "status": item.status.value,
                "attempt": item.attempt,
                "epoch": item.lease_epoch,
                "detail": detail,
            }
        )

    def enqueue(self, item: WorkItem, envelope: Envelope, visible_at: float) -> None:
        row_id = self.t.next_id("queue")
        self.t.queue[row_id] = QueueRow(
            id=row_id,
            job_id=item.id,
            item_seq=item.seq,
            tenant=item.tenant,
            session_id=item.session_id,
            priority=item.priority,
            deadline_unix=item.deadline_unix,
            envelope=envelope.to_json(),
            enqueued_at=self._now,
            visible_at=visible_at,
        )

    def has_envelope(self, job_id: str) -> bool:
        return any(r.job_id == job_id for r in self.t.queue.values())

    def add_dependencies(self, job_id: str, deps: Sequence[str]) -> None:
        for dep in deps:
            have = self.t.dependants.get(dep, ())
            if job_id not in have:
                self.t.dependants[dep] = (*have, job_id)

    def dependants(self, job_id: str) -> list[str]:
        return list(self.t.dependants.get(job_id, ()))

    def active_count(self) -> int:
        return sum(1 for i in self.t.items.values() if i.status in wi.ACTIVE)

    def session_blocker(self, item: WorkItem, now: float) -> float | None:
        for other in self.t.items.values():
            if (
                other.id != item.id
                and (other.tenant, other.session_id) == (item.tenant, item.session_id)
                and other.status in wi.ACTIVE
                and (other.seq < item.seq or other.status in wi.HELD)
            ):
                return blocker_wait(other.status.value, other.lease_expires_at, now)
        return None

    def effect_get(self, tenant: str, key: str) -> Effect | None:
        row = self.t.effects.get((tenant, key))
        return None if row is None else row[0]

    def effect_put(self, tenant: str, effect: Effect, now: float) -> None:
        old = self.t.effects.get((tenant, effect.key))
        created = now if old is None else old[1]
        self.t.effects[(tenant, effect.key)] = (_stamped(effect, now), created)

    def effect_settle(self, tenant: str, effect: Effect, now: float) -> bool:
        row = self.t.effects.get((tenant, effect.key))
        if row is None:
            return False
        old, created = row
        if (old.job_id, old.epoch, old.state) != (effect.job_id, effect.epoch, "intended"):
            return False
        self.t.effects[(tenant, effect.key)] = (_stamped(effect, now), created)
        return True

    def effects_of(self, job_id: str) -> list[Effect]:
        rows = [r for r in self.t.effects.values() if r[0].job_id == job_id]
        return [e for e, _ in sorted(rows, key=lambda r: r[1])]

    def unserve(self, item: WorkItem) -> None:
        pass  # its claim order has no session stamps

    def held_by(self, owner_prefix: str, limit: int) -> list[WorkItem]:
        return [
            i
            for i in self.t.items.values()
            if i.status in wi.HELD and i.lease_owner is not None and i.lease_owner.startswith(owner_prefix)
        ][:limit]

    def release_claims(self, owner_prefix: str, now: float) -> None:
        for key, row in list(self.t.queue.items()):
            if row.claimed_by is not None and row.claimed_by.startswith(owner_prefix):
                self.t.queue[key] = replace(row, visible_at=now, claimed_by=None, claimed_at=None)

    def forget_worker(self, worker_id: str, counters: Mapping[str, float] | None = None) -> None:
        row = self.t.workers.pop(worker_id, None)
        if row is None:
            return
        folded = dict(self.t.fleet_counters)
        for key, value in (row.counters if counters is None else counters).items():
            folded[key] = folded.get(key, 0.0) + value
        self.t.fleet_counters = folded

    def held_suspects(self, owner_prefix: str) -> list[tuple[str, int, int]]:
        return [
            (i.lease_owner, i.attempt, i.max_attempts)
            for i in self.t.items.values()
            if i.status in wi.HELD
            and i.reason == "lease_expired"
            and i.attempt >= 3
            and i.lease_owner is not None
            and i.lease_owner.startswith(owner_prefix)
        ]

    def expired_leases(self, now: float, limit: int) -> list[WorkItem]:
        held = [
            i
            for i in self.t.items.values()
            if i.status in wi.HELD and i.lease_expires_at is not None and i.lease_expires_at <= now
        ]
        return sorted(held, key=lambda i: i.lease_expires_at or 0.0)[:limit]

    def expired_deadlines(self, now: float, limit: int) -> list[WorkItem]:
        return [
            i
            for i in self.t.items.values()
            if i.deadline_unix is not None and i.deadline_unix <= now and i.status in wi.ACTIVE
        ][:limit]

    def stranded(self, now: float, redeliver_after_s: float, limit: int) -> list[WorkItem]:
        queued = {r.job_id for r in self.t.queue.values()}
        return [
            i
            for i in self.t.items.values()
            if i.status is Status.READY
            and i.ready_at <= now
            and i.id not in queued
            and i.updated_at <= now - redeliver_after_s
        ][:limit]

    def settled_waiters(self, limit: int) -> list[WorkItem]:
        def settled(item: WorkItem) -> bool:
            parents = (self.t.items.get(p) for p in item.dependencies)
            return not any(p is not None and p.status in wi.ACTIVE for p in parents)

        return [i for i in self.t.items.values() if i.status is Status.SUBMITTED and settled(i)][:limit]

    def drop_dead_rows(self) -> int:
        dead = [
            r.id
            for r in self.t.queue.values()
            if r.claimed_by is None and (item := self.t.items.get(r.job_id)) is not None and item.status.terminal
        ][:500]
        for row_id in dead:
            del self.t.queue[row_id]
        return len(dead)


def _stamped(effect: Effect, now: float) -> Effect:
    return Effect(effect.key, effect.job_id, effect.state, effect.epoch, effect.result, now)
