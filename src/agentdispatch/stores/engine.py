"""Store logic written once, over a transaction seam (:class:`Tx`).

Each function runs inside one write transaction that a backend opened (SQLite
``BEGIN IMMEDIATE``, PostgreSQL row locks). The functions load rows, apply the
pure transitions of :mod:`agentdispatch.workitem`, and write back; the backend
only supplies the SQL of :class:`Tx`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import workitem as wi
from ..envelope import Envelope
from ..errors import (
    AgentDispatchError,
    EffectInFlight,
    EffectUnknown,
    IdempotencyConflict,
    InvalidInput,
    JobNotFound,
    LeaseLost,
    QueueFull,
)
from ..policy import backoff_delay
from ..tracing import current_traceparent
from ..workitem import Lease, Outcome, Status, WorkItem
from .base import Accepted, Claim, ClaimKind, Effect, EffectState, LedgerAnswer, LedgerOp, NewJob, SweepReport


class Tx(Protocol):
    """The SQL a backend supplies, inside one open write transaction."""

    def now(self) -> float:
        """Database time, seconds since the epoch."""

    def load(self, job_id: str, *, lock: bool = True) -> WorkItem | None:
        """One item (locked for update where the backend has row locks)."""

    def insert(self, item: WorkItem) -> WorkItem:
        """Insert a new item; returns it with its ``seq``."""

    def save(self, item: WorkItem) -> None:
        """Write back every mutable column of ``item``."""

    def event(self, item: WorkItem, event: str, detail: str | None = None) -> None:
        """Append one provenance row."""

    def enqueue(self, item: WorkItem, envelope: Envelope, visible_at: float) -> None:
        """Insert the item's envelope row into the queue/outbox table."""

    def has_envelope(self, job_id: str) -> bool:
        """Whether a queue/outbox row exists for the job."""

    def add_dependencies(self, job_id: str, deps: Sequence[str]) -> None:
        """Record that ``job_id`` waits on ``deps``."""

    def dependants(self, job_id: str) -> list[str]:
        """Jobs that wait on ``job_id``."""

    def active_count(self) -> int:
        """Number of non-terminal items (the admission depth)."""

    def session_blocker(self, item: WorkItem, now: float) -> float | None:
        """Seconds to wait when an earlier active item, or a live lease, of the
        item's session exists; ``None`` when the item may run now."""

    def effect_get(self, tenant: str, key: str) -> Effect | None:
        """One ledger row."""

    def effect_put(self, tenant: str, effect: Effect, now: float) -> None:
        """Upsert one ledger row."""

    def effect_settle(self, tenant: str, effect: Effect, now: float) -> bool:
        """Move the row of ``effect.key`` from ``intended`` at ``effect.epoch``
        (and job) to ``effect.state``; False when the row is not in that state."""

    def effects_of(self, job_id: str) -> list[Effect]:
        """The ledger rows written by one job."""

    def expired_leases(self, now: float, limit: int) -> list[WorkItem]:
        """Held items whose lease expired."""

    def unserve(self, item: WorkItem) -> None:
        """Forget that the item's session was served by the claim whose lease
        expired: its turn goes back to its place in the fair order, not behind
        every session not yet served."""

    def held_by(self, owner_prefix: str, limit: int) -> list[WorkItem]:
        """Held items whose lease owner starts with ``owner_prefix`` (locked)."""

    def forget_worker(self, worker_id: str) -> None:
        """Delete a worker's heartbeat row, its counts added into the fleet's."""

    def release_claims(self, owner_prefix: str, now: float) -> None:
        """Make the queue rows claimed by owners starting with ``owner_prefix``
        visible again now (none where the queue is another transport's)."""

    def held_suspects(self, owner_prefix: str) -> list[tuple[str, int, int]]:
        """(owner, attempt, max_attempts) of the held items whose owner starts
        with ``owner_prefix``, whose last lease ran out, on a third attempt or later."""

    def expired_deadlines(self, now: float, limit: int) -> list[WorkItem]:
        """Active items whose deadline passed."""

    def stranded(self, now: float, redeliver_after_s: float, limit: int) -> list[WorkItem]:
        """Ready items with no envelope row, or whose envelope was handed to an
        external transport more than ``redeliver_after_s`` ago and not run."""

    def settled_waiters(self, limit: int) -> list[WorkItem]:
        """Submitted items none of whose dependencies is still active (a missed
        release: healed by the reconciler)."""

    def drop_dead_rows(self) -> int:
        """Delete queue rows whose item is terminal (never claimed ones)."""


