"""One thread renews every due lease of a worker with one store call
(``Store.renew_many``), and cancels the turn of every lease it refuses."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import LeaseLost
from ..lease import LeaseGuard
from ..stores.base import Store

log = logging.getLogger("agentdispatch.runtime")


class BatchRenewer:
    """Renews the guards it holds in batches, on a thread of its own so that
    a busy event loop never makes a renewal late.

    When the earliest guard is due, every guard due within half a renew period
    is renewed too (early renewal is harmless and shares the round): about two
    rounds a period however many turns are in flight, each a statement per
    :attr:`CHUNK` leases, earliest due first, so that the first leases' commit
    does not wait for thousands of others.

    A batch starts ahead of its due time by twice the slowest of the recent
    batches (at most a quarter of a period): renewing thousands of leases on
    a busy store takes seconds, and the commit, not the start, should land by
    the due time.
    """

    #: The lead before any batch was timed (seconds).
    FIRST_LEAD_S = 1.0
    #: Leases renewed per statement at most.
    CHUNK = 1000

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.clock = clock
        self._due: dict[LeaseGuard, float] = {}
        #: When the last renewal each guard's store answered was sent (its
        #: claim, at first): the lease runs out no earlier than a TTL later.
        self._confirmed: dict[LeaseGuard, float] = {}
        self._cv = threading.Condition()
        self._closed = False
        #: When the thread wakes next on its own: an added guard due later
        #: (every one, when all share a period) need not wake it, which would
        #: cost a scan of every guard per turn started.
        self._wakes_at = 0.0
        #: The worst delay of a renewal's commit past its due time (seconds).
        self.worst_lateness_s = 0.0
        #: renew_many calls made.
        self.calls = 0
        #: Called with each batch's lateness (the worker's histogram).
        self.on_late: Callable[[float], None] | None = None
        #: How long the recent batches took (their store call).
        self._took: deque[float] = deque(maxlen=8)
        self._thread = threading.Thread(target=self._run, name="renewer", daemon=True)

    def start(self) -> BatchRenewer:
        """Start the thread."""
        self._thread.start()
        return self

    def add(self, guard: LeaseGuard) -> None:
        """Renew ``guard`` every ``guard.every`` seconds from now."""
        with self._cv:
            now = self.clock()
            due = self._due[guard] = now + guard.every
            self._confirmed[guard] = now
            if due < self._wakes_at:
                self._cv.notify()

    def remove(self, guard: LeaseGuard) -> None:
        """Stop renewing ``guard``."""
        with self._cv:
            self._due.pop(guard, None)
            self._confirmed.pop(guard, None)

    def unconfirmed(self) -> list[LeaseGuard]:
        """The guards not yet lost whose lease may have run out unseen: no
        renewal sent within the last TTL was answered. While the store does
        not answer at all (a stalled link, a locked file) no renewal is
        refused either, so only the worker's own clock can tell."""
        with self._cv:
            now = self.clock()
            return [g for g, at in self._confirmed.items() if now - at >= g.ttl_s and not g.lost]

    def close(self) -> None:
        """Stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _take_due(self) -> list[tuple[float, LeaseGuard]] | None:
        """Wait for the earliest due guard; the guards to renew now, each with
        the time it was due, earliest first. None when closed."""
        with self._cv:
            while not self._closed:
                now = self.clock()
                head = min(self._due.items(), key=lambda kv: kv[1], default=None)
                first = None if head is None else head[1]
                lead = 0.0 if head is None else self.lead(head[0].every)
                if first is not None and first - lead <= now:
                    due = [(at, g) for g, at in self._due.items() if at <= now + lead + g.every / 2]
                    due.sort(key=lambda x: x[0])
                    for _, g in due:
                        self._due[g] = now + g.every
                    return due
                wait = 1.0 if first is None else first - lead - now
                self._wakes_at = now + wait
                self._cv.wait(timeout=wait)
        return None

    def lead(self, every: float) -> float:
        """How far ahead of its due time a batch starts."""
        slowest = max(self._took, default=self.FIRST_LEAD_S / 2)
        return min(every / 4, 2 * slowest)

    def _run(self) -> None:
        while (due := self._take_due()) is not None:
            self.renew_round(due)

    def renew_round(self, due: list[tuple[float, LeaseGuard]]) -> None:
        """Renew ``due`` (from :meth:`_take_due`) a chunk a statement."""
        for i in range(0, len(due), self.CHUNK):
            chunk = due[i : i + self.CHUNK]
            self.renew_due([g for _, g in chunk], chunk[0][0])

    def renew_due(self, batch: list[LeaseGuard], due_at: float) -> None:
        """Renew ``batch``, whose earliest guard was due at ``due_at``; time
        the call and note how late its commit was (0: on time or early)."""
        started = self.clock()
        self.renew(batch)
        done = self.clock()
        self._took.append(done - started)
        late = max(0.0, done - due_at)
        self.worst_lateness_s = max(self.worst_lateness_s, late)
        if self.on_late is not None:
            self.on_late(late)

    def renew(self, guards: list[LeaseGuard]) -> None:
        """Renew ``guards`` now in one store call; revoke the refused ones.
        A store error is retried within a second (the leases outlive it for
        most of a TTL)."""
        live = [g for g in guards if not g.lost]
        if not live:
            return
        self.calls += 1
        sent = self.clock()
        try:
            results = self.store.renew_many([g.lease for g in live], live[0].ttl_s)
        except Exception as exc:  # whatever it was, the renewer must not die
            log.warning("renewing %d lease(s) failed, retrying: %s", len(live), exc)
            retry_at = self.clock() + 1.0
            with self._cv:
                for g in live:
                    if g in self._due:
                        self._due[g] = min(self._due[g], retry_at)
            return
        renewed: list[LeaseGuard] = []
        refused: list[LeaseLost] = []
        for g, got in zip(live, results, strict=True):
            if isinstance(got, LeaseLost):
                with self._cv:
                    # A turn that ended meanwhile (its commit may be why the
                    # renewal was refused) or that the watchdog stopped (and
                    # said so) lost nothing worth a line.
                    if g in self._due and not g.lost:
                        refused.append(got)
                self.remove(g)
                g.revoke(str(got))
            else:
                g.lease = got
                renewed.append(g)
        if refused:
            # One line a round: a paused process wakes to many refusals at once,
            # and without it the log would not say why its turns vanished.
            log.warning(
                "renewal refused for %d lease(s), their turns stop and commit nothing: %s", len(refused), refused[0]
            )
        with self._cv:
            for g in renewed:
                if g in self._confirmed:
                    self._confirmed[g] = sent
