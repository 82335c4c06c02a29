"""The async worker: claim, run under guard, finish, with many turns in
flight on one event loop.

Three loops share the process: the claimer refills freed capacity (several
turns a statement), each turn is a task that awaits its handler, and the
finisher commits and acknowledges finished turns in groups. Store calls run on
threads of their own (claims, commits, ledger writes, renewals), so the loop
only waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .. import heap
from ..factory import open_flow
from ..faults import Backoff, recoverable
from ..fleet import host_label, new_worker_id, process_label
from ..handlers import Registry
from ..lease import LeaseGuard
from ..metrics import Metrics
from ..observe import TurnObserver
from ..policy import ConcurrencyLimit
from ..reconciler import Reconciler, release_at_stop, take_over_at_start
from ..settings import Settings
from ..stores.base import Store, WorkerRow
from ..transports.base import Delivery, Transport
from ..transports.flow import Batch, Claimed, Finished, TurnEnd
from ..workitem import Lease
from .ledger import Ledger
from .options import RuntimeOptions
from .renewer import BatchRenewer
from .turn import Running, run_turn

log = logging.getLogger("agentdispatch.runtime")
T = TypeVar("T")

#: Sessions listed in a heartbeat row at most (the fleet view needs a sample).
HEARTBEAT_SESSIONS = 1000
#: How far back each cancellation poll reads (a cancel's event carries the
#: time its transaction read the clock, which may commit a little later).
CANCEL_LOOKBACK_S = 5.0
#: How often the worker looks for leases no renewal could confirm for a TTL.
WATCHDOG_S = 0.25


class AsyncWorker:
    """One worker process running up to ``options.concurrency`` turns at once."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        transport: Transport,
        registry: Registry,
        *,
        options: RuntimeOptions | None = None,
        metrics: Metrics | None = None,
        worker_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.store = store
        self.transport = transport
        self.registry = registry
        self.options = options or RuntimeOptions()
        self.metrics = metrics or Metrics()
        self.worker_id = worker_id or new_worker_id()
        self.clock = clock
        self.limit = ConcurrencyLimit(ceiling=self.options.concurrency)
        self.renewer = BatchRenewer(store, clock=clock)
        # Observation (metrics by kind, traces, log context): see observe.py.
        self.observe = TurnObserver(self.metrics)
        self.renewer.on_late = self.metrics.renew_late.observe
        self.metrics.renew_lateness.set_function(lambda: self.renewer.worst_lateness_s)
        # Read at each scrape: a set per turn started and ended costs a lock each.
        self.metrics.in_flight.set_function(lambda: len(self.running))
        #: Claims, commits and releases in batches, each one transaction where
        #: the queue lives in the store's database.
        self.flow = open_flow(store, transport)
        self.owner = f"{self.worker_id}:0"
        self.running: set[Running] = set()
        #: The running turns by job id (cancellations arrive as job ids).
        self._by_job: dict[str, Running] = {}
        #: The earliest claim (database time) of the turns started since the last cancellation poll.
        self._claimed_since: float | None = None
        #: The error that stopped the worker, if any (the process exits non-zero).
        self.fatal: BaseException | None = None
        self._beat_lock = threading.Lock()
        #: Turns that ended, by how.
        self.ended: dict[TurnEnd, int] = dict.fromkeys(TurnEnd, 0)
        self._done: list[Finished] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._claim_wake: asyncio.Event | None = None
        self._finish_wake: asyncio.Event | None = None
        #: Set when the transport tells of new rows (PostgreSQL's LISTEN) or at
        #: a stop; cleared as each claim starts, so news during a claim counts.
        self._arrived: asyncio.Event | None = None
        #: Rows told of since the last claim started (None: an unknown number).
        self._told: int | None = 0
        #: News not covered by a claim since the last claim started.
        self._news = 0
        #: Claims that followed a wake's news: counted for tests and metrics.
        self.woken_claims = 0
        #: While the claimer waits for news: how many turns it could start (None:
        #: not waiting). News then starts the claim at once from the thread it
        #: came on (the claim future below), rather than after a hop through
        #: the loop: at light load that hop is a good share of the latency.
        self._park_lock = threading.Lock()
        self._parked: int | None = None
        self._prefetch: Future[Batch] | None = None
        self._started_at = time.time()
        self._last_beat = float("-inf")
        self._beat_queued = False
        self._beat_task: asyncio.Future[None] | None = None

    # -- lifecycle ------------------------------------------------------------
    def preflight(self) -> None:
        """Raise :class:`TaskQueueUnavailable` unless store and transport answer."""
        self.store.ping()
        self.transport.ping()
        # A transport that must join something before it can deliver (Kafka's
        # consumer group) starts now, while the caller finishes starting up.
        prepare = getattr(self.transport, "prepare", None)
        if prepare is not None:
            prepare(self.owner)

    def request_stop(self) -> None:
        """Stop claiming; turns in flight get the grace period (thread-safe,
        signal-safe)."""
        self._stopping.set()
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(self._kick, True)

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stopping.is_set()

    def run_forever(self) -> bool:
        """Run until :meth:`request_stop`; True when every turn finished
        within the grace period."""
        return asyncio.run(self.run())

    async def run(self) -> bool:
        """:meth:`run_forever` on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._claim_wake, self._finish_wake, self._arrived = asyncio.Event(), asyncio.Event(), asyncio.Event()
        subscribe = getattr(self.transport, "on_arrival", None)
        unsubscribe = subscribe(self._on_arrival) if subscribe is not None else None
        opts = self.options
        handlers = ThreadPoolExecutor(opts.threads, thread_name_prefix="handler")
        self._io = ThreadPoolExecutor(opts.io_threads, thread_name_prefix="io")
        writers = opts.ledger_writers or (4 if getattr(self.store, "name", "") == "postgres" else 1)
        self.ledger = Ledger(
            self.store,
            ThreadPoolExecutor(writers, thread_name_prefix="ledger"),
            writers=writers,
            spill=opts.ledger_spill,
        )
        # Claims and commits take turns on one thread: run side by side they
        # lock queue, fairness and item rows in opposite orders (PostgreSQL
        # deadlocks); on SQLite they queue for the one writer anyway.
        self._claims = self._commits = ThreadPoolExecutor(1, thread_name_prefix="traffic")
        self.renewer.start()
        settings = self.settings
        reconciler = (
            Reconciler(self.store, self.transport, settings.claim_ttl_s, settings).start() if opts.reconcile else None
        )
        await self._off(self._io, take_over_at_start, self.store, self.transport, self.worker_id)
        await self._off(self._io, self._beat)
        side = [
            asyncio.create_task(self._finisher()),
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._cancels()),
            asyncio.create_task(self._watchdog()),
        ]
        try:
            # Thousands of turns in flight: see heap.py for what this does to the collector.
            with heap.serving():
                await self._claimer(handlers)
                clean = await self._drain()
        finally:
            if unsubscribe is not None:
                unsubscribe()
            self._stopping.set()
            self._kick(True)
            with contextlib.suppress(Exception):
                await asyncio.gather(*side)
            self.renewer.close()
            if reconciler is not None:
                reconciler.stop()
            handlers.shutdown(wait=False, cancel_futures=True)  # a sync handler past the grace is abandoned
            for ex in (self._io, self._claims, self.ledger.executor):
                ex.shutdown(wait=True)
            if self.ended[TurnEnd.RELEASED]:
                # Their leases ran out at once, but their items still read
                # running: with no worker left to claim them, operators (and
                # the depth and in-flight gauges) would see turns nobody runs.
                # The row goes with them: it first gets the final counts.
                with contextlib.suppress(Exception):
                    self._write_beat([])
                with contextlib.suppress(Exception):
                    release_at_stop(self.store, self.transport, self.worker_id)
            with contextlib.suppress(Exception):  # best effort: the row ages out anyway
                # With the final counts: the fleet's then count every turn.
                self.store.remove_worker(self.worker_id, self.metrics.published())
        return clean

    async def _off(self, executor: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    def _kick(self, stop: bool = False) -> None:
        """Something changed (a turn ended, a stop): wake the claimer and the
        finisher; at a stop, a claimer waiting for news as well."""
        for event in (self._claim_wake, self._finish_wake, self._arrived if stop else None):
            if event is not None:
                event.set()
        if self._parked is not None:
            # A turn ended or a stop: what a claim started by news may take now.
            with self._park_lock:
                if self._parked is not None:
                    self._parked = self._free()  # at a stop, _claim_on_news refuses anyway

    def _on_arrival(self, rows: int | None) -> None:
        """The transport told of new rows (its thread): start the claim if the
        claimer waits for news, and wake the claimer on the loop."""
        loop = self._loop
        if loop is not None:
            claiming = self._claim_on_news(rows)
            with contextlib.suppress(RuntimeError):  # the loop already closed
                if claiming:
                    loop.call_soon_threadsafe(self._arrival_claimed, rows)
                else:
                    loop.call_soon_threadsafe(self._arrival, rows)

    def _claim_on_news(self, rows: int | None) -> bool:
        """Start the claim news of ``rows`` turns calls for (any thread), if
        the claimer is waiting for news; True if this call started it."""
        with self._park_lock:
            if not self._parked or self._prefetch is not None or self.stopping:
                return False
            n = self._claim_size(self._parked, rows)
            self._parked = None
            self._prefetch = self._claims.submit(self._claim, n)
            return True

    def _arrival(self, rows: int | None) -> None:
        self._news += 1
        self._told = None if rows is None or self._told is None else self._told + rows
        self._kick_arrived()

    def _arrival_claimed(self, rows: int | None) -> None:
        """News a claim already started for: the wait ends with its count,
        but it is not news the claim may miss."""
        if not self._news:
            self._told = rows
        self._kick_arrived()

    def _kick_arrived(self) -> None:
        assert self._arrived is not None
        self._arrived.set()

    @staticmethod
    async def _nap(event: asyncio.Event | None, seconds: float) -> None:
        """Sleep until ``seconds`` pass or ``event`` is set."""
        assert event is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=seconds)
        event.clear()

    # -- claim ------------------------------------------------------------------
    async def _claimer(self, handlers: Executor) -> None:
        backoff = Backoff()
        #: After a wait that ended with news of ``told`` new turns: claim one
        #: more than that (None: a full batch). Enqueuers notify only while a
        #: claimer is marked waiting, and a woken claimer is not until its next
        #: claim that runs dry: the one more tells whether turns came unannounced
        #: meanwhile (then the claimer claims again rather than wait).
        told: int | None = None
        #: A claim news started while the claimer waited (see _claim_on_news):
        #: taken even at a stop, so that its turns start and get the grace.
        started: Future[Batch] | None = None
        while started is not None or not self.stopping:
            if started is None:
                now = self.clock()
                self.limit.tick(now, len(self.running))
                self.metrics.concurrency_limit.set(self.limit.limit)
                delay = self.limit.claim_delay(now)
                free = self.limit.limit - len(self.running)
                if delay > 0 or free <= 0:
                    # Full: until a turn ends, or the slow start's next doubling.
                    ramp = self.limit.ramp_in(now)
                    await self._nap(self._claim_wake, delay if delay > 0 else 1.0 if ramp is None else min(1.0, ramp))
                    continue
                n = self._claim_size(free, told)
            if told is not None or started is not None:
                self.woken_claims += 1
            told = None
            if self._arrived is not None and (started is None or not self._news):
                # News from here on may be of rows this claim misses: keep it.
                self._arrived.clear()
                self._told = 0
                self._news = 0
            try:
                if started is not None:
                    claim, started = started, None
                    batch = await asyncio.wrap_future(claim)
                else:
                    batch = await self._off(self._claims, self._claim, n)
            except Exception as exc:
                if not await self._claim_failed(exc, backoff):
                    return
                continue
            if backoff.failures:
                log.info("claiming resumed after %d failed attempt(s)", backoff.reset())
            for c in batch.claimed:
                self._start(c, handlers)
            if batch.claimed:
                self._beat_soon()
                # The turns' tasks take their first step (a sync handler's
                # hand-off to its thread) before the next claim goes out.
                await asyncio.sleep(0)
            if batch.dry and not self.stopping:
                # Not on the traffic thread: finished turns commit meanwhile.
                with self._park_lock:
                    self._parked = self._free()
                try:
                    told = await self._await_work(2 * len(self.running) < self.limit.limit)
                except Exception as exc:  # the wait reads the store too
                    if not await self._claim_failed(exc, backoff):
                        return
                finally:
                    with self._park_lock:
                        self._parked = None
                        started, self._prefetch = self._prefetch, None

    def _claim_size(self, free: int, told: int | None) -> int:
        """How many turns to ask for: after news of ``told`` turns, those and
        one more (see _claimer); without a count, a full batch."""
        return min(free, self.options.claim_batch if told is None else max(1, told) + 1)

    def _free(self) -> int:
        """Turns a claim may start now (on the loop)."""
        if self.limit.claim_delay(self.clock()) > 0:
            return 0
        return self.limit.limit - len(self.running)

    async def _await_work(self, idle: bool) -> int | None:
        """Wait until the next claim is worth trying, after one that found the
        queue dry; how many new turns the wake told of (None: unknown, or the
        wait timed out). A transport that tells of new rows from a thread of
        its own (PostgreSQL's LISTEN) wakes the loop directly; otherwise an io
        thread waits (see :meth:`_wait_for_work`)."""
        arrived = self._arrived
        poll = getattr(self.transport, "arrival_poll_s", None)
        if arrived is None or poll is None:
            return await self._off(self._io, self._wait_for_work, idle)
        if not arrived.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), timeout=min(self.options.get_wait_s, poll()))
        return self._told if arrived.is_set() and self._told else None

    async def _claim_failed(self, exc: Exception, backoff: Backoff) -> bool:
        """Back off after a store error of the claim loop; False when it is one
        no retry mends (the worker stops and exits non-zero)."""
        if not recoverable(exc):
            self._fail(exc)
            return False
        self.metrics.worker_errors.labels(error=type(exc).__name__).inc()
        log.warning("claiming failed, retrying: %s", exc)
        await self._nap(self._claim_wake, backoff.failed())
        return True

    def _wait_for_work(self, idle: bool) -> int | None:
        """Until the next claim is worth trying, after one that found the queue
        dry (on an io thread); how many new turns the wake told of (None:
        unknown). An idle worker (fewer than half its slots busy) on a store
        that tells a new submission cheaply claims it within milliseconds; a
        busy one waits for the transport's poll, which batches the claims of
        a stream of arrivals into a few statements instead of one each."""
        wait_s = self.options.get_wait_s
        waker = getattr(self.store, "wait_for_submission", None)
        if idle and waker is not None:
            # At most the transport's own poll: a retry coming due is no new item.
            came = waker(min(wait_s, getattr(self.transport, "poll_s", wait_s)))
            told = came if isinstance(came, int) and came > 0 else None
            if told is not None:
                self._claim_on_news(told)
            return told
        self.transport.wait(wait_s)
        return None

    def _claim(self, n: int) -> Batch:
        """Up to ``n`` turns; the deliveries settled instead are counted."""
        batch = self.flow.claim(self.owner, n, ttl_s=self.settings.claim_ttl_s)
        if batch.redelivered:
            self.metrics.redeliveries.inc(batch.redelivered)
        for end in batch.ends:
            self._count(end)
        return batch

    def _start(self, c: Claimed, handlers: Executor) -> None:
        item, lease = c.claim.item, c.claim.lease
        assert item is not None and lease is not None
        guard = LeaseGuard(
            self.store, lease, ttl_s=self.settings.claim_ttl_s, renew_interval_s=self.settings.renew_interval_s
        )
        guard.io = self._io
        self.observe.claimed(c.envelope, item, guard)
        guard.ledger = self.ledger.submit
        r = Running(c.delivery, c.envelope, item, guard, started_at=self.clock())
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:
            # A refused renewal (cancelled, lease lost, deadline) cancels the task.
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing runs any more
                loop.call_soon_threadsafe(self._cancel, r, TurnEnd.FENCED)

        guard.on_lost = lost
        self.metrics.time_in_queue.observe(max(0.0, time.time() - c.envelope.enqueued_at))
        self.metrics.attempts.observe(item.attempt)
        self.running.add(r)
        self._by_job[item.id] = r
        # Database time of the claim: a cancellation can come any time after it.
        claimed = lease.expires_at - self.settings.claim_ttl_s
        self._claimed_since = claimed if self._claimed_since is None else min(self._claimed_since, claimed)
        self.renewer.add(guard)
        r.task = asyncio.create_task(self._turn(r, handlers), name=f"turn-{item.id}")

    def _cancel(self, r: Running, why: TurnEnd) -> None:
        # Only while the handler runs: a cancel must never hit the turn's commit.
        if r.in_handler and r.stop is None and r.task is not None:
            r.stop = why
            r.task.cancel()

    # -- run --------------------------------------------------------------------
    def _timeout_of(self, r: Running) -> float | None:
        # The submission's own timeout is the more specific: it wins.
        return r.item.timeout_s if r.item.timeout_s is not None else self.registry.timeout_of(r.item.kind)

    async def _turn(self, r: Running, handlers: Executor) -> None:
        r.in_handler = True
        try:
            with self.observe.handler(r.item, r.guard.lease.epoch) as run:
                run.outcome = outcome = await run_turn(self.registry, r, handlers, self._timeout_of(r))
        finally:
            r.in_handler = False
            self.renewer.remove(r.guard)
            self.running.discard(r)
            if self._by_job.get(r.item.id) is r:
                del self._by_job[r.item.id]
        now = self.clock()
        if r.overload is not None:
            # In flight when refused: this turn left the running set just above.
            in_flight = len(self.running) + 1
            self.limit.overloaded(now, r.overload.retry_after_s, started_at=r.started_at, in_flight=in_flight)
        elif outcome is not None and outcome.ok:
            self.limit.succeeded(now, in_flight=len(self.running) + 1)
        if outcome is None or r.stop is not None:
            # Nothing to commit: give the delivery back (and, at shutdown, the lease).
            why = r.stop or TurnEnd.FENCED
            leases = [r.guard.lease] if why is TurnEnd.RELEASED else []
            await self._off(self._io, self._give_back, [r.delivery], leases)
            self._count(why)
            self.observe.ended(r.item.id, why.value)
            if why is TurnEnd.FENCED:
                self.metrics.lease_failures.inc()
        else:
            self._done.append(Finished(r.delivery, r.guard.lease, outcome))
        self._kick()

    # -- finish -----------------------------------------------------------------
    async def _finisher(self) -> None:
        """Commit finished turns in groups: whatever finished while the last
        group was being written goes in the next one."""
        backoff = Backoff()
        while True:
            if not self._done:
                if self.stopping and not self.running:
                    return
                await self._nap(self._finish_wake, 0.5)
                continue
            batch, self._done = self._done[: self.options.commit_batch], self._done[self.options.commit_batch :]
            try:
                with self.observe.commit([d.lease.job_id for d in batch]):
                    ends = await self._off(self._commits, self._finish, batch)
            except Exception as exc:
                self._done[:0] = batch  # committed again after the back-off (fenced, if a lease lapsed)
                if not recoverable(exc):
                    self._fail(exc)
                    return
                self.metrics.worker_errors.labels(error=type(exc).__name__).inc()
                log.warning("committing %d turn(s) failed, retrying: %s", len(batch), exc)
                await asyncio.sleep(backoff.failed())
                continue
            backoff.reset()
            for d, end in zip(batch, ends, strict=True):
                self._count(end)
                self.observe.ended(d.lease.job_id, end.value)
                if end is TurnEnd.FENCED:
                    self.metrics.lease_failures.inc()
            self._beat_soon()  # the fleet's turn counters (gateway) within a second

    def _finish(self, done: list[Finished]) -> list[TurnEnd]:
        ends, _ = self.flow.finish(done)
        self.metrics.commit_batch.observe(len(done))
        return ends

    def _give_back(self, deliveries: list[Delivery], leases: list[Lease]) -> None:
        """Turns that commit nothing: their deliveries visible again now and
        (``leases``, given up at shutdown) their leases expired at once."""
        try:
            self.flow.release(deliveries, leases)
        except Exception as exc:  # the visibility and the leases run out anyway
            log.warning("giving back %d turn(s) failed: %s", len(deliveries), exc)

    # -- stop -------------------------------------------------------------------
    async def _drain(self) -> bool:
        """Wait up to the grace period for turns in flight, then cancel the
        rest and release their leases at once. True when none was left."""
        tasks = [r.task for r in self.running if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.options.grace_s)
        left = list(self.running)
        for r in left:
            r.guard.revoke("the worker is stopping")  # no side effect starts from here on
            self._cancel(r, TurnEnd.RELEASED)
        rest = [r.task for r in left if r.task is not None]
        if rest:
            await asyncio.wait(rest)
        return not left

    def _fail(self, exc: BaseException) -> None:
        """An error no retry mends: stop; the process exits non-zero."""
        log.critical("unrecoverable error, the worker stops", exc_info=exc)
        if self.fatal is None:
            self.fatal = exc
        self.request_stop()

    def _count(self, end: TurnEnd) -> None:
        self.ended[end] += 1
        self.metrics.turns.labels(outcome=end.value).inc()

    # -- cancellations -------------------------------------------------------------
    async def _cancels(self) -> None:
        """Stop running turns that were cancelled (CLI, API, dashboard, an
        expired deadline) within about a poll interval: one indexed read a
        poll for the whole process, however many turns are in flight."""
        every = self.options.cancel_poll_s
        since: float | None = None
        while not self.stopping:
            await self._nap_stop(every)
            if self.stopping or not self._by_job:
                since = None  # nothing to stop: the next turn's claim sets the start
                continue
            # From the last poll's clock, or from the claim of a turn started
            # since, whichever is earlier: a poll's read can wait (for a
            # connection, for the CPU) longer than the lookback, and a
            # cancellation made meanwhile must not fall before its window.
            fresh, self._claimed_since = self._claimed_since, None
            since = fresh if since is None else since if fresh is None else min(since, fresh)
            try:
                if since is None:
                    since = (await self._off(self._io, self.store.cancelled_since, float("inf")))[0]
                now, ids = await self._off(self._io, self.store.cancelled_since, since - CANCEL_LOOKBACK_S)
            except Exception as exc:
                if not recoverable(exc):
                    self._fail(exc)
                    return
                log.warning("polling for cancelled turns failed: %s", exc)
                continue
            since = now
            for job_id in ids:
                r = self._by_job.get(job_id)
                if r is not None:
                    r.guard.revoke(f"job {job_id} was cancelled")

    async def _watchdog(self) -> None:
        """Stop the turns whose lease may have run out while the store did not
        answer: their renewals hang rather than fail, so nothing else would
        stop them before the store came back, long after another worker may
        have taken the turn over. No store call here: it would hang as well.
        It watches the grace period of a stop too."""
        while not self.stopping or self.running:
            await asyncio.sleep(WATCHDOG_S)
            stale = self.renewer.unconfirmed()
            for g in stale:
                g.revoke(f"job {g.job_id}: lease epoch {g.lease.epoch} not renewed within {g.ttl_s:g} s")
            if stale:
                log.warning(
                    "%d lease(s) not renewed within %g s (the process was paused, or the store is silent), "
                    "their turns stop and commit nothing",
                    len(stale),
                    stale[0].ttl_s,
                )

    # -- heartbeat ----------------------------------------------------------------
    def _beat_soon(self) -> None:
        """New sessions or ended turns: a heartbeat now, or one second after
        the last one (deferred, never dropped), so the fleet view and the
        fleet's turn counters show them within 1 s."""
        if self._beat_queued or self._loop is None:
            return
        self._beat_queued = True
        delay = max(0.0, self._last_beat + 1.0 - self.clock())
        self._loop.call_later(delay, self._fire_beat)

    def _fire_beat(self) -> None:
        self._beat_task = asyncio.ensure_future(self._queued_beat())  # held: the loop keeps tasks weakly

    async def _queued_beat(self) -> None:
        self._beat_queued = False
        if not self.stopping:
            with contextlib.suppress(Exception):  # the periodic beat reports failures
                await self._off(self._io, self._beat)

    def _beat(self) -> None:
        # One beat at a time on the io threads, its snapshot taken inside: an
        # older snapshot written last would hide a started session.
        with self._beat_lock:
            self._last_beat = self.clock()
            sessions = sorted({r.item.session_id for r in list(self.running)})[:HEARTBEAT_SESSIONS]
            self._write_beat(sessions)

    def _write_beat(self, sessions: list[str]) -> None:
        try:
            self.store.heartbeat(
                WorkerRow(
                    worker_id=self.worker_id,
                    host=host_label(),
                    capacity=self.options.concurrency,
                    active_sessions=tuple(sessions),
                    queue_backend=self.transport.name,
                    started_at=self._started_at,
                    process=process_label(),
                    counters=self.metrics.published(),
                )
            )
        except Exception as exc:
            if not recoverable(exc):
                raise
            log.warning("heartbeat failed: %s", exc)

    async def _heartbeats(self) -> None:
        while not self.stopping:
            await self._nap_stop(self.options.heartbeat_s)
            if not self.stopping:
                try:
                    await self._off(self._io, self._beat)
                except Exception as exc:
                    self._fail(exc)
                    return

    async def _nap_stop(self, seconds: float) -> None:
        end = self.clock() + seconds
        while not self.stopping and (left := end - self.clock()) > 0:
            await asyncio.sleep(min(left, 0.5))
