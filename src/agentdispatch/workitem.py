"""WorkItem, its status and lease, and the transition table as pure functions.

Every function here takes the item and ``now`` (database time) and returns a new
item, or raises :class:`InvalidTransition` / :class:`LeaseLost`. Backends only add
atomicity: they load the row under a write lock, call one of these, and write it
back in the same transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from .errors import InvalidTransition, LeaseLost, OutcomeConflict


class Status(StrEnum):
    """The lifecycle of a WorkItem (SPEC section 3)."""

    SUBMITTED = "submitted"
    READY = "ready"
    LEASED = "leased"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD_LETTER = "dead_letter"

    @property
    def terminal(self) -> bool:
        """True for the four end states, which never change again."""
        return self in TERMINAL


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.DEAD_LETTER})
ACTIVE = frozenset({Status.SUBMITTED, Status.READY, Status.LEASED, Status.RUNNING})
HELD = frozenset({Status.LEASED, Status.RUNNING})


@dataclass(frozen=True)
class Lease:
    """The capability a claim hands to one worker: never shown to callers."""

    job_id: str
    tenant: str
    owner: str
    epoch: int
    token: str
    expires_at: float


@dataclass(frozen=True)
class WorkItem:
    """The one durable, writable record of a unit of work."""

    id: str
    tenant: str
    session_id: str
    kind: str
    payload: Any
    status: Status
    created_at: float
    ready_at: float
    updated_at: float
    max_attempts: int
    agent_name: str = ""
    priority: int = 0
    attempt: int = 0
    dependencies: tuple[str, ...] = ()
    deadline_unix: float | None = None
    reason: str | None = None
    seq: int = 0
    lease_owner: str | None = None
    lease_epoch: int = 0
    lease_token: str | None = None
    lease_expires_at: float | None = None
    result: Any = None
    error: str | None = None
    completed_at: float | None = None
    #: The progress the last attempt saved (``guard.checkpoint``), or None.
    checkpoint: Any = None
    #: The submission's own execution timeout per attempt (seconds), or None.
    timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def payload_ref(self) -> str:
        """Where the body lives: the item itself."""
        return self.id

    @property
    def result_ref(self) -> str | None:
        """A reference to the committed outcome, once there is one."""
        return f"outcome:{self.id}:{self.lease_epoch}" if self.status.terminal else None

    def view(self) -> dict[str, Any]:
        """The caller-facing view: everything but lease secrets."""
        return {
            "job_id": self.id,
            "kind": self.kind,
            "status": self.status.value,
            "session_id": self.session_id,
            "tenant": self.tenant,
            "agent_name": self.agent_name,
            "priority": self.priority,
            "payload_ref": self.payload_ref,
            "result_ref": self.result_ref,
            "result": self.result,
            "error": self.error,
            "reason": self.reason,
            "attempt": self.attempt,
            "max_attempts": self.max_attempts,
            "dependencies": list(self.dependencies),
            "deadline_unix": self.deadline_unix,
            "created_at": self.created_at,
            "ready_at": self.ready_at,
            "updated_at": self.updated_at,
            "completed_at": self.completed_at,
        }


@dataclass(frozen=True)
class Outcome:
    """What a handler run produced, as committed under the fence."""

    ok: bool
    result: Any = None
    error: str | None = None
    retryable: bool = True
    #: Send straight to the dead-letter queue with this reason (a human decides).
    dead_letter_reason: str | None = None
    #: The item's visible reason: of a non-retryable failure (``non_retryable``
    #: when unset), or of a retryable one sent back to ready (``retry`` when
    #: unset; ``timeout``, ``overloaded``).
    reason: str | None = None
    #: A non-retryable outcome that ends the item as cancelled (a policy retired it).
    retired: bool = False
    #: The handler's traceback (recorded on the attempt's event, not on the item).
    traceback: str | None = None

    def same_as(self, item: WorkItem) -> bool:
        """Whether committing this outcome again would change nothing."""
        if self.ok:
            return item.status is Status.SUCCEEDED and _canon(item.result) == _canon(self.result)
        if self.retired:
            return item.status is Status.CANCELLED and item.error == self.error
        return item.status in (Status.FAILED, Status.DEAD_LETTER, Status.READY) and (item.error == self.error)


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


_FIELDS = frozenset(f.name for f in fields(WorkItem))


def evolve(item: WorkItem, **changes: Any) -> WorkItem:
    """``dataclasses.replace`` for :class:`WorkItem` without its per-call field
    introspection (it runs on every transition of every turn). WorkItem has no
    ``__post_init__``, so copying the field values is all ``replace`` would do."""
    if not changes.keys() <= _FIELDS:
        raise TypeError(f"WorkItem has no field(s) {sorted(changes.keys() - _FIELDS)}")
    new = object.__new__(WorkItem)
    state = new.__dict__
    state.update(item.__dict__)
    state.update(changes)
    return new


def _require(item: WorkItem, *allowed: Status) -> None:
    if item.status not in allowed:
        names = ", ".join(s.value for s in allowed)
        raise InvalidTransition(f"job {item.id} is {item.status.value}, expected one of: {names}")


def new_item(
    *,
    job_id: str,
    tenant: str,
    session_id: str,
    kind: str,
    payload: Any,
    now: float,
    max_attempts: int,
    agent_name: str = "",
    priority: int = 0,
    dependencies: tuple[str, ...] = (),
    deadline_unix: float | None = None,
    start_at: float | None = None,
) -> WorkItem:
    """A freshly accepted item: ``submitted`` when it waits on dependencies;
    not claimable before ``start_at`` (a delayed turn)."""
    return WorkItem(
        id=job_id,
        tenant=tenant,
        session_id=session_id,
        kind=kind,
        payload=payload,
        status=Status.SUBMITTED if dependencies else Status.READY,
        created_at=now,
        ready_at=now if start_at is None else max(now, start_at),
        updated_at=now,
        max_attempts=max_attempts,
        agent_name=agent_name,
        priority=priority,
        dependencies=dependencies,
        deadline_unix=deadline_unix,
    )


def is_expired(item: WorkItem, now: float) -> bool:
    """Whether the item's deadline has passed."""
    return item.deadline_unix is not None and now >= item.deadline_unix


