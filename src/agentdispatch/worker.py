"""claim -> guard -> run handler -> fenced commit -> ack, on N threads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import AgentDispatchError
from .factory import open_flow
from .faults import Backoff, recoverable, unavailable
from .fleet import host_label, new_worker_id, process_label
from .handlers import Registry, outcome_of
from .lanes import Lane, Step
from .lease import LeaseGuard, Renewer
from .metrics import Metrics
from .policy import Backpressure, batch_size
from .reconciler import Reconciler, take_over_at_start
from .settings import Settings
from .stores.base import Store, WorkerRow
from .transports.base import Delivery, Transport
from .transports.flow import Batch, Finished, Separate
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
        #: Claims, commits and releases in batches, each one transaction where
        #: the queue lives in the store's database.
        self.flow = open_flow(store, transport)
        self.registry = registry
        self.options = options or WorkerOptions()
        self.metrics = metrics or Metrics()
        self.worker_id = worker_id or new_worker_id()
        self.stopping = threading.Event()
        self._state = _State()
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._started_at = time.time()
        self._beat_deferred = False
        #: Set at stop, once the row is gone (no beat writes it again).
        self._removed = False
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
        take_over_at_start(self.store, self.transport, self.worker_id)
        self._beat(force=True)
        for i in range(self.options.threads):
            t = threading.Thread(target=self._claim_loop, args=(i,), name=f"claim-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self._reconciler = (
            Reconciler(self.store, self.transport, self.settings.claim_ttl_s, self.settings).start()
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
        # No beat after it: a row written again would count its turns twice
        # in the fleet's counters (a claim thread past the grace still beats).
        with self._beat_lock, contextlib.suppress(Exception):
            self._removed = True
            self.store.remove_worker(self.worker_id, self.metrics.published())
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
        # One beat at a time, its snapshot taken inside: two racing beats
        # would otherwise write their snapshots in either order, and an older
        # one left in the store hides a started session until the next beat.
        with self._beat_lock:
            if self._removed:
                return
            with self._lock:
                sessions = tuple(sorted(set(self._state.active.values())))
            self._write_beat(sessions)

    def _write_beat(self, sessions: tuple[str, ...]) -> None:
        try:
            self.store.heartbeat(
                WorkerRow(
                    worker_id=self.worker_id,
                    host=host_label(),
                    capacity=self.options.threads,
                    active_sessions=sessions,
                    queue_backend=self.transport.name,
                    started_at=self._started_at,
                    process=process_label(),
                    counters=self.metrics.published(),
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

    def _tally(self, batch: Batch) -> None:
        """Count the deliveries a claim settled instead of claiming."""
        if batch.redelivered:
            self.metrics.redeliveries.inc(batch.redelivered)
        for end in batch.ends:
            self._count(end.value)

    def poll(self, owner: str, index: int, loop: asyncio.AbstractEventLoop) -> str | None:
        """One step of a claim thread; returns the outcome label (``pending``
        while a finished turn waits for its batch's commit), or None when idle."""
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
        at = time.monotonic()  # before the claim: no lease of it expires sooner than at + TTL
        batch = self.flow.claim(owner, 1, ttl_s=self.settings.claim_ttl_s, wait_s=self.options.get_wait_s)
        self._tally(batch)
        if not batch.claimed:
            return batch.ends[-1].value if batch.ends else None
        c = batch.claimed[0]
        lane.step(time.monotonic(), chained=False)
        return self._execute(c.delivery, (c.envelope, c.claim, at), owner=owner, index=index, loop=loop)

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

    def process(self, delivery: Delivery, *, owner: str, index: int, loop: asyncio.AbstractEventLoop) -> str:
        """Handle one delivery end to end; returns the outcome label. Its commit
        claims nothing else (no turn is left for a claim loop to run)."""
        at = time.monotonic()
        batch = Separate(self.store, self.transport).admit(owner, [delivery], ttl_s=self.settings.claim_ttl_s)
        self._tally(batch)
        if not batch.claimed:
            return batch.ends[-1].value
        c = batch.claimed[0]
        return self._execute(delivery, (c.envelope, c.claim, at), owner=owner, index=index, loop=loop, chain=False)

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
        """The fenced commits and acknowledgements of the lane's finished turns
        (one durable transaction on a shared database), and this thread's next
        turns: as many as fast turns fit the batch budget, claimed in the same
        transaction where the backend can (one write and one fsync for the
        lot), the rest in a transaction of their own. A claim never costs a
        commit. A commit the store cannot make now is kept and made again by
        the next poll (after the claim loop's back-off). Returns the label of
        the last turn."""
        done, lane.done = lane.done, []
        ttl = self.settings.claim_ttl_s
        try:
            want = self._refill(lane) if chain else 0
            at = time.monotonic()
            ends, rode = self.flow.finish(done, then=want, owner=owner, ttl_s=ttl)
            self.metrics.commit_batch.observe(len(ends))
            label = self._settle([e.value for e in ends])
        except Exception as exc:
            if unavailable(exc):
                lane.done[:0] = done  # committed again after the back-off (fenced, if a lease lapsed)
            raise
        self._tally(rode)
        lane.claimed.extend((c.delivery, (c.envelope, c.claim, at)) for c in rode.claimed)
        dry = rode.dry
        if want > rode.asked and not dry:
            at = time.monotonic()
            try:
                more = self.flow.claim(owner, want - rode.asked, ttl_s=ttl)
            except AgentDispatchError as exc:  # keep what was claimed; the loop goes on
                log.warning("claiming the next turns failed: %s", exc)
            else:
                self._tally(more)
                lane.claimed.extend((c.delivery, (c.envelope, c.claim, at)) for c in more.claimed)
                dry = more.dry
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

    def _settle(self, labels: list[str]) -> str:
        for label in labels:
            if label == "fenced":
                self.metrics.lease_failures.inc()
            self._count(label)
        self._beat()  # the fleet's turn counters (gateway) within a second
        return labels[-1]

    def _fenced(self, delivery: Delivery) -> str:
        # Left for redelivery: the store decides what the next delivery finds.
        self.flow.release([delivery])
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