#: The tail of a failed attempt's traceback kept on its ``committed`` event.
TRACEBACK_CHARS = 8000


def envelope_of(item: WorkItem, now: float) -> Envelope:
    """The envelope that delivers ``item``: references only."""
    return Envelope(
        job_id=item.id,
        session_id=item.session_id,
        kind=item.kind,
        payload_ref=item.payload_ref,
        agent_name=item.agent_name,
        tenant=item.tenant,
        priority=item.priority,
        deadline_unix=item.deadline_unix,
        attempt=item.attempt,
        enqueued_at=now,
        traceparent=current_traceparent(),  # the submitter's span, when traced
    )


def _make_ready(tx: Tx, item: WorkItem, now: float) -> None:
    tx.enqueue(item, envelope_of(item, now), max(now, item.ready_at))


def _save(tx: Tx, item: WorkItem, event: str, detail: str | None = None) -> WorkItem:
    tx.save(item)
    tx.event(item, event, detail)
    return item


def _owned(tx: Tx, job_id: str, tenant: str | None) -> WorkItem:
    item = tx.load(job_id)
    if item is None or (tenant is not None and item.tenant != tenant):
        raise JobNotFound(job_id)
    return item


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def body_differences(item: WorkItem, job: NewJob) -> tuple[str, ...]:
    """The fields in which a repeated submission differs from the job it
    names (empty: the same body). Times are left out: a retried relative
    delay is computed afresh, and retry budgets come from settings."""
    diffs = [
        name
        for name, mine, theirs in (
            ("kind", item.kind, job.kind),
            ("session_id", item.session_id, job.session_id),
            ("agent_name", item.agent_name, job.agent_name),
            ("priority", item.priority, job.priority),
            ("deadline_unix", item.deadline_unix, job.deadline_unix),
            ("dependencies", tuple(item.dependencies), tuple(job.dependencies)),
        )
        if mine != theirs
    ]
    if _canon(item.payload) != _canon(job.payload):
        diffs.append("payload")
    return tuple(diffs)


def _same_body(item: WorkItem, job: NewJob) -> None:
    diffs = body_differences(item, job)
    if diffs:
        raise IdempotencyConflict(job.job_id, diffs)


def _start_at(job: NewJob, now: float) -> float | None:
    if job.not_before is None and job.delay_s <= 0:
        return None
    return max(now + job.delay_s, job.not_before or 0.0)


def queue_full(depth: int, max_depth: int) -> QueueFull:
    """The refusal of a submission that ``depth`` active items leave no room for."""
    return QueueFull(f"queue full: {depth} active turns, bound AGENT_DISPATCH_MAX_DEPTH={max_depth}")


