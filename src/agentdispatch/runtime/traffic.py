"""The worker's store and transport traffic, in batches: claims of several
turns per transaction, fenced commits and acknowledgements in groups, and the
release of turns given back at shutdown. Blocking calls, made off the loop."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..envelope import Envelope
from ..errors import InvalidEnvelope, LeaseLost
from ..metrics import Metrics
from ..stores.base import Claim, ClaimKind, Store
from ..transports.base import Delivery, Transport
from ..workitem import Lease, Outcome
from .turn import BY_STATUS, TurnEnd

log = logging.getLogger("agentdispatch.runtime")


@dataclass(frozen=True)
class Claimed:
    """A delivery whose item this worker now holds under ``claim.lease``."""

    delivery: Delivery
    envelope: Envelope
    claim: Claim


@dataclass(frozen=True)
class Finished:
    """A turn whose handler finished, waiting for its fenced commit."""

    delivery: Delivery
    lease: Lease
    outcome: Outcome


class Traffic:
    """Batch verbs over one store and transport (each call one transaction
    where both share a database)."""

    def __init__(
        self,
        store: Store,
        transport: Transport,
        *,
        owner: str,
        ttl_s: float,
        metrics: Metrics,
        count: Callable[[TurnEnd], None],
    ) -> None:
        self.store = store
        self.transport = transport
        self.owner = owner
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.count = count

    def claim(self, n: int) -> tuple[list[Claimed], bool]:
        """Up to ``n`` deliveries and their claims; every delivery that is not
        claimed is settled here (poison, busy, skipped, expired). The flag:
        the queue ran dry."""
        with self.transport.atomic(durable=False):
            deliveries = self.transport.get_many(self.owner, n, visibility_s=self.ttl_s)
            envs: list[Envelope | None] = [self._envelope(d) for d in deliveries]
            jobs = [(e.job_id, e.tenant) for e in envs if e is not None]
            reads = [d.read for d, e in zip(deliveries, envs, strict=True) if e is not None]
            claims = iter(self.store.claim_many(jobs, owner=self.owner, ttl_s=self.ttl_s, reads=reads) if jobs else [])
            out: list[Claimed] = []
            for d, e in zip(deliveries, envs, strict=True):
                if e is None:
                    continue
                claim = next(claims)
                if self._settle(d, e, claim):
                    out.append(Claimed(d, e, claim))
        return out, len(deliveries) < n

    def _envelope(self, delivery: Delivery) -> Envelope | None:
        if delivery.deliveries > 1:
            self.metrics.redeliveries.inc()
        try:
            return Envelope.from_json(delivery.raw)
        except InvalidEnvelope as exc:
            self._poison(delivery, str(exc))
            return None

    def _poison(self, delivery: Delivery, reason: str) -> None:
        self.store.record_poison(delivery.raw, reason)
        self.transport.ack(delivery)
        self.count(TurnEnd.POISON)

    def _settle(self, delivery: Delivery, env: Envelope, claim: Claim) -> bool:
        """True for a claim to run; anything else is settled now."""
        if claim.kind is ClaimKind.CLAIMED:
            return True
        if claim.kind in (ClaimKind.MISSING, ClaimKind.TENANT_MISMATCH):
            self._poison(delivery, f"{claim.kind.value}: envelope for job {env.job_id}")
        elif claim.kind is ClaimKind.BUSY:
            self.transport.release(delivery, max(0.05, min(claim.retry_after_s, self.ttl_s)))
            self.count(TurnEnd.BUSY)
        else:
            self.transport.ack(delivery)
            self.count(TurnEnd.EXPIRED if claim.kind is ClaimKind.EXPIRED else TurnEnd.SKIPPED)
        return False

    def finish(self, done: Sequence[Finished]) -> list[TurnEnd]:
        """The fenced commits (one store call) and acks (one transport call)
        of finished turns, durable together; a fenced turn wrote nothing and
        its delivery is given back."""
        with self.transport.atomic(durable=True):
            results = self.store.commit_many([(d.lease, d.outcome) for d in done])
            ends: list[TurnEnd] = []
            acks: list[Delivery] = []
            for d, item in zip(done, results, strict=True):
                if isinstance(item, LeaseLost):
                    self.transport.release(d.delivery, 0.0)
                    ends.append(TurnEnd.FENCED)
                    continue
                acks.append(d.delivery)
                ends.append(BY_STATUS.get(item.status, TurnEnd.FAILED))
            self.transport.ack_many(acks)
        self.metrics.commit_batch.observe(len(done))
        return ends

    def give_back(self, deliveries: Sequence[Delivery], leases: Sequence[Lease]) -> None:
        """Turns that commit nothing: their deliveries visible again now and
        (``leases``, given up at shutdown) their leases expired at once, so
        that another worker claims them without waiting out the TTL."""
        if leases:
            with contextlib.suppress(Exception):  # else they expire with their TTL
                self.store.renew_many(leases, 0.0)
        for d in deliveries:
            try:
                self.transport.release(d, 0.0)
            except Exception as exc:  # the delivery's visibility runs out anyway
                log.warning("releasing a delivery failed: %s", exc)
