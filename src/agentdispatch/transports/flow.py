"""The worker's seam to queue and store together: three batch verbs, each one
transaction where the queue lives in the store's database.

* **claim n**: deliveries and the claims of their items under leases; every
  delivery that is not claimed is settled there (poison, busy, skipped,
  expired);
* **finish many**: the fenced commits of finished turns with the
  acknowledgement (or, for a fenced one, the release) of their deliveries,
  and on one database the next claims in the same transaction;
* **release many**: leases given up and deliveries given back at once.

A backend whose queue shares its store's database supplies :class:`Sides`:
its transaction and its own queue and store statements run on that
transaction's connection, passed explicitly (nothing thread-local joins them).
:class:`Shared` runs the verbs over them. :class:`Separate` composes a queue
elsewhere (Kafka) with a store: two transactions, the store's first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from ..envelope import Envelope
from ..errors import InvalidEnvelope, LeaseLost
from ..stores.base import Claim, ClaimKind, Store
from ..workitem import Lease, Outcome, Status, WorkItem
from .base import Delivery, Receiver

log = logging.getLogger("agentdispatch.flow")


class TurnEnd(StrEnum):
    """How a delivery ended, as counted by the turns metric."""

    COMPLETED = "completed"
    RETRIED = "retried"
    DEAD_LETTER = "dead_letter"
    FAILED = "failed"
    FENCED = "fenced"  # the lease was lost: nothing committed
    RELEASED = "released"  # given back at shutdown: nothing committed
    POISON = "poison"
    BUSY = "busy"
    SKIPPED = "skipped"
    EXPIRED = "expired"


#: Where a commit left an item.
BY_STATUS = {
    Status.SUCCEEDED: TurnEnd.COMPLETED,
    Status.READY: TurnEnd.RETRIED,
    Status.DEAD_LETTER: TurnEnd.DEAD_LETTER,
}


@dataclass(frozen=True)
class Claimed:
    """A delivery whose item the owner now holds under ``claim.lease``."""

    delivery: Delivery
    envelope: Envelope
    claim: Claim


@dataclass(frozen=True)
class Finished:
    """A turn whose handler finished, waiting for its fenced commit."""

    delivery: Delivery
    lease: Lease
    outcome: Outcome


@dataclass(frozen=True)
class Batch:
    """The answer of a claim: the turns to run, how the other deliveries
    ended, and how many deliveries were asked for and came."""

    claimed: list[Claimed] = field(default_factory=list)
    ends: list[TurnEnd] = field(default_factory=list)
    asked: int = 0
    got: int = 0
    #: Deliveries that came more than once (the redeliveries metric).
    redelivered: int = 0

    @property
    def dry(self) -> bool:
        """Fewer deliveries came than were asked for: the queue ran dry."""
        return self.got < self.asked


class Flow(Protocol):
    """The worker's batch verbs over one store and its queue."""

    def claim(self, owner: str, n: int, *, ttl_s: float, wait_s: float = 0.0) -> Batch:
        """Up to ``n`` deliveries for ``owner`` and the claims of their items
        (leases of ``ttl_s``), in one transaction where the backend can. When
        nothing came, wait up to ``wait_s`` for news (outside any transaction;
        what arrives then may be delivered now or left for the next call)."""

    def finish(
        self, done: Sequence[Finished], *, then: int = 0, owner: str = "", ttl_s: float = 0.0
    ) -> tuple[list[TurnEnd], Batch]:
        """Commit each finished turn (fenced) and acknowledge its delivery (a
        fenced one's is released), durable together; how each ended, in
        order. ``then``: claim up to that many next turns for ``owner`` in the
        same transaction, where the backend can (the batch says how many it
        asked for: the caller claims the rest unless it ran dry). A failure of
        those claims never costs the commits: they are made again alone, and
        the batch answers as if the queue ran dry."""

    def release(self, deliveries: Sequence[Delivery], leases: Sequence[Lease] = ()) -> None:
        """Give deliveries back (visible again now) and ``leases`` up (expired
        now, so that another worker claims them without waiting out the TTL)."""


# -- what every implementation decides the same way (pure) ---------------------


@dataclass
class Plan:
    """What a claim does with its deliveries besides running the claimed ones."""

    claimed: list[Claimed] = field(default_factory=list)
    ends: list[TurnEnd] = field(default_factory=list)
    poison: list[tuple[Delivery, str]] = field(default_factory=list)  # recorded, then acknowledged
    acks: list[Delivery] = field(default_factory=list)
    releases: list[tuple[Delivery, float]] = field(default_factory=list)

    def batch(self, asked: int, deliveries: Sequence[Delivery]) -> Batch:
        """The caller's answer."""
        again = sum(1 for d in deliveries if d.deliveries > 1)
        return Batch(self.claimed, self.ends, asked, len(deliveries), again)


