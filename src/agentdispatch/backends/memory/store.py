"""The in-memory store: the engine's transitions over dicts (see
:mod:`agentdispatch.backends.memory.db`), for tests that need no database."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ... import workitem as wi
from ...envelope import Envelope
from ...errors import JobNotFound, LeaseLost
from ...stores import engine
from ...stores.base import (
    Accepted,
    Activity,
    Claim,
    Effect,
    EffectState,
    JobFilter,
    LedgerAnswer,
    LedgerOp,
    NewJob,
    OutboxRow,
    Schedule,
    SweepReport,
    TenantCount,
    WorkerRow,
)
from ...workitem import Lease, Outcome, Status, WorkItem
from .db import Clock, MemoryDb, QueueRow, Tables
from .tx import MemoryTx


def _matches(item: WorkItem, f: JobFilter) -> bool:
    return (
        (f.kind is None or item.kind == f.kind)
        and (f.session_id is None or item.session_id == f.session_id)
        and (f.agent_name is None or item.agent_name == f.agent_name)
        and (f.created_from is None or item.created_at >= f.created_from)
        and (f.created_to is None or item.created_at < f.created_to)
        and (f.id_contains is None or f.id_contains in item.id)
    )


_OPEN = frozenset({Status.SUBMITTED, Status.READY, Status.LEASED, Status.RUNNING})


class MemoryStore:
    """The WorkItem authority in process memory (lost when the process ends)."""

    name = "memory"

    def __init__(self, db: MemoryDb | None = None, *, clock: Clock | None = None, extra_attempts: int = 5) -> None:
        self.db = db if db is not None else MemoryDb(clock) if clock is not None else MemoryDb()
        self.extra_attempts = extra_attempts

    @contextmanager
    def transaction(self, durable: bool = False) -> Iterator[MemoryTx]:
        """One write transaction as an :class:`engine.Tx` (as the SQL stores
        offer it to extensions and tests)."""
        with self.db.tx() as t:
            yield MemoryTx(t, self.db.now())

    def migrate(self) -> None:
        """Nothing to create: the tables exist with the object."""

    def ping(self) -> None:
        """Always answers."""

    def schema_version(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to release (the data stays readable)."""

    def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        with self.db.tx() as t:
            return fn(MemoryTx(t, self.db.now()), *args, **kw)

    # -- lifecycle ----------------------------------------------------------
    def submit(self, jobs: Sequence[NewJob], *, max_depth: int) -> list[Accepted]:
        with self.db.tx() as t:
            accepted, _ = engine.with_timeouts(jobs, engine.submit(MemoryTx(t, self.db.now()), jobs, max_depth))
            for a in accepted:
                if a.item.timeout_s is not None:
                    t.items[a.item.id] = a.item  # the item as stored, with its execution timeout
        return accepted

    def claim(self, job_id: str, tenant: str, *, owner: str, ttl_s: float) -> Claim:
        out: Claim = self._run(engine.claim, job_id, tenant, owner, ttl_s)
        return out

    def claim_many(self, jobs: Sequence[tuple[str, str]], *, owner: str, ttl_s: float) -> list[Claim]:
        with self.db.tx() as t:
            return self.claim_on(t, jobs, owner=owner, ttl_s=ttl_s)

    def claim_on(self, t: Tables, jobs: Sequence[tuple[str, str]], *, owner: str, ttl_s: float) -> list[Claim]:
        """:meth:`claim_many` in the open transaction of ``t``."""
        return [engine.claim(MemoryTx(t, self.db.now()), job_id, tenant, owner, ttl_s) for job_id, tenant in jobs]

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        out: Lease = self._run(engine.renew, lease, ttl_s)
        return out

    def renew_many(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        with self.db.tx() as t:
            return self.renew_on(t, leases, ttl_s)

    def renew_on(self, t: Tables, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        """:meth:`renew_many` in the open transaction of ``t``."""
        return engine.renew_many(MemoryTx(t, self.db.now()), leases, ttl_s)

    def commit(self, lease: Lease, outcome: Outcome) -> WorkItem:
        out: WorkItem = self._run(engine.commit, lease, outcome)
        return out

    def commit_many(self, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        with self.db.tx() as t:
            return self.commit_on(t, done)

    def commit_on(self, t: Tables, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        """:meth:`commit_many` in the open transaction of ``t``; a fenced
        commit raises before it writes, so it costs the others nothing."""
        out: list[WorkItem | LeaseLost] = []
        for lease, outcome in done:
            try:
                out.append(engine.commit(MemoryTx(t, self.db.now()), lease, outcome))
            except LeaseLost as exc:
                out.append(exc)
        return out

    def cancel(self, job_id: str, tenant: str | None, reason: str = "cancelled") -> WorkItem:
        out: WorkItem = self._run(engine.cancel, job_id, tenant, reason)
        return out

    def replay(self, job_id: str, tenant: str | None) -> WorkItem:
        out: WorkItem = self._run(engine.replay, job_id, tenant, self.extra_attempts)
        return out

    # -- reads --------------------------------------------------------------
    def get(self, job_id: str, tenant: str | None) -> WorkItem:
        with self.db.read() as t:
            item = t.items.get(job_id)
        if item is None or (tenant is not None and item.tenant != tenant):
            raise JobNotFound(job_id)
        return item

    def list_jobs(
        self,
        *,
        tenant: str | None,
        status: Status | None,
        limit: int,
        offset: int,
        filters: JobFilter | None = None,
    ) -> list[WorkItem]:
        with self.db.read() as t:
            items = list(t.items.values())
        picked = [
            i
            for i in reversed(items)
            if (tenant is None or i.tenant == tenant)
            and (status is None or i.status is status)
            and (filters is None or _matches(i, filters))
        ]
        return picked[offset : offset + limit]

    def ready_due(self, *, now: float, limit: int) -> list[WorkItem]:
        """Ready items due by ``now`` (unix), oldest ready first, at most ``limit``."""
        with self.db.read() as t:
            due = [i for i in t.items.values() if i.status is Status.READY and i.ready_at <= now]
        due.sort(key=lambda i: i.ready_at)
        return due[:limit]

    def counts(self, tenant: str | None) -> dict[str, int]:
        out: dict[str, int] = {}
        with self.db.read() as t:
            for i in t.items.values():
                if tenant is None or i.tenant == tenant:
                    out[i.status.value] = out.get(i.status.value, 0) + 1
        return out

    def history(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        item = self.get(job_id, tenant)
        with self.db.read() as t:
            events = [{k: v for k, v in e.items() if k != "job_id"} for e in t.events if e["job_id"] == job_id]
            effects = [
                {"key": e.key, "state": e.state, "epoch": e.epoch, "result": e.result}
                for e in MemoryTx(t, 0.0).effects_of(job_id)
            ]
        return {"job": item.view(), "payload": item.payload, "events": events, "side_effects": effects}

    def fleet_counts(self) -> list[TenantCount]:
        groups: dict[tuple[str, str], tuple[int, float]] = {}
        with self.db.read() as t:
            for i in t.items.values():
                if i.status in _OPEN or i.status is Status.DEAD_LETTER:
                    stamp = i.completed_at if i.completed_at is not None else i.updated_at
                    n, oldest = groups.get((i.tenant, i.status.value), (0, stamp))
                    groups[(i.tenant, i.status.value)] = (n + 1, min(oldest, stamp))
        return [TenantCount(tenant, status, n, oldest) for (tenant, status), (n, oldest) in sorted(groups.items())]

    def depth_breakdown(self, tenant: str | None) -> list[tuple[str, str, str, int]]:
        rows: dict[tuple[str, str, str], int] = {}
        with self.db.read() as t:
            for i in t.items.values():
                if i.status in _OPEN and (tenant is None or i.tenant == tenant):
                    key = (i.tenant, i.kind, i.status.value)
                    rows[key] = rows.get(key, 0) + 1
        return [(*key, n) for key, n in sorted(rows.items())]

    def activity(self, tenant: str | None, *, since: float, bucket_s: float) -> Activity:
        start = 0
        created: dict[int, int] = {}
        finished: dict[int, dict[str, int]] = {}
        with self.db.read() as t:
            for i in t.items.values():
                if tenant is not None and i.tenant != tenant:
                    continue
                done = i.completed_at
                if i.created_at <= since and (done is None or done > since):
                    start += 1
                if i.created_at > since:
                    b = int((i.created_at - since) / bucket_s)
                    created[b] = created.get(b, 0) + 1
                if done is not None and done > since:
                    per = finished.setdefault(int((done - since) / bucket_s), {})
                    per[i.status.value] = per.get(i.status.value, 0) + 1
        return Activity(since, bucket_s, start, created, finished)

    def purge_dead(self, job_ids: Sequence[str], tenant: str | None) -> list[str]:
        gone: list[str] = []
        with self.db.tx() as t:
            for job_id in dict.fromkeys(job_ids):
                item = t.items.get(job_id)
                if (
                    item is None
                    or item.status is not Status.DEAD_LETTER
                    or (tenant is not None and item.tenant != tenant)
                ):
                    continue
                del t.items[job_id]
                gone.append(job_id)
            if gone:
                dead = set(gone)
                t.events = [e for e in t.events if e["job_id"] not in dead]
                t.dependants = {
                    k: tuple(j for j in v if j not in dead) for k, v in t.dependants.items() if k not in dead
                }
                t.queue = {k: r for k, r in t.queue.items() if r.job_id not in dead}
        return gone

    # -- side effects, poison ----------------------------------------------
    def effect_begin(self, lease: Lease, key: str, ttl_s: float, *, retry_unknown: bool = False) -> Effect | None:
        out: Effect | None = self._run(engine.effect_begin, lease, key, ttl_s, retry_unknown=retry_unknown)
        return out

    def effect_end(self, lease: Lease, key: str, *, state: EffectState, result: Any) -> bool:
        return bool(self._run(engine.effect_end, lease, key, state, result))

    def ledger_many(self, ops: Sequence[LedgerOp]) -> list[LedgerAnswer]:
        if not ops:
            return []
        out: list[LedgerAnswer] = self._run(engine.ledger_many, ops)
        return out

    def cancelled_since(self, since: float) -> tuple[float, list[str]]:
        with self.db.read() as t:
            ids = [e["job_id"] for e in t.events if e["event"] == "cancelled" and e["at"] >= since]
        return self.db.now(), ids

    def checkpoint(self, lease: Lease, state: str) -> None:
        with self.db.tx() as t:
            item = t.items.get(lease.job_id)
            if (
                item is None
                or item.tenant != lease.tenant
                or not wi.lease_is_live(item, self.db.now())
                or (item.lease_owner, item.lease_epoch, item.lease_token) != (lease.owner, lease.epoch, lease.token)
            ):
                raise LeaseLost(
                    f"job {lease.job_id}: lease epoch {lease.epoch} is no longer live; checkpoint not saved"
                )
            t.items[item.id] = wi.evolve(item, checkpoint=json.loads(state))  # JSON text, as a column holds it

    def record_poison(self, raw: str, reason: str) -> bool:
        with self.db.tx() as t:
            return self.poison_on(t, raw, reason)

    def poison_on(self, t: Tables, raw: str, reason: str) -> bool:
        """:meth:`record_poison` in the open transaction of ``t``."""
        digest = hashlib.sha256(raw.encode()).hexdigest()
        if digest in t.poison:
            return False
        t.poison[digest] = {"digest": digest, "raw": raw[:65536], "reason": reason, "created_at": self.db.now()}
        return True

    def poison(self, *, limit: int) -> list[dict[str, Any]]:
        with self.db.read() as t:
            rows = list(t.poison.values())
        return sorted(rows, key=lambda r: r["created_at"], reverse=True)[:limit]

    # -- reconciler, fleet, tokens, schedules, outbox -----------------------
    def sweep(self, *, redeliver_after_s: float) -> SweepReport:
        out: SweepReport = self._run(engine.sweep, redeliver_after_s)
        return out

    def reap(self, worker_id: str) -> SweepReport:
        out: SweepReport = self._run(engine.reap, worker_id)
        return out

    def heartbeat(self, row: WorkerRow) -> None:
        with self.db.tx() as t:
            old = t.workers.get(row.worker_id)
            base = row if old is None else old
            t.workers[row.worker_id] = WorkerRow(
                base.worker_id,
                base.host,
                row.capacity,
                tuple(row.active_sessions),
                base.queue_backend,
                base.started_at,
                self.db.now(),
                base.process,
                dict(row.counters),
            )

    def workers(self, *, max_age_s: float = 90.0) -> list[WorkerRow]:
        since = self.db.now() - max_age_s
        with self.db.read() as t:
            rows = [w for w in t.workers.values() if w.last_heartbeat >= since]
        return sorted(rows, key=lambda w: (w.started_at, w.worker_id))

    def remove_worker(self, worker_id: str, counters: Mapping[str, float] | None = None) -> None:
        with self.db.tx() as t:
            MemoryTx(t, self.db.now()).forget_worker(worker_id, counters)

    def fleet_counters(self) -> dict[str, float]:
        with self.db.read() as t:
            out = dict(t.fleet_counters)
            for row in t.workers.values():
                for key, value in row.counters.items():
                    out[key] = out.get(key, 0.0) + value
        return out

    def token_create(self, token_id: str, token_hash: str, tenant: str, label: str) -> None:
        with self.db.tx() as t:
            if token_id in t.tokens or any(h == token_hash for h, *_ in t.tokens.values()):
                raise ValueError(f"token {token_id} exists")
            t.tokens[token_id] = (token_hash, tenant, label, False)

    def token_revoke(self, token_id: str) -> bool:
        with self.db.tx() as t:
            row = t.tokens.get(token_id)
            if row is None or row[3]:
                return False
            t.tokens[token_id] = (row[0], row[1], row[2], True)
            return True

    def token_lookup(self, token_hash: str) -> str | None:
        with self.db.read() as t:
            return next(
                (tenant for h, tenant, _, revoked in t.tokens.values() if h == token_hash and not revoked), None
            )

    def schedule_add(self, schedule: Schedule) -> bool:
        with self.db.tx() as t:
            key = (schedule.tenant, schedule.name)
            if key in t.schedules:
                return False
            t.schedules[key] = _evolve_schedule(schedule, created_at=self.db.now())
            return True

    def schedules(self, tenant: str | None) -> list[Schedule]:
        with self.db.read() as t:
            rows = [s for s in t.schedules.values() if tenant is None or s.tenant == tenant]
        return sorted(rows, key=lambda s: (s.tenant, s.name))

    def schedule_update(self, tenant: str, name: str, *, paused: bool, next_at: float) -> bool:
        with self.db.tx() as t:
            old = t.schedules.get((tenant, name))
            if old is None:
                return False
            t.schedules[(tenant, name)] = _evolve_schedule(old, paused=paused, next_at=next_at)
            return True

    def schedule_delete(self, tenant: str, name: str) -> bool:
        with self.db.tx() as t:
            return t.schedules.pop((tenant, name), None) is not None

    def schedules_due(self, limit: int) -> tuple[float, list[Schedule]]:
        now = self.db.now()
        with self.db.read() as t:
            due = [s for s in t.schedules.values() if not s.paused and s.next_at <= now]
        return now, sorted(due, key=lambda s: s.next_at)[:limit]

    def schedule_advance(self, schedule: Schedule, *, next_at: float, last_tick: float, last_job_id: str) -> bool:
        with self.db.tx() as t:
            key = (schedule.tenant, schedule.name)
            old = t.schedules.get(key)
            if old is None or old.paused or old.next_at != schedule.next_at:
                return False
            t.schedules[key] = _evolve_schedule(old, next_at=next_at, last_tick=last_tick, last_job_id=last_job_id)
            return True

    def outbox_take(self, limit: int) -> list[OutboxRow]:
        with self.db.read() as t:
            rows = sorted(t.queue.values(), key=lambda r: r.id)[:limit]
        return [_outbox_row(r) for r in rows]

    def outbox_lease(self, owner: str, limit: int, hold_s: float) -> list[OutboxRow]:
        with self.db.tx() as t:
            now = self.db.now()
            free = [
                r
                for r in sorted(t.queue.values(), key=lambda r: r.id)
                if r.claimed_by in (None, owner) or (r.claimed_at is not None and r.claimed_at <= now - hold_s)
            ][:limit]
            for r in free:
                t.queue[r.id] = replace(r, claimed_by=owner, claimed_at=now)
        return [_outbox_row(r) for r in free]

    def outbox_done(self, row_ids: Sequence[int]) -> None:
        with self.db.tx() as t:
            for row_id in row_ids:
                t.queue.pop(row_id, None)


def _evolve_schedule(s: Schedule, **changes: Any) -> Schedule:
    return replace(s, **changes)


def _outbox_row(row: QueueRow) -> OutboxRow:
    return OutboxRow(row.id, Envelope.from_json(row.envelope), row.item_seq)