def submit(tx: Tx, jobs: Sequence[NewJob], max_depth: int) -> list[Accepted]:
    """Insert new items (idempotently by id) after compare-and-admit."""
    now = tx.now()
    existing: dict[str, WorkItem] = {}
    fresh: set[str] = set()
    for job in jobs:
        if job.job_id in existing or job.job_id in fresh:
            continue
        item = tx.load(job.job_id)
        if item is None:
            fresh.add(job.job_id)
        elif item.tenant != job.tenant:
            raise InvalidInput(f"job id {job.job_id} is not available")
        else:
            _same_body(item, job)
            existing[job.job_id] = item
    if fresh:
        # A backend may compare without a global lock when told what it admits.
        admitted = getattr(tx, "admitted_depth", None)
        depth = admitted(len(fresh), max_depth) if admitted is not None else tx.active_count()
        if depth + len(fresh) > max_depth:
            raise queue_full(depth, max_depth)
    # Handles come back in submission order; a repeated id answers with the first.
    out: list[Accepted] = []
    seen: dict[str, WorkItem] = {}
    for job in jobs:
        known = existing.get(job.job_id) or seen.get(job.job_id)
        if known is not None:
            if known.tenant != job.tenant:
                raise InvalidInput(f"job id {job.job_id} is not available")
            _same_body(known, job)
            out.append(Accepted(known, created=False))
            continue
        item = wi.new_item(
            job_id=job.job_id,
            tenant=job.tenant,
            session_id=job.session_id,
            kind=job.kind,
            payload=job.payload,
            now=now,
            max_attempts=job.max_attempts,
            agent_name=job.agent_name,
            priority=job.priority,
            dependencies=job.dependencies,
            deadline_unix=job.deadline_unix,
            start_at=_start_at(job, now),
        )
        decision = "release"
        if job.dependencies:
            statuses: list[Status | None] = []
            for dep in job.dependencies:
                # Locked: a parent committing concurrently either sees this child
                # (and releases it) or is seen terminal here; never neither.
                parent = seen.get(dep) or existing.get(dep) or tx.load(dep)
                if parent is None or parent.tenant != job.tenant:
                    raise InvalidInput(f"dependency {dep} of job {job.job_id} does not exist")
                statuses.append(parent.status)
            decision = wi.dependency_decision(statuses)
        item = tx.insert(item)
        tx.event(item, "submitted")
        if job.dependencies:
            tx.add_dependencies(item.id, job.dependencies)
            if decision == "release":
                item = _save(tx, wi.release(item, now), "released")
            elif decision == "cancel":
                item = _save(tx, wi.cancel(item, now, "dependency_failed"), "cancelled")
        if item.status is Status.READY:
            _make_ready(tx, item, now)
        seen[item.id] = item
        out.append(Accepted(item, created=True))
    return out


def claim(tx: Tx, job_id: str, tenant: str, owner: str, ttl_s: float) -> Claim:
    """Claim and start ``job_id`` for ``owner`` if it may run now."""
    now = tx.now()
    item = tx.load(job_id)
    if item is None:
        return Claim(ClaimKind.MISSING)
    if item.tenant != tenant:
        return Claim(ClaimKind.TENANT_MISMATCH, item)
    if item.status in wi.HELD:
        if wi.lease_is_live(item, now):
            assert item.lease_expires_at is not None
            return Claim(ClaimKind.BUSY, item, retry_after_s=item.lease_expires_at - now)
        item = _save(tx, wi.expire_lease(item, now), "lease_expired")
        if item.status.terminal:
            _cascade(tx, item, now)
    if item.status.terminal:
        return Claim(ClaimKind.SKIPPED, item)
    if item.status is Status.SUBMITTED:
        return Claim(ClaimKind.NOT_READY, item)
    if wi.is_expired(item, now):
        item = _cancel_cascade(tx, item, now, "expired")
        return Claim(ClaimKind.EXPIRED, item)
    if item.ready_at > now:
        return Claim(ClaimKind.BUSY, item, retry_after_s=item.ready_at - now)
    wait = tx.session_blocker(item, now)
    if wait is not None:
        return Claim(ClaimKind.BUSY, item, retry_after_s=wait)
    cap = wi.suspect_cap(item.attempt, item.max_attempts, item.reason)
    if cap is not None and not wi.may_join(cap, _held_caps(tx, owner)):
        # Deferred, not served: it keeps its place in the fair order instead of
        # going behind every session not yet served (the end of the backlog).
        tx.unserve(item)
        return Claim(ClaimKind.BUSY, item, retry_after_s=SUSPECT_WAIT_S)
    token = secrets.token_hex(16)
    item = wi.claim(item, owner=owner, token=token, now=now, ttl_s=ttl_s)
    lease = wi.lease_of(item)
    item = wi.start(item, lease, now)
    tx.save(item)
    # Claim and start are one transaction, so one provenance row records both
    # (an operator reads when the attempt began and who ran it); PostgreSQL
    # writes it in the same statement as the save.
    tx.event(item, "claimed", owner)
    return Claim(ClaimKind.CLAIMED, item, lease)


#: How long a suspect waits for its process's group to shrink (or for another
#: process to take it).
SUSPECT_WAIT_S = 1.0


def _process(owner: str) -> str:
    """The part of a lease owner that names its process (``<worker>:<slot>``)."""
    head, sep, _ = owner.rpartition(":")
    return head + sep


