"""The store seam: the WorkItem authority (claim, renew, commit, cancel, read).

A store applies the pure transitions of :mod:`agentdispatch.workitem` atomically.
Every transition that makes an item ``ready`` writes its envelope row into the
store's ``agent_dispatch_queue`` table in the same transaction: for a transport
on the same database that table *is* the queue; for Kafka it is the outbox a
relay publishes from (``outbox_take`` / ``outbox_done``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from ..envelope import Envelope
from ..errors import LeaseLost
from ..workitem import Lease, Outcome, Status, WorkItem


@dataclass(frozen=True)
class NewJob:
    """A validated submission, ready to be inserted."""

    job_id: str
    tenant: str
    session_id: str
    kind: str
    payload: Any
    max_attempts: int
    agent_name: str = ""
    priority: int = 0
    dependencies: tuple[str, ...] = ()
    deadline_unix: float | None = None
    #: Not claimable before this unix time (absolute), nor before ``delay_s``
    #: seconds after acceptance (by the store's clock); both default to now.
    not_before: float | None = None
    delay_s: float = 0.0
    #: Execution timeout per attempt (seconds), or None (the kind's, if any).
    timeout_s: float | None = None


@dataclass(frozen=True)
class JobFilter:
    """Server-side filters of a job listing (all optional, combined with AND)."""

    kind: str | None = None
    session_id: str | None = None
    agent_name: str | None = None
    #: Created at or after this unix time.
    created_from: float | None = None
    #: Created before this unix time.
    created_to: float | None = None
    #: A substring of the job id (case-sensitive).
    id_contains: str | None = None

    def params(self) -> dict[str, Any]:
        """Named parameters of the stores' ``search`` query."""
        return {
            "kind": self.kind,
            "session_id": self.session_id,
            "agent_name": self.agent_name,
            "created_from": self.created_from,
            "created_to": self.created_to,
            "id_contains": self.id_contains,
        }

    def __bool__(self) -> bool:
        return any(v is not None for v in self.params().values())


@dataclass(frozen=True)
class Schedule:
    """A periodic schedule: one job of ``kind`` per tick of ``cron`` in ``tz``."""

    tenant: str
    name: str
    cron: str
    tz: str
    kind: str
    payload: Any
    next_at: float
    session_id: str | None = None
    priority: int = 0
    agent_name: str = ""
    paused: bool = False
    last_tick: float | None = None
    last_job_id: str | None = None
    created_at: float = 0.0

    def view(self) -> dict[str, Any]:
        """The caller-facing view."""
        return {
            "name": self.name,
            "tenant": self.tenant,
            "cron": self.cron,
            "tz": self.tz,
            "kind": self.kind,
            "payload": self.payload,
            "session_id": self.session_id,
            "priority": self.priority,
            "agent_name": self.agent_name,
            "paused": self.paused,
            "next_at": None if self.paused else self.next_at,
            "last_tick": self.last_tick,
            "last_job_id": self.last_job_id,
            "created_at": self.created_at,
        }


class OutboxRow(NamedTuple):
    """An envelope not yet handed to an external transport, with its item's
    ``seq`` (the session order, which a retry's position in a log does not keep)."""

    id: int
    envelope: Envelope
    seq: int


@dataclass(frozen=True)
class Accepted:
    """One submission's result: the item, and whether this call created it."""

    item: WorkItem
    created: bool


class ClaimKind(StrEnum):
    """What a claim attempt found."""

    CLAIMED = "claimed"  # the lease is yours; the item is running
    SKIPPED = "skipped"  # terminal already: acknowledge the delivery
    NOT_READY = "not_ready"  # waiting on dependencies: a fresh envelope will come
    BUSY = "busy"  # live lease elsewhere, session busy or backoff: leave for later
    EXPIRED = "expired"  # deadline passed: cancelled with reason ``expired``
    MISSING = "missing"  # no such item: poison
    TENANT_MISMATCH = "tenant_mismatch"  # envelope tenant differs: poison


@dataclass(frozen=True)
class Claim:
    """The answer of :meth:`Queue.claim`."""

    kind: ClaimKind
    item: WorkItem | None = None
    lease: Lease | None = None
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class Effect:
    """One row of the side-effect ledger."""

    key: str
    job_id: str
    state: str  # intended | committed | unknown | failed | released
    epoch: int
    result: Any = None
    updated_at: float = 0.0