def lease_is_live(item: WorkItem, now: float) -> bool:
    """Whether someone holds an unexpired lease on the item."""
    return item.status in HELD and item.lease_expires_at is not None and item.lease_expires_at > now


def dependency_decision(dep_statuses: list[Status | None]) -> str:
    """``release`` when every dependency succeeded, ``cancel`` when one can
    never succeed (or is missing), else ``wait``."""
    if any(s is None or (s.terminal and s is not Status.SUCCEEDED) for s in dep_statuses):
        return "cancel"
    if all(s is Status.SUCCEEDED for s in dep_statuses):
        return "release"
    return "wait"


def release(item: WorkItem, now: float) -> WorkItem:
    """submitted -> ready: the last dependency succeeded."""
    _require(item, Status.SUBMITTED)
    # A delayed item keeps its start time: it may not run before it.
    return evolve(item, status=Status.READY, ready_at=max(now, item.ready_at), updated_at=now)


def claim(item: WorkItem, *, owner: str, token: str, now: float, ttl_s: float) -> WorkItem:
    """ready -> leased: epoch + 1, attempt + 1, a new fencing token."""
    _require(item, Status.READY)
    if item.ready_at > now:
        raise InvalidTransition(f"job {item.id} is not ready until {item.ready_at}")
    return evolve(
        item,
        status=Status.LEASED,
        attempt=item.attempt + 1,
        lease_owner=owner,
        lease_epoch=item.lease_epoch + 1,
        lease_token=token,
        lease_expires_at=now + ttl_s,
        updated_at=now,
    )


#: Attempts left at which a suspect starts to run in ever smaller groups.
ISOLATE_BELOW = 4


def suspect_cap(attempts_before: int, max_attempts: int, reason: str | None) -> int | None:
    """How many suspects near exhaustion one process may hold beside this one
    (itself included), for an item whose last attempt's lease ran out.

    A process that dies takes every turn it held down with it, so each of them
    loses an attempt though only one may have killed it. A suspect that has
    lost two or more and nears its last attempt therefore runs in a group that
    shrinks by 4 per attempt left (16, 4, then alone): a poison turn reaches
    the dead-letter queue on its own, and the turns it took down finish.
    ``None``: no cap (not a suspect, or attempts to spare)."""
    if reason != "lease_expired" or attempts_before < 2:
        return None
    left = max_attempts - attempts_before
    if left >= ISOLATE_BELOW:
        return None
    return int(4 ** max(0, left - 1))


def may_join(cap: int, held_caps: Sequence[int]) -> bool:
    """Whether a suspect with ``cap`` may run beside the capped suspects its
    process already holds: the group stays within every member's cap."""
    return len(held_caps) + 1 <= min([cap, *held_caps])


def lease_of(item: WorkItem) -> Lease:
    """The lease an item currently carries (after a claim)."""
    _require(item, *HELD)
    assert item.lease_owner and item.lease_token and item.lease_expires_at is not None
    return Lease(
        job_id=item.id,
        tenant=item.tenant,
        owner=item.lease_owner,
        epoch=item.lease_epoch,
        token=item.lease_token,
        expires_at=item.lease_expires_at,
    )


def check_fence(item: WorkItem, lease: Lease, now: float) -> None:
    """Raise :class:`LeaseLost` unless ``lease`` is the item's live lease."""
    if item.status not in HELD:
        raise LeaseLost(f"job {item.id} is {item.status.value}; lease epoch {lease.epoch} fenced")
    if (
        item.tenant != lease.tenant
        or item.lease_owner != lease.owner
        or item.lease_epoch != lease.epoch
        or item.lease_token != lease.token
    ):
        raise LeaseLost(f"job {item.id}: lease epoch {lease.epoch} superseded by {item.lease_epoch}")
    if item.lease_expires_at is None or item.lease_expires_at <= now:
        raise LeaseLost(f"job {item.id}: lease epoch {lease.epoch} expired")