def _held_caps(tx: Tx, owner: str) -> list[int]:
    """The caps of the suspects that ``owner``'s process holds."""
    process = _process(owner) or owner
    caps = []
    for held_by, attempt, max_attempts in tx.held_suspects(process):
        if (_process(held_by) or held_by) != process:
            continue
        cap = wi.suspect_cap(attempt - 1, max_attempts, "lease_expired")
        if cap is not None:
            caps.append(cap)
    return caps


def renew(tx: Tx, lease: Lease, ttl_s: float) -> Lease:
    """Extend a live lease or raise :class:`LeaseLost`."""
    now = tx.now()
    item = tx.load(lease.job_id)
    if item is None:
        raise LeaseLost(f"job {lease.job_id} vanished")
    item = wi.renew(item, lease, now, ttl_s)
    tx.save(item)
    return wi.lease_of(item)


def renewed(tx: Tx, leases: Sequence[Lease], done: dict[tuple[str, str], float]) -> list[Lease | LeaseLost]:
    """The answers of a one-statement renewal that extended the leases in
    ``done`` ((job id, token) -> new expiry): the others are refused, each
    with the reason :func:`renew` would give (read back; a rare path)."""
    out: list[Lease | LeaseLost] = []
    for lease in leases:
        until = done.get((lease.job_id, lease.token))
        if until is not None:
            out.append(dataclasses.replace(lease, expires_at=until))
            continue
        item = tx.load(lease.job_id, lock=False)
        try:
            if item is None:
                raise LeaseLost(f"job {lease.job_id} vanished")
            wi.check_fence(item, lease, tx.now())
            raise LeaseLost(f"job {lease.job_id}: lease epoch {lease.epoch} was not renewed")
        except LeaseLost as exc:
            out.append(exc)
    return out