def parse(deliveries: Sequence[Delivery]) -> tuple[list[tuple[Delivery, Envelope]], Plan]:
    """The deliveries whose envelope parses, and a plan that poisons the rest."""
    plan = Plan()
    good: list[tuple[Delivery, Envelope]] = []
    for d in deliveries:
        try:
            good.append((d, Envelope.from_json(d.raw)))
        except InvalidEnvelope as exc:
            plan.poison.append((d, str(exc)))
            plan.ends.append(TurnEnd.POISON)
    return good, plan


def settle(plan: Plan, good: Sequence[tuple[Delivery, Envelope]], claims: Sequence[Claim], ttl_s: float) -> Plan:
    """Add to ``plan`` what each claim answer means for its delivery."""
    for (d, env), claim in zip(good, claims, strict=True):
        if claim.kind is ClaimKind.CLAIMED:
            plan.claimed.append(Claimed(d, env, claim))
        elif claim.kind in (ClaimKind.MISSING, ClaimKind.TENANT_MISMATCH):
            plan.poison.append((d, f"{claim.kind.value}: envelope for job {env.job_id}"))
            plan.ends.append(TurnEnd.POISON)
        elif claim.kind is ClaimKind.BUSY:
            plan.releases.append((d, max(0.05, min(claim.retry_after_s, ttl_s))))
            plan.ends.append(TurnEnd.BUSY)
        else:
            plan.acks.append(d)
            plan.ends.append(TurnEnd.EXPIRED if claim.kind is ClaimKind.EXPIRED else TurnEnd.SKIPPED)
    return plan


def outcomes(
    done: Sequence[Finished], results: Sequence[WorkItem | LeaseLost]
) -> tuple[list[TurnEnd], list[Delivery], list[Delivery]]:
    """How each commit ended, the deliveries to acknowledge and (fenced: the
    turn wrote nothing) those to give back."""
    ends: list[TurnEnd] = []
    acks: list[Delivery] = []
    back: list[Delivery] = []
    for d, item in zip(done, results, strict=True):
        if isinstance(item, LeaseLost):
            back.append(d.delivery)
            ends.append(TurnEnd.FENCED)
        else:
            acks.append(d.delivery)
            ends.append(BY_STATUS.get(item.status, TurnEnd.FAILED))
    return ends, acks, back


def one_by_one(get_one: Callable[[], Delivery | None], n: int) -> list[tuple[Delivery, Any]]:
    """Up to ``n`` deliveries of a queue that hands out one a statement (with
    no item read riding along), until it runs dry."""
    out: list[tuple[Delivery, Any]] = []
    while len(out) < n and (got := get_one()) is not None:
        out.append((got, None))
    return out


def jobs_of(good: Sequence[tuple[Delivery, Envelope]]) -> list[tuple[str, str]]:
    """(job id, tenant) of each parsed delivery."""
    return [(e.job_id, e.tenant) for _, e in good]


# -- one database ----------------------------------------------------------------

C = TypeVar("C")