#: How an attempt settles its ``intended`` mark: the effect ran (``committed``),
#: raised (``failed``: a later attempt runs it again), or its outcome was not
#: seen (``unknown``: a later attempt verifies it or a person decides).
EffectState = Literal["committed", "failed", "unknown"]


@dataclass(frozen=True)
class LedgerOp:
    """One side-effect ledger write of :meth:`Store.ledger_many`: a begin
    (``state`` None: :meth:`Store.effect_begin`) or a settlement
    (:meth:`Store.effect_end` with ``state`` and ``result``)."""

    lease: Lease
    key: str
    state: EffectState | None = None
    result: Any = None
    ttl_s: float = 0.0
    retry_unknown: bool = False


#: The answer to one :class:`LedgerOp`: a begin's ``Effect | None``, a
#: settlement's ``bool``, or the error it raised (:class:`LeaseLost`, ...).
LedgerAnswer = Any


@dataclass(frozen=True)
class WorkerRow:
    """A heartbeat row of ``dispatch_workers``."""

    worker_id: str
    host: str
    capacity: int
    active_sessions: tuple[str, ...]
    queue_backend: str
    started_at: float
    last_heartbeat: float = 0.0
    #: The OS process (:func:`agentdispatch.fleet.process_label`); empty: unknown.
    process: str = ""
    #: The worker's cumulative per-process counts, by series key
    #: (:meth:`agentdispatch.metrics.Metrics.published`), zeros left out.
    counters: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Activity:
    """The counts behind an activity chart: items open (accepted, not finished)
    at ``since``, and per bucket of ``bucket_s`` seconds after it (bucket 0
    first) the items accepted and the items finished, by final status."""

    since: float
    bucket_s: float
    open_at_start: int
    created: dict[int, int]
    finished: dict[int, dict[str, int]]


@dataclass(frozen=True)
class TenantCount:
    """Items of one tenant in one status, and the oldest stamp among them
    (``completed_at``, else ``updated_at``): one row of the fleet gauges."""

    tenant: str
    status: str
    n: int
    oldest: float


@dataclass(frozen=True)
class OldestSnapshot:
    """The transaction holding back a PostgreSQL database's cleanup horizon
    longest: while it is open, no dead row of the queue can be vacuumed."""

    age_s: float
    #: Its backend's pid (None: a prepared transaction, which has no session).
    pid: int | None
    #: ``idle in transaction``, ``active``, ... or ``prepared``.
    state: str

    def holder(self) -> str:
        """Who holds it, for an operator's line."""
        return "a prepared transaction" if self.pid is None else f"backend pid {self.pid} ({self.state})"


@dataclass
class SweepReport:
    """What one reconciler pass did."""

    reclaimed: int = 0
    dead_lettered: int = 0
    expired: int = 0
    redelivered: int = 0
    dropped_rows: int = 0
    details: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Number of repairs made."""
        return self.reclaimed + self.dead_lettered + self.expired + self.redelivered


class Schema(Protocol):
    """The store's database: its schema and its connections."""

    name: str

    def migrate(self) -> None:
        """Create or upgrade the schema."""

    def ping(self) -> None:
        """Raise :class:`TaskQueueUnavailable` unless the store answers and its
        schema is current."""

    def schema_version(self) -> int:
        """The applied migration number (0 when none)."""

    def close(self) -> None:
        """Release connections."""


