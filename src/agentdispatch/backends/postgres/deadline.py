"""A bound on how long a transaction waits for the server's answers.

A server that stops answering on a live link (its process paused, stuck on
I/O, or a lock held by a forgotten session) keeps the TCP connection alive:
keepalives and ``tcp_user_timeout`` never fire, and a submission would wait
for good. One watchdog thread per pool cuts the socket of a transaction still
running past its deadline; the blocked call then fails like a lost
connection, which its caller reports (a COMMIT's outcome stays unknown)."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Seconds the watchdog thread waits with nothing to watch before it ends.
IDLE_EXIT_S = 10.0


@dataclass(order=True)
class Ticket:
    """One watched transaction; ``expired`` once its socket was cut."""

    due: float
    seq: int
    conn: Any = field(compare=False)
    seconds: float = field(compare=False)
    done: bool = field(default=False, compare=False)
    expired: bool = field(default=False, compare=False)


def cut(conn: Any) -> None:
    """Shut the connection's socket down from another thread: the thread
    waiting on it wakes to an error (the descriptor stays its owner's)."""
    with contextlib.suppress(Exception):
        fd = conn.pgconn.socket
        with socket.socket(fileno=socket.dup(fd)) as dup:
            dup.shutdown(socket.SHUT_RDWR)


class Deadlines:
    """Watches transactions; started on the first one that has a deadline."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, on_cut: Callable[[Any], None] = cut) -> None:
        self.clock = clock
        self.on_cut = on_cut
        self._heap: list[Ticket] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, conn: Any, seconds: float | None) -> Iterator[Ticket | None]:
        """Cut ``conn`` if the block is still running after ``seconds``
        (None or 0: no bound)."""
        if not seconds:
            yield None
            return
        ticket = Ticket(self.clock() + seconds, next(self._seq), conn, seconds)
        with self._cond:
            heapq.heappush(self._heap, ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pg-deadlines", daemon=True)
                self._thread.start()
            elif len(self._heap) == 1:
                self._cond.notify()  # the thread may be idle
        try:
            yield ticket
        finally:
            with self._cond:
                # Left in the heap: the watchdog drops finished tickets as it meets them.
                ticket.done = True
            if ticket.expired:
                # Cut as it finished: never hand a dead socket to the next user.
                with contextlib.suppress(Exception):
                    conn.close()

    def expire_due(self) -> int:
        """Cut every unfinished transaction past its deadline; how many."""
        now = self.clock()
        cut_n = 0
        with self._cond:
            while self._heap and (self._heap[0].done or self._heap[0].due <= now):
                t = heapq.heappop(self._heap)
                if not t.done:
                    # Under the lock: a transaction that finishes meanwhile has
                    # not yet given its connection back to the pool.
                    t.expired = True
                    self.on_cut(t.conn)
                    cut_n += 1
        return cut_n

    def _run(self) -> None:
        while True:
            self.expire_due()
            with self._cond:
                if not self._heap:
                    # Idle a while: the thread ends (a process may open many pools).
                    self._cond.wait(IDLE_EXIT_S)
                    if not self._heap:
                        self._thread = None
                        return
                else:
                    # At most a second: finished tickets behind a later one leave meanwhile.
                    self._cond.wait(max(0.0, min(self._heap[0].due - self.clock(), 1.0)))