class Sides(Protocol[C]):
    """What a backend whose queue lives in its store's database supplies: its
    transaction, and queue and store statements on that transaction's
    connection ``c``."""

    def tx(self, durable: bool) -> AbstractContextManager[C]:
        """One write transaction (``durable``: committed to disk before it returns)."""

    def get(self, c: C, owner: str, n: int, visibility_s: float) -> list[tuple[Delivery, Any]]:
        """Up to ``n`` deliveries in claim order, each with what the get read of
        its item for the claim (the backend's own; None when nothing)."""

    def claim(self, c: C, jobs: Sequence[tuple[str, str, Any]], owner: str, ttl_s: float) -> list[Claim]:
        """Claim each (job id, tenant, read of the get)."""

    def commit(self, c: C, done: Sequence[tuple[Lease, Outcome]]) -> list[WorkItem | LeaseLost]:
        """The fenced commits (a fenced one writes nothing and answers its error)."""

    def poison(self, c: C, raw: str, reason: str) -> None:
        """Record an envelope that cannot run."""

    def ack(self, c: C, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge (delete) deliveries still owned by their receipts."""

    def release(self, c: C, delivery: Delivery, delay_s: float) -> None:
        """Make a delivery visible again after ``delay_s``."""

    def give_up(self, c: C, leases: Sequence[Lease]) -> None:
        """Expire live leases now."""

    def wait(self, timeout_s: float) -> None:
        """Until envelopes may have arrived (the transport's wait)."""


class Shared:
    """:class:`Flow` on one database: every verb is one transaction of ``sides``.
    ``rides``: how many next claims may ride in a commit's transaction (small
    where a claim marks shared fairness rows: a long transaction would hold
    those marks back from the other claimants, which would then keep serving
    the same tenant)."""

    def __init__(self, sides: Sides[Any], *, rides: int) -> None:
        self.sides = sides
        self.rides = rides

    def _claim_in(self, c: Any, owner: str, n: int, ttl_s: float) -> Batch:
        s = self.sides
        got = s.get(c, owner, n, ttl_s)
        deliveries = [d for d, _ in got]
        good, plan = parse(deliveries)
        reads = {id(d): r for d, r in got}
        jobs = [(e.job_id, e.tenant, reads[id(d)]) for d, e in good]
        settle(plan, good, s.claim(c, jobs, owner, ttl_s) if jobs else [], ttl_s)
        for d, reason in plan.poison:
            s.poison(c, d.raw, reason)
        acks = plan.acks + [d for d, _ in plan.poison]
        if acks:
            s.ack(c, acks)
        for d, delay in plan.releases:
            s.release(c, d, delay)
        return plan.batch(n, deliveries)

    def claim(self, owner: str, n: int, *, ttl_s: float, wait_s: float = 0.0) -> Batch:
        with self.sides.tx(False) as c:
            batch = self._claim_in(c, owner, n, ttl_s)
        if not batch.got and wait_s > 0:
            self.sides.wait(wait_s)  # outside the transaction: it holds locks
        return batch

    def _finish_in(self, c: Any, done: Sequence[Finished]) -> list[TurnEnd]:
        s = self.sides
        ends, acks, back = outcomes(done, s.commit(c, [(d.lease, d.outcome) for d in done]))
        for d in back:
            s.release(c, d, 0.0)
        if acks:
            s.ack(c, acks)
        return ends

    def finish(
        self, done: Sequence[Finished], *, then: int = 0, owner: str = "", ttl_s: float = 0.0
    ) -> tuple[list[TurnEnd], Batch]:
        ride = min(then, self.rides)
        if ride:
            try:
                with self.sides.tx(True) as c:
                    ends = self._finish_in(c, done)
                    try:
                        batch = self._claim_in(c, owner, ride, ttl_s)
                    except Exception as exc:  # whatever it was, the commits must not pay for it
                        raise _ChainFailed from exc
                return ends, batch
            except _ChainFailed as failed:
                log.warning("claiming the next turns with a commit failed (%s); committing alone", failed.__cause__)
                with self.sides.tx(True) as c:
                    # As if the queue ran dry: the caller claims no more now.
                    return self._finish_in(c, done), Batch(asked=ride)
        with self.sides.tx(True) as c:
            return self._finish_in(c, done), Batch()

    def release(self, deliveries: Sequence[Delivery], leases: Sequence[Lease] = ()) -> None:
        with self.sides.tx(False) as c:
            if leases:
                self.sides.give_up(c, leases)
            for d in deliveries:
                self.sides.release(c, d, 0.0)


class _ChainFailed(Exception):
    """The claims riding with a commit failed: roll both back, commit alone."""


# -- two systems -------------------------------------------------------------------


class Separate:
    """:class:`Flow` over a store and a queue that share no transaction
    (Kafka): the store's transaction first, then the queue's calls, so that a
    crash between them redelivers a turn whose outcome is already recorded
    (and the store answers that delivery "skipped")."""

    def __init__(self, store: Store, transport: Receiver) -> None:
        self.store = store
        self.transport = transport

    def claim(self, owner: str, n: int, *, ttl_s: float, wait_s: float = 0.0) -> Batch:
        deliveries = self.transport.get_many(owner, n, visibility_s=ttl_s)
        if not deliveries and wait_s > 0:
            got = self.transport.get(owner, visibility_s=ttl_s, wait_s=wait_s)
            deliveries = [] if got is None else [got]
        return self.admit(owner, deliveries, ttl_s=ttl_s, asked=n)

    def admit(self, owner: str, deliveries: Sequence[Delivery], *, ttl_s: float, asked: int | None = None) -> Batch:
        """Claim the items of deliveries already received (one store call) and
        settle the rest."""
        good, plan = parse(deliveries)
        jobs = jobs_of(good)
        settle(plan, good, self.store.claim_many(jobs, owner=owner, ttl_s=ttl_s) if jobs else [], ttl_s)
        for d, reason in plan.poison:
            self.store.record_poison(d.raw, reason)
            self.transport.ack(d)
        for d in plan.acks:
            self.transport.ack(d)
        for d, delay in plan.releases:
            self.transport.release(d, delay)
        return plan.batch(len(deliveries) if asked is None else asked, deliveries)

    def finish(
        self, done: Sequence[Finished], *, then: int = 0, owner: str = "", ttl_s: float = 0.0
    ) -> tuple[list[TurnEnd], Batch]:
        ends, acks, back = outcomes(done, self.store.commit_many([(d.lease, d.outcome) for d in done]))
        for d in back:
            self.transport.release(d, 0.0)
        self.transport.ack_many(acks)
        return ends, Batch()

    def release(self, deliveries: Sequence[Delivery], leases: Sequence[Lease] = ()) -> None:
        try:
            if leases:
                self.store.renew_many(leases, 0.0)
        finally:  # two systems: the deliveries go back even if the leases could not
            for d in deliveries:
                self.transport.release(d, 0.0)