class Jobs(Protocol):
    """What a caller does with jobs: submit, read, cancel, replay (the Dispatcher)."""

    def submit(self, jobs: Sequence[NewJob], *, max_depth: int) -> list[Accepted]:
        """Insert items and their envelopes atomically, admitting against
        ``max_depth`` active items (raises :class:`QueueFull`)."""

    def get(self, job_id: str, tenant: str | None) -> WorkItem:
        """Read one item (raises :class:`JobNotFound`; ``None`` tenant = admin)."""

    def list_jobs(
        self,
        *,
        tenant: str | None,
        status: Status | None,
        limit: int,
        offset: int,
        filters: JobFilter | None = None,
    ) -> list[WorkItem]:
        """Items newest first, optionally filtered."""

    def history(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        """The job's view and payload, its events (attempts, leases, outcomes)
        and its side-effect ledger."""

    def cancel(self, job_id: str, tenant: str | None, reason: str = "cancelled") -> WorkItem:
        """Cancel a non-terminal item (fencing out any holder)."""

    def replay(self, job_id: str, tenant: str | None) -> WorkItem:
        """Move a dead-lettered item back to ready as a new attempt."""


class Queue(Protocol):
    """What a worker does with an item it runs: claim, renew, checkpoint, commit."""

    def claim(self, job_id: str, tenant: str, *, owner: str, ttl_s: float) -> Claim:
        """Claim and start an item for ``owner`` (epoch + 1, attempt + 1)."""

    def claim_many(self, jobs: Sequence[tuple[str, str]], *, owner: str, ttl_s: float) -> list[Claim]:
        """:meth:`claim` for each (job id, tenant), in one transaction."""

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend a live lease; raises :class:`LeaseLost` when fenced."""

    def renew_many(self, leases: Sequence[Lease], ttl_s: float) -> list[Lease | LeaseLost]:
        """:meth:`renew` for each lease in one transaction (the items read in
        one statement, written in one): a fenced one is answered with its
        :class:`LeaseLost`. ``ttl_s=0`` gives the leases up at once (another
        worker may claim the items now)."""

    def checkpoint(self, lease: Lease, state: str) -> None:
        """Durably save ``state`` (JSON text) as the item's checkpoint, fenced
        like :meth:`renew` (raises :class:`LeaseLost`, writing nothing, unless
        ``lease`` is the item's live lease)."""

    def commit(self, lease: Lease, outcome: Outcome) -> WorkItem:
        """Fenced, durable commit of a handler outcome (releases dependants)."""

    def commit_many(self, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        """:meth:`commit` for each (lease, outcome), durable together; a fenced
        one is answered with its :class:`LeaseLost` and writes nothing."""

    def cancelled_since(self, since: float) -> tuple[float, list[str]]:
        """The database clock now, and the jobs cancelled at or after ``since``
        (database time; one indexed read, for a worker to stop turns it runs)."""


class Ledger(Protocol):
    """The side-effect ledger of a running turn."""

    def effect_begin(self, lease: Lease, key: str, ttl_s: float, *, retry_unknown: bool = False) -> Effect | None:
        """Renew the lease and mark ``key`` intended, in one fenced transaction.
        Returns ``None`` when the caller should run it now, else the existing
        record: ``committed`` (return its result) or ``unknown`` (an earlier
        attempt started it and never confirmed: raise :class:`EffectUnknown`).
        With ``retry_unknown`` an unconfirmed record is taken over instead
        (returns ``None``): the caller verified that the effect did not happen,
        or the downstream deduplicates by key. Raises :class:`LeaseLost` when
        fenced. Never raises after writing."""

    def effect_end(self, lease: Lease, key: str, *, state: EffectState, result: Any) -> bool:
        """Settle this attempt's ``intended`` mark as ``state``. Fenced by the
        epoch on the ledger row: False (and nothing written) when the mark is
        no longer this attempt's (another attempt doubted, verified or re-ran
        the effect, or a replay released it)."""

    def ledger_many(self, ops: Sequence[LedgerOp]) -> list[LedgerAnswer]:
        """Many turns' ledger writes in one durable transaction, each answered
        as its own :meth:`effect_begin` / :meth:`effect_end` call would be (an
        error it would raise is returned in its place; none of them writes
        anything). A database error fails the whole batch."""


class Views(Protocol):
    """The operator's counts and clean-up of finished items."""

    def counts(self, tenant: str | None) -> dict[str, int]:
        """Number of items per status."""

    def depth_breakdown(self, tenant: str | None) -> list[tuple[str, str, str, int]]:
        """Non-terminal items as ``(tenant, kind, status, count)`` rows."""

    def activity(self, tenant: str | None, *, since: float, bucket_s: float) -> Activity:
        """Accepted and finished items per time bucket since ``since``."""

    def purge_dead(self, job_ids: Sequence[str], tenant: str | None) -> list[str]:
        """Delete the dead-lettered items among ``job_ids`` (of ``tenant``; None:
        any) with their events; returns the ids deleted. The side-effect ledger
        is kept."""


class Repair(Protocol):
    """Reconciliation and undeliverable envelopes."""

    def sweep(self, *, redeliver_after_s: float) -> SweepReport:
        """Reconcile: reclaim expired leases, cancel expired deadlines, and
        re-enqueue ready items without an envelope (or, for external
        transports, not re-published for ``redeliver_after_s``)."""

    def reap(self, worker_id: str) -> SweepReport:
        """End at once the leases held by worker ``worker_id``, whose process
        is known to be gone (a peer on its host saw its pid end): each turn goes
        back to ready, or to the dead-letter queue when out of attempts, as
        after an expired lease. The worker's row goes with its last lease."""

    def record_poison(self, raw: str, reason: str) -> bool:
        """Durably dead-letter an undeliverable envelope once; True when new."""

    def poison(self, *, limit: int) -> list[dict[str, Any]]:
        """Recorded poison envelopes, newest first."""


class Fleet(Protocol):
    """The workers' heartbeat rows and the fleet gauges."""

    def heartbeat(self, row: WorkerRow) -> None:
        """Upsert a worker's liveness row (stamped with database time)."""

    def workers(self, *, max_age_s: float = 90.0) -> list[WorkerRow]:
        """Live workers (heartbeat newer than ``max_age_s``)."""

    def remove_worker(self, worker_id: str, counters: Mapping[str, float] | None = None) -> None:
        """Delete a worker's row at clean shutdown. Its counts (``counters``,
        the worker's final ones, when given and the row is still there; else
        the row's last published ones) go into the fleet's in the same
        transaction, as at every deletion of a row (a reaped worker's too)."""

    def fleet_counts(self) -> list[TenantCount]:
        """Open and dead-lettered items per tenant and status (every tenant)."""

    def fleet_counters(self) -> dict[str, float]:
        """The fleet's counts by series key: those of removed workers plus
        every row's (live or not), read in one snapshot, so no key goes down."""


@runtime_checkable
class Horizon(Protocol):
    """A store whose database keeps dead rows while any snapshot is open (PostgreSQL)."""

    def oldest_snapshot(self) -> OldestSnapshot | None:
        """The oldest open transaction of the database, other than the caller's."""


@runtime_checkable
class Compaction(Protocol):
    """A store whose small, update-in-place tables keep the size a long-open
    transaction made them grow to, until rewritten (PostgreSQL)."""

    def compact(self, *, quiet_s: float) -> list[str]:
        """Rewrite those tables far larger than their rows need, unless a
        transaction open ``quiet_s`` or longer remains (the rewrite would keep
        what it may see) or a table is busy (left to the next call); the tables
        rewritten. Cheap when none is."""


class Tokens(Protocol):
    """The gateway's bearer tokens."""

    def token_create(self, token_id: str, token_hash: str, tenant: str, label: str) -> None:
        """Store a gateway bearer token (hashed), bound to ``tenant``."""

    def token_revoke(self, token_id: str) -> bool:
        """Revoke a token; False when unknown or already revoked."""

    def token_lookup(self, token_hash: str) -> str | None:
        """The tenant of a live token, or None."""


class ScheduleStore(Protocol):
    """Periodic schedules and their firing."""

    def schedule_add(self, schedule: Schedule) -> bool:
        """Store a new schedule; False (nothing written) when the name exists."""

    def schedules(self, tenant: str | None) -> list[Schedule]:
        """Schedules by name (``None`` tenant: every tenant's)."""

    def schedule_update(self, tenant: str, name: str, *, paused: bool, next_at: float) -> bool:
        """Pause or resume a schedule; False when there is no such schedule."""

    def schedule_delete(self, tenant: str, name: str) -> bool:
        """Delete a schedule; False when there is no such schedule."""

    def schedules_due(self, limit: int) -> tuple[float, list[Schedule]]:
        """Database time, and the running schedules whose next tick is due."""

    def schedule_advance(self, schedule: Schedule, *, next_at: float, last_tick: float, last_job_id: str) -> bool:
        """Move a due schedule on to ``next_at`` if its next tick is still the
        one read (compare-and-set); False when another firer moved it first."""


class Outbox(Protocol):
    """Envelope rows awaiting an external transport (the Kafka relay)."""

    def outbox_take(self, limit: int) -> list[OutboxRow]:
        """Envelope rows not yet handed to an external transport."""

    def outbox_lease(self, owner: str, limit: int, hold_s: float) -> list[OutboxRow]:
        """Like :meth:`outbox_take`, but only rows no other relay took within
        ``hold_s`` (``owner``'s own included), marked as ``owner``'s: relays of
        several processes then publish a row once, not once each."""

    def outbox_done(self, row_ids: Sequence[int]) -> None:
        """Mark rows as delivered to the external transport (delete them)."""


@runtime_checkable
class Store(Schema, Jobs, Queue, Ledger, Views, Repair, Fleet, Tokens, ScheduleStore, Outbox, Protocol):
    """The WorkItem authority, every part of it: what a backend implements.
    Time is the database's clock. A caller types its store as the smallest
    part it uses."""