def start(item: WorkItem, lease: Lease, now: float) -> WorkItem:
    """leased -> running: the handler started."""
    check_fence(item, lease, now)
    if item.status is Status.RUNNING:
        return item
    return evolve(item, status=Status.RUNNING, updated_at=now)


def renew(item: WorkItem, lease: Lease, now: float, ttl_s: float) -> WorkItem:
    """Extend a live lease; a stale one raises :class:`LeaseLost`."""
    check_fence(item, lease, now)
    return evolve(item, lease_expires_at=now + ttl_s, updated_at=now)


def commit(item: WorkItem, lease: Lease, outcome: Outcome, now: float, backoff_s: float) -> WorkItem:
    """The fenced commit of a handler's outcome.

    Success -> succeeded. A retryable failure -> ready after ``backoff_s`` while
    attempts remain, else dead_letter. A non-retryable failure -> failed. A repeat
    of the same commit by the same lease is a no-op; anything else on a terminal
    item is rejected.
    """
    same_lease = item.lease_epoch == lease.epoch and item.lease_token == lease.token
    if same_lease and item.status is Status.READY and not outcome.ok and outcome.same_as(item):
        return item  # the same retry committed twice (e.g. the first reply was lost)
    if item.status.terminal and same_lease:
        if outcome.same_as(item):
            return item
        if item.status is Status.CANCELLED:
            raise LeaseLost(f"job {item.id} was cancelled; lease epoch {lease.epoch} fenced")
        if item.reason == "lease_exhausted":
            # The lease ran out and the reaper ended the turn: a late commit of
            # this lease is fenced, as any lost lease's is, not a conflict.
            raise LeaseLost(f"job {item.id}: lease epoch {lease.epoch} expired on its last attempt; fenced")
        raise OutcomeConflict(f"job {item.id} is already {item.status.value}")
    check_fence(item, lease, now)
    done = evolve(
        item,
        lease_expires_at=None,
        updated_at=now,
        result=outcome.result if outcome.ok else None,
        error=None if outcome.ok else outcome.error,
    )
    if outcome.ok:
        return evolve(done, status=Status.SUCCEEDED, reason=None, completed_at=now)
    if outcome.dead_letter_reason:
        return evolve(done, status=Status.DEAD_LETTER, reason=outcome.dead_letter_reason, completed_at=now)
    if not outcome.retryable:
        status = Status.CANCELLED if outcome.retired else Status.FAILED
        return evolve(done, status=status, reason=outcome.reason or "non_retryable", completed_at=now)
    if item.attempt >= item.max_attempts:
        return evolve(done, status=Status.DEAD_LETTER, reason="max_attempts", completed_at=now)
    return evolve(done, status=Status.READY, reason=outcome.reason or "retry", ready_at=now + backoff_s)


def expire_lease(item: WorkItem, now: float) -> WorkItem:
    """An expired lease returns the item to ready, or to dead_letter once its
    attempts are exhausted (reason ``lease_exhausted``)."""
    _require(item, *HELD)
    if lease_is_live(item, now):
        raise InvalidTransition(f"job {item.id}: lease is still live")
    if item.attempt >= item.max_attempts:
        return evolve(
            item,
            status=Status.DEAD_LETTER,
            reason="lease_exhausted",
            lease_expires_at=None,
            completed_at=now,
            updated_at=now,
        )
    return evolve(item, status=Status.READY, reason="lease_expired", lease_expires_at=None, updated_at=now)


def holder_gone(item: WorkItem, now: float) -> WorkItem:
    """The process that holds the lease is gone: the lease ends now, as an
    expired one does (the attempt it cost stays counted)."""
    _require(item, *HELD)
    return expire_lease(evolve(item, lease_expires_at=now), now)


def cancel(item: WorkItem, now: float, reason: str = "cancelled") -> WorkItem:
    """Any non-terminal state -> cancelled; a holder is fenced out."""
    _require(item, *ACTIVE)
    return evolve(
        item,
        status=Status.CANCELLED,
        reason=reason,
        lease_expires_at=None,
        completed_at=now,
        updated_at=now,
    )


def replay(item: WorkItem, now: float, extra_attempts: int) -> WorkItem:
    """dead_letter -> ready, as a new attempt of the same item."""
    _require(item, Status.DEAD_LETTER)
    return evolve(
        item,
        status=Status.READY,
        reason="replayed",
        ready_at=now,
        updated_at=now,
        completed_at=None,
        lease_expires_at=None,
        max_attempts=item.attempt + max(1, extra_attempts),
    )