def renew_many(tx: Tx, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
    """:func:`renew` for each lease (the items already read in one statement);
    a fenced one is answered with its :class:`LeaseLost` and writes nothing."""
    out: list[Lease | LeaseLost] = []
    for lease in leases:
        try:
            out.append(renew(tx, lease, ttl_s))
        except LeaseLost as exc:
            out.append(exc)
    return out


def commit(tx: Tx, lease: Lease, outcome: Outcome, backoff_s: float | None = None) -> WorkItem:
    """The fenced commit; releases or cancels dependants atomically."""
    now = tx.now()
    item = tx.load(lease.job_id)
    if item is None:
        raise LeaseLost(f"job {lease.job_id} vanished")
    delay = backoff_s if backoff_s is not None else backoff_delay(item.attempt)
    done = wi.commit(item, lease, outcome, now, delay)
    if done is item:
        return item
    detail = lease.owner if outcome.ok else f"{lease.owner}: {(outcome.error or '')[:500]}"
    if outcome.traceback and not outcome.ok:
        detail += "\n" + outcome.traceback[-TRACEBACK_CHARS:]
    _save(tx, done, "committed", detail)
    if done.status is Status.READY:
        _make_ready(tx, done, now)
    elif done.status.terminal:
        _cascade(tx, done, now)
    return done


def _cascade(tx: Tx, parent: WorkItem, now: float) -> None:
    """Release dependants when ``parent`` succeeded, cancel them otherwise,
    and a cancelled one's dependants in turn, depth first. An explicit stack,
    not recursion: a chain of dependencies may be longer than Python's
    recursion limit, and a cascade that raised would leave its parent
    uncancellable (or a failed turn uncommittable)."""
    stack = [(parent, iter(tx.dependants(parent.id)))]
    while stack:
        parent, pending = stack[-1]
        dep_id = next(pending, None)
        if dep_id is None:
            stack.pop()
            continue
        child = tx.load(dep_id)
        if child is None or child.status is not Status.SUBMITTED:
            continue
        statuses: list[Status | None] = []
        for pid in child.dependencies:
            p = parent if pid == parent.id else tx.load(pid, lock=False)
            statuses.append(None if p is None else p.status)
        decision = wi.dependency_decision(statuses)
        if decision == "release":
            child = _save(tx, wi.release(child, now), "released")
            _make_ready(tx, child, now)
        elif decision == "cancel":
            reason = f"dependency_failed:{parent.id}"
            child = _save(tx, wi.cancel(child, now, reason), "cancelled", reason)
            stack.append((child, iter(tx.dependants(child.id))))


def _cancel_cascade(tx: Tx, item: WorkItem, now: float, reason: str) -> WorkItem:
    done = _save(tx, wi.cancel(item, now, reason), "cancelled", reason)
    _cascade(tx, done, now)
    return done


def cancel(tx: Tx, job_id: str, tenant: str | None, reason: str) -> WorkItem:
    """Cancel any non-terminal item; a terminal one is returned unchanged."""
    item = _owned(tx, job_id, tenant)
    if item.status.terminal:
        return item
    return _cancel_cascade(tx, item, tx.now(), reason)


def replay(tx: Tx, job_id: str, tenant: str | None, extra_attempts: int) -> WorkItem:
    """dead_letter -> ready; unknown side effects become ``released``."""
    item = _owned(tx, job_id, tenant)
    now = tx.now()
    item = _save(tx, wi.replay(item, now, extra_attempts), "replayed")
    for eff in tx.effects_of(item.id):
        if eff.state == "unknown":
            tx.effect_put(
                item.tenant,
                Effect(eff.key, eff.job_id, "released", eff.epoch, eff.result),
                now,
            )
    _make_ready(tx, item, now)
    return item


def effect_begin(tx: Tx, lease: Lease, key: str, ttl_s: float, *, retry_unknown: bool = False) -> Effect | None:
    """Renew + fence + mark intended (returns None: run it), or return the
    committed record (do not run it) or the ``unknown`` record (do not run it:
    the caller raises :class:`EffectUnknown`, or verifies the effect and calls
    again with ``retry_unknown``). Nothing raises after a write."""
    now = tx.now()
    item = tx.load(lease.job_id)
    if item is None:
        raise LeaseLost(f"job {lease.job_id} vanished")
    tx.save(wi.renew(item, lease, now, ttl_s))
    answer, write = begin_decision(tx, lease, key, tx.effect_get(lease.tenant, key), retry_unknown, now)
    if write is not None:
        tx.effect_put(lease.tenant, write, now)
    return answer


def begin_decision(
    tx: Tx, lease: Lease, key: str, eff: Effect | None, retry_unknown: bool, now: float
) -> tuple[Effect | None, Effect | None]:
    """What a begin answers once its lease is renewed, and the ledger row it
    writes (None: none). Raises when the effect is already in flight."""
    if eff is not None and eff.state == "committed":
        return eff, None
    if eff is not None and eff.state in ("intended", "unknown"):
        if eff.state == "intended" and (eff.job_id, eff.epoch) == (lease.job_id, lease.epoch):
            raise EffectUnknown(f"side effect {key!r} is already in flight in this attempt")
        if eff.state == "intended" and eff.job_id != lease.job_id and _running(tx, eff, now):
            raise EffectInFlight(f"side effect {key!r} is in flight in job {eff.job_id}; retry later")
        if not retry_unknown:
            # Record the doubt (no raise after a write: the caller raises).
            unknown = Effect(key, eff.job_id, "unknown", eff.epoch)
            return unknown, unknown
    return None, Effect(key, lease.job_id, "intended", lease.epoch)


def _running(tx: Tx, eff: Effect, now: float) -> bool:
    """Whether the attempt that marked ``eff`` intended still holds its lease."""
    owner = tx.load(eff.job_id, lock=False)
    return owner is not None and owner.lease_epoch == eff.epoch and wi.lease_is_live(owner, now)


def effect_end(tx: Tx, lease: Lease, key: str, state: EffectState, result: Any) -> bool:
    """Settle this attempt's mark, fenced by the epoch on the ledger row.

    Not by the item's lease: while no other attempt has looked at the mark,
    what this attempt saw is the truth and the next attempt may reuse it. Once
    another attempt doubted it (dead-lettered ``effect_unknown``), verified it,
    or a replay released it, a stale answer must not contradict that record.
    A repeat of the same settlement (a retried COMMIT) answers True."""
    now = tx.now()
    if tx.effect_settle(lease.tenant, Effect(key, lease.job_id, state, lease.epoch, result), now):
        return True
    row = tx.effect_get(lease.tenant, key)
    return row is not None and (row.job_id, row.epoch, row.state) == (lease.job_id, lease.epoch, state)


def ledger_many(
    tx: Tx, ops: Sequence[LedgerOp], settled: Callable[[LedgerOp, bool], None] | None = None
) -> list[LedgerAnswer]:
    """Each op as :func:`effect_begin` or :func:`effect_end` would run it alone
    (``settled`` may check a settlement after it; an error is raised before
    any write, so it is answered in the op's place and the rest go on)."""
    out: list[LedgerAnswer] = []
    for op in ops:
        try:
            if op.state is None:
                out.append(effect_begin(tx, op.lease, op.key, op.ttl_s, retry_unknown=op.retry_unknown))
            else:
                recorded = effect_end(tx, op.lease, op.key, op.state, op.result)
                if settled is not None:
                    settled(op, recorded)
                out.append(recorded)
        except AgentDispatchError as exc:
            out.append(exc)
    return out


def with_timeouts(jobs: Sequence[NewJob], accepted: list[Accepted]) -> tuple[list[Accepted], list[tuple[str, float]]]:
    """The accepted items with the execution timeouts of the new ones among
    them, and those (id, seconds) pairs for the store to write."""
    pairs: list[tuple[str, float]] = []
    out: list[Accepted] = []
    for job, a in zip(jobs, accepted, strict=True):
        if a.created and job.timeout_s is not None:
            pairs.append((a.item.id, job.timeout_s))
            a = Accepted(wi.evolve(a.item, timeout_s=job.timeout_s), created=True)
        out.append(a)
    return out, pairs


def _reclaim(tx: Tx, done: WorkItem, now: float, report: SweepReport) -> None:
    """After a lease ended unfinished: the turn goes back to its place in the
    queue, or (out of attempts) its dependants learn that it failed."""
    if done.status is Status.READY:
        report.reclaimed += 1
        tx.unserve(done)
        _make_ready(tx, done, now)
    else:
        report.dead_lettered += 1
        _cascade(tx, done, now)


def reap(tx: Tx, worker_id: str, limit: int = 500) -> SweepReport:
    """End the leases of a worker whose process is gone (see :meth:`Store.reap`)."""
    now = tx.now()
    report = SweepReport()
    # Its deliveries first: the turns keep their rows, and so their place.
    tx.release_claims(f"{worker_id}:", now)
    held = tx.held_by(f"{worker_id}:", limit)
    for item in held:
        done = _save(tx, wi.holder_gone(item, now), "lease_expired", "its worker process is gone")
        if done.status is Status.READY and tx.has_envelope(done.id):
            report.reclaimed += 1
            tx.unserve(done)
        else:
            _reclaim(tx, done, now, report)
    if len(held) < limit:
        tx.forget_worker(worker_id)
    return report


def sweep(tx: Tx, redeliver_after_s: float, limit: int = 500) -> SweepReport:
    """One reconciler pass (see :meth:`Store.sweep`)."""
    now = tx.now()
    report = SweepReport()
    for item in tx.expired_leases(now, limit):
        _reclaim(tx, _save(tx, wi.expire_lease(item, now), "lease_expired"), now, report)
    for item in tx.expired_deadlines(now, limit):
        _cancel_cascade(tx, item, now, "expired")
        report.expired += 1
    for item in tx.settled_waiters(limit):
        statuses: list[Status | None] = []
        for pid in item.dependencies:
            parent = tx.load(pid, lock=False)
            statuses.append(None if parent is None else parent.status)
        if wi.dependency_decision(statuses) == "release":
            _make_ready(tx, _save(tx, wi.release(item, now), "released"), now)
        else:
            _cancel_cascade(tx, item, now, "dependency_failed")
        report.redelivered += 1
    for item in tx.stranded(now, redeliver_after_s, limit):
        # Touch the item so the next pass waits another grace period.
        item = _save(tx, wi.evolve(item, updated_at=now), "redelivered")
        _make_ready(tx, item, now)
        report.redelivered += 1
    report.dropped_rows = tx.drop_dead_rows()
    return report
