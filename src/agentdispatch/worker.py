"""claim -> guard -> run handler -> fenced commit -> ack, on N threads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .envelope import Envelope
from .errors import (
    AgentDispatchError,
    InvalidEnvelope,
    LeaseLost,
)
from .faults import Backoff, recoverable, unavailable
from .fleet import host_label, new_worker_id
from .handlers import Registry, outcome_of
from .lanes import LABELS, Finished, Lane, Step
from .lease import LeaseGuard, Renewer
from .metrics import Metrics
from .policy import Backpressure, batch_size
from .reconciler import Reconciler
from .settings import Settings
from .stores.base import Claim, ClaimKind, Store, WorkerRow
from .transports.base import Delivery, Transport
from .workitem import Lease, Outcome, WorkItem

log = logging.getLogger("agentdispatch.worker")


@dataclass
class WorkerOptions:
    """Knobs of one worker process."""

    threads: int = 1
    grace_s: float = 30.0
    heartbeat_s: float = 30.0
    get_wait_s: float = 0.5
    reconcile: bool = True
    #: On a shared database a claim thread takes up to this many turns per
    #: commit transaction while turns are fast (one fsync for all of them)...
    batch_max: int = 32
    #: ...as many as run within this budget, which also bounds how long a
    #: finished turn waits for its commit (and a claimed one for its start).
    batch_budget_s: float = 0.025


@dataclass
class _State:
    active: dict[int, str] = field(default_factory=dict)
    last_beat: float = 0.0


class Worker:
    """One worker process: N claim threads, a heartbeat, a reconciler."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        transport: Transport,
        registry: Registry,
        *,
        options: WorkerOptions | None = None,
        metrics: Metrics | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.transport = transport
        self.registry = registry
        self.options = options or WorkerOptions()
        self.metrics = metrics or Metrics()
        self.worker_id = worker_id or new_worker_id()
        self.stopping = threading.Event()
        self._state = _State()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._started_at = time.time()
        self._beat_deferred = False
        self.backpressure = Backpressure()
        self.renewer = Renewer()
        # Per claim thread: turns claimed in the transaction that committed the
        # previous ones, and finished turns waiting for that commit (see _flush).
        self._lanes: dict[int, Lane] = {}
        self._counters: dict[str, Any] = {}  # turns counter per outcome label
        #: The error that stopped the worker, if any (the process exits non-zero).
        self.fatal: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------
    def preflight(self) -> None:
        """Raise :class:`TaskQueueUnavailable` unless store and transport answer."""
        self.store.ping()
        self.transport.ping()

    def start(self) -> None:
        """Start claim threads, heartbeat and reconciler (non-blocking)."""
        self._beat(force=True)
        for i in range(self.options.threads):
            t = threading.Thread(target=self._claim_loop, args=(i,), name=f"claim-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self._reconciler = (
            Reconciler(self.store, self.transport, self.settings.claim_ttl_s).start()
            if self.options.reconcile
            else None
        )

    def stop(self, grace_s: float | None = None) -> bool:
        """Stop claiming, let running turns finish within the grace period.
        Returns True when every thread finished in time."""
        self.stopping.set()
        deadline = time.monotonic() + (self.options.grace_s if grace_s is None else grace_s)
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        clean = not any(t.is_alive() for t in self._threads)
        if self._reconciler is not None:
            self._reconciler.stop()
        self.renewer.close()
        # Best effort: the row ages out anyway, and a broken store must not
        # turn a clean stop into a crash (nor hide the fatal error's status).
        with contextlib.suppress(Exception):
            self.store.remove_worker(self.worker_id)
        return clean

    def run_forever(self) -> bool:
        """Start and block until :attr:`stopping` is set (by a signal)."""
        self.start()
        while not self.stopping.wait(0.5):
            pass
        return self.stop()

    # -- heartbeat ----------------------------------------------------------
    def _beat(self, *, force: bool = False) -> None:
        now = time.time()
        with self._lock:
            if not force and now - self._state.last_beat < 1.0:
                # At most one heartbeat write per second from claims: this one
                # is deferred (not dropped), so the new session shows within 1 s.
                if not self._beat_deferred:
                    self._beat_deferred = True
                    timer = threading.Timer(1.0 - (now - self._state.last_beat), self._deferred_beat)
                    timer.daemon = True
                    timer.start()
                return
            self._state.last_beat = now
            sessions = tuple(sorted(set(self._state.active.values())))
        try:
            self.store.heartbeat(
                WorkerRow(
                    worker_id=self.worker_id,
                    host=host_label(),
                    capacity=self.options.threads,
                    active_sessions=sessions,
                    queue_backend=self.transport.name,
                    started_at=self._started_at,
                )
            )
        except Exception as exc:  # the heartbeat thread must outlive a store error
            if not recoverable(exc):
                raise
            log.warning("heartbeat failed: %s", exc)

    def _deferred_beat(self) -> None:
        with self._lock:
            self._beat_deferred = False
        if not self.stopping.is_set():
            self._beat(force=True)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.options.heartbeat_s):
            # Fleet gauges are read from the store at scrape time (metrics.FleetCollector).
            self._beat(force=True)

    # -- the claim loop -----------------------------------------------------
    def lane(self, index: int) -> Lane | None:
        """The turns claim thread ``index`` holds (claimed and not started,
        finished and not committed), or None before its first claim: for tests
        and debugging; the worker's own threads change it."""
        return self._lanes.get(index)

    def _lane(self, index: int) -> Lane:
        lane = self._lanes.get(index)
        if lane is None:
            lane = self._lanes[index] = Lane()
        return lane

    def _claim_loop(self, index: int) -> None:
        owner = f"{self.worker_id}:{index}"
        lane = self._lane(index)
        loop = asyncio.new_event_loop()
        backoff = Backoff()
        try:
            # Turns already claimed run even when stopping, and finished ones
            # are committed.
            while not self.stopping.is_set() or lane.claimed or lane.done:
                busy = lane.claimed or lane.done
                delay = 0.0 if busy else self.backpressure.claim_delay()
                if delay and self.stopping.wait(delay):
                    break
                try:
                    self.poll(owner, index, loop)
                except Exception as exc:
                    if not recoverable(exc):
                        self._fatal(index, exc)
                        return
                    # Stopping: what is held is left to its leases.
                    if self.stopping.wait(self._backed_off(index, exc, backoff)):
                        break
                    continue
                if backoff.failures:
                    log.info("claim thread %d resumed after %d failed attempt(s)", index, backoff.reset())
        finally:
            loop.close()

    def _backed_off(self, index: int, exc: Exception, backoff: Backoff) -> float:
        """Report a failed poll (log and metric); the seconds to wait."""
        wait = backoff.failed()
        self.metrics.worker_errors.labels(error=type(exc).__name__).inc()
        if isinstance(exc, AgentDispatchError) and not unavailable(exc):
            log.exception("claim thread %d: turn failed in the dispatcher: %s", index, exc)
        else:
            log.warning("claim thread %d: store or transport failed, retrying in %.1f s: %s", index, wait, exc)
        return wait

    def _fatal(self, index: int, exc: Exception) -> None:
        """An error no retry mends: stop the worker; the process exits non-zero."""
        log.critical("claim thread %d: unrecoverable error, the worker stops", index, exc_info=exc)
        if self.fatal is None:
            self.fatal = exc
        self.stopping.set()

    def _count(self, outcome: str) -> None:
        counter = self._counters.get(outcome)
        if counter is None:
            counter = self._counters[outcome] = self.metrics.turns.labels(outcome=outcome)
        counter.inc()

    def _poison(self, delivery: Delivery, reason: str) -> None:
        self.store.record_poison(delivery.raw, reason)
        self.transport.ack(delivery)
        self._count("poison")

    def poll(self, owner: str, index: int, loop: asyncio.AbstractEventLoop) -> str | None:
        """One step of a claim thread; returns the outcome label (``pending``
        while a finished turn waits for its batch's commit), or None when idle.

        On a shared database the delivery and the claim are one transaction."""
        lane = self._lane(index)
        if lane.claimed:
            lane.step(time.monotonic(), chained=True)
            return self._execute(*lane.claimed.popleft(), owner=owner, index=index, loop=loop)
        if lane.done:
            return self._flush(lane, owner)
        stolen = self._steal(lane)
        if stolen is not None:
            lane.step(time.monotonic(), chained=False)
            return self._execute(*stolen, owner=owner, index=index, loop=loop)
        if lane.dry:
            # The claim that rode with the last commit found nothing: wait for
            # a notification since then (or the poll) before claiming again.
            lane.dry = False
            self.transport.wait(self.options.get_wait_s)
            return None
        got = self._get_and_claim(owner)
        if got is None:
            if self.transport.shared_database:
                # Idle: wait outside any transaction; the next poll gets and
                # claims in one transaction again (one get per wake-up).
                self.transport.wait(self.options.get_wait_s)
                return None
            ttl = self.settings.claim_ttl_s
            delivery = self.transport.get(owner, visibility_s=ttl, wait_s=self.options.get_wait_s)
            if delivery is None:
                return None
            got = (delivery, self._admit(delivery, owner))
        delivery, step = got
        if isinstance(step, str):
            return step
        lane.step(time.monotonic(), chained=False)
        return self._execute(delivery, step, owner=owner, index=index, loop=loop)

    def _steal(self, lane: Lane) -> tuple[Delivery, Step] | None:
        """A turn another claim thread of this worker claimed and cannot start:
        its running turn has taken far longer than the batch budget (a hung
        or slow handler among fast ones). Its lease goes with it."""
        now = time.monotonic()
        after_s = max(4 * self.options.batch_budget_s, 0.1)
        for other in list(self._lanes.values()):
            if other is not lane and other.stalled(now, after_s):
                got = other.steal()
                if got is not None:
                    return got
        return None

    def _get_and_claim(self, owner: str) -> tuple[Delivery, str | Step] | None:
        """Get a delivery and settle or claim it, in one transaction on a
        shared database (the get also reads the item for the claim)."""
        with self.transport.atomic(durable=False):
            delivery = self.transport.get(owner, visibility_s=self.settings.claim_ttl_s, wait_s=0.0)
            return None if delivery is None else (delivery, self._admit(delivery, owner))

    def process(self, delivery: Delivery, *, owner: str, index: int, loop: asyncio.AbstractEventLoop) -> str:
        """Handle one delivery end to end; returns the outcome label. Its commit
        claims nothing else (no turn is left for a claim loop to run)."""
        step = self._admit(delivery, owner)
        if isinstance(step, str):
            return step
        return self._execute(delivery, step, owner=owner, index=index, loop=loop, chain=False)

    def _admit(self, delivery: Delivery, owner: str) -> str | Step:
        """Validate and claim; every outcome but a claim is settled here."""
        return self._admit_many([delivery], owner)[0]

    def _admit_many(self, deliveries: list[Delivery], owner: str) -> list[str | Step]:
        """:meth:`_admit` for a batch, the claims in one store call."""
        envs = [self._envelope(d) for d in deliveries]
        jobs = [(e.job_id, e.tenant) for e in envs if isinstance(e, Envelope)]
        reads = [d.read for d, e in zip(deliveries, envs, strict=True) if isinstance(e, Envelope)]
        at = time.monotonic()  # before the claim: no lease of it expires sooner than at + TTL
        ttl_s = self.settings.claim_ttl_s
        claims = iter(self.store.claim_many(jobs, owner=owner, ttl_s=ttl_s, reads=reads) if jobs else [])
        pairs = zip(deliveries, envs, strict=True)
        return [e if isinstance(e, str) else self._settle_claim(d, e, next(claims), at) for d, e in pairs]

    def _envelope(self, delivery: Delivery) -> Envelope | str:
        if delivery.deliveries > 1:
            self.metrics.redeliveries.inc()
        try:
            return Envelope.from_json(delivery.raw)
        except InvalidEnvelope as exc:
            self._poison(delivery, str(exc))
            return "poison"

    def _settle_claim(self, delivery: Delivery, env: Envelope, claim: Claim, at: float) -> str | Step:
        if claim.kind in (ClaimKind.MISSING, ClaimKind.TENANT_MISMATCH):
            self._poison(delivery, f"{claim.kind.value}: envelope for job {env.job_id}")
            return "poison"
        if claim.kind is ClaimKind.BUSY:
            self.transport.release(delivery, max(0.05, min(claim.retry_after_s, self.settings.claim_ttl_s)))
            self._count("busy")
            return "busy"
        if claim.kind is not ClaimKind.CLAIMED:
            self.transport.ack(delivery)
            label = {ClaimKind.EXPIRED: "expired"}.get(claim.kind, "skipped")
            self._count(label)
            return label
        return env, claim, at

    def _execute(
        self,
        delivery: Delivery,
        step: Step,
        *,
        owner: str,
        index: int,
        loop: asyncio.AbstractEventLoop,
        chain: bool = True,
    ) -> str:
        env, claim, claimed_at = step
        assert claim.item is not None and claim.lease is not None
        item = claim.item
        self.metrics.time_in_queue.observe(max(0.0, time.time() - env.enqueued_at))
        self.metrics.attempts.observe(item.attempt)
        with self._lock:
            self._state.active[index] = item.session_id
        self._beat()
        lane = self._lane(index)
        lane.running = True
        try:
            outcome = self._run(item, claim.lease, loop, claimed_at)
        finally:
            lane.running = False
            with self._lock:
                self._state.active.pop(index, None)
        if outcome is None:
            return self._fenced(delivery)
        if not lane.done:
            lane.since = time.monotonic()
        lane.done.append(Finished(delivery, *outcome))
        fresh = time.monotonic() - lane.since < self.options.batch_budget_s
        if chain and lane.claimed and fresh and not self.stopping.is_set():
            return "pending"  # committed with the rest of the batch
        return self._flush(lane, owner, chain=chain)

    def _run(
        self, item: WorkItem, lease: Lease, loop: asyncio.AbstractEventLoop, claimed_at: float
    ) -> tuple[Lease, Outcome] | None:
        """Run the handler under a lease guard; None when the lease was lost
        (then the handler never started, or its outcome is not committed)."""
        guard = LeaseGuard(
            self.store,
            lease,
            ttl_s=self.settings.claim_ttl_s,
            renew_interval_s=self.settings.renew_interval_s,
            renewer=self.renewer,
        )
        # A turn that waited in its lane for a renewal period or more (behind
        # a slow one of its batch) may have lost its lease: confirm it first.
        if time.monotonic() - claimed_at >= guard.every and not _confirmed(guard):
            return None
        guard.start()
        started = time.monotonic()
        outcome = outcome_of(self.registry, item, guard, loop)
        guard.stop()
        self.backpressure.record(outcome is not None and outcome.ok, time.monotonic() - started)
        if outcome is None or guard.lost:
            return None
        return guard.lease, outcome

    def _flush(self, lane: Lane, owner: str, *, chain: bool = True) -> str:
        """The fenced commits and acknowledgements of the lane's finished turns:
        one durable transaction on a shared database, else each commit, then
        its ack. Returns the label of the last turn.

        On a shared database the same transaction also claims this thread's
        next turns (up to the transport's ``claims_with_commit``; the rest of
        a batch is claimed in short transactions of its own), as many as fast
        turns fit the batch budget: one write and one fsync for the lot.
        Should a claim fail, the whole transaction rolls back and the commits
        and acks are made again on their own: a claim never costs a commit. A
        commit the store cannot make now is kept and made again by the next
        poll (after the claim loop's back-off)."""
        done, lane.done = lane.done, []
        try:
            want = self._refill(lane) if chain else 0
            ride = min(want, self.transport.claims_with_commit)
            claimed: list[tuple[Delivery, Step]] = []
            labels: list[str] | None = None
            if ride:
                try:
                    with self.transport.atomic(durable=True):
                        labels = self._commit_all(done)
                        try:
                            dry = self._claim_into(claimed, owner, ride)
                        except Exception as exc:  # whatever it was, the commits must not pay for it
                            raise _ChainFailed from exc
                except _ChainFailed as failed:
                    log.warning("claiming the next turns with a commit failed (%s); committing alone", failed.__cause__)
                    labels, want, claimed = None, 0, []
            if labels is None:
                with self.transport.atomic(durable=True):
                    labels = self._commit_all(done)
                dry = False
            self.metrics.commit_batch.observe(len(labels))
            label = self._settle(labels)
        except Exception as exc:
            if unavailable(exc):
                lane.done[:0] = done  # committed again after the back-off (fenced, if a lease lapsed)
            raise
        lane.claimed.extend(claimed)
        if want > ride and not dry:
            more: list[tuple[Delivery, Step]] = []
            try:
                dry = self._claim_into(more, owner, want - ride)  # short transactions of their own
            except AgentDispatchError as exc:  # keep what was claimed; the loop goes on
                log.warning("claiming the next turns failed: %s", exc)
            lane.claimed.extend(more)
        lane.committed(dry=dry)
        return label

    def _refill(self, lane: Lane) -> int:
        """How many turns to claim with the next commit (0: none)."""
        if self.stopping.is_set() or self.backpressure.claim_delay():
            return 0
        turn_s = self.backpressure.mean_latency()
        if turn_s is not None and lane.pace is not None:
            turn_s = max(turn_s, lane.pace)
        size = batch_size(turn_s, budget_s=self.options.batch_budget_s, cap=self.options.batch_max)
        return max(0, size - len(lane.claimed))

    def _commit_all(self, done: list[Finished]) -> list[str]:
        """The batch's fenced commits (one store call), then its acks (one
        transport call); a fenced turn wrote nothing and is given back."""
        results = self.store.commit_many([(d.lease, d.outcome) for d in done])
        labels: list[str] = []
        acks: list[Delivery] = []
        for d, item in zip(done, results, strict=True):
            if isinstance(item, LeaseLost):
                self.transport.release(d.delivery, 0.0)
                labels.append("fenced")
                continue
            acks.append(d.delivery)
            labels.append(LABELS.get(item.status, "failed"))
        self.transport.ack_many(acks)
        return labels

    def _settle(self, labels: list[str]) -> str:
        for label in labels:
            if label == "fenced":
                self.metrics.lease_failures.inc()
            self._count(label)
        return labels[-1]

    def _claim_into(self, claimed: list[tuple[Delivery, Step]], owner: str, want: int) -> bool:
        """Claim up to ``want`` turns into ``claimed``: the gets (one statement
        where the transport can) and their claims in one transaction (the open
        one, if any). True when the queue ran dry."""
        with self.transport.atomic(durable=False):
            deliveries = self.transport.get_many(owner, want, visibility_s=self.settings.claim_ttl_s)
            steps = self._admit_many(deliveries, owner)
        claimed.extend((d, s) for d, s in zip(deliveries, steps, strict=True) if not isinstance(s, str))
        return len(deliveries) < want

    def _fenced(self, delivery: Delivery) -> str:
        # Left for redelivery: the store decides what the next delivery finds.
        self.transport.release(delivery, 0.0)
        return self._settle(["fenced"])


def _confirmed(guard: LeaseGuard) -> bool:
    """Renew the lease before its handler starts: False when it is lost (or
    the store cannot tell), and the handler must not start."""
    try:
        guard.renew()
    except AgentDispatchError as exc:
        log.info("claimed turn %s not started: %s", guard.job_id, exc)
        return False
    return True


class _ChainFailed(Exception):
    """The claim riding with a commit failed: roll both back, commit alone."""
