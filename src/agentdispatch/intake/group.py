"""Group execution of concurrent calls: threads that call :meth:`Group.call`
while an earlier group is being written join the next one, and one call of
the batch function (one database round trip, one commit) answers them all.

Nothing waits for company: a call that finds no group running starts one at
once, so a lone webhook pays no window; under load the groups grow by
themselves. Each caller gets its own result (or its own exception); an error
of the whole batch (the transaction failed, nothing of it stored) is raised
to every member.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

A = TypeVar("A")
R = TypeVar("R")


class _Batch(Generic[A, R]):
    def __init__(self) -> None:
        self.args: list[A] = []
        self.results: Sequence[R | BaseException] = ()
        self.led = False
        # Its own signal: a group's end wakes its members only, not every
        # thread waiting for any group (up to the gateway's 32 request
        # threads, each taking the GIL in turn to find it was not theirs).
        self.done = threading.Event()


class Group(Generic[A, R]):
    """Leader/follower batching of ``run`` over concurrent callers.

    ``run`` gets the arguments of one group and answers one result or
    exception per argument, in order. At most ``concurrency`` groups run at
    once (a stalled group does not hold up every later webhook); at most
    ``max_size`` arguments go in one group."""

    def __init__(
        self,
        run: Callable[[list[A]], Sequence[R | BaseException]],
        *,
        concurrency: int = 2,
        max_size: int = 64,
    ) -> None:
        self._run = run
        self._concurrency = concurrency
        self._max_size = max_size
        self._cond = threading.Condition()
        self._open: _Batch[A, R] | None = None
        self._running = 0

    def call(self, arg: A) -> R:
        """Run ``arg`` in a group; its own result, or raise its own error."""
        with self._cond:
            batch = self._open
            if batch is None or len(batch.args) >= self._max_size:
                batch = self._open = _Batch()
            index = len(batch.args)
            batch.args.append(arg)
            lead = not batch.led
            batch.led = True
            if lead:
                # Wait for a free slot; members keep joining until it frees.
                while self._running >= self._concurrency:
                    self._cond.wait()
                self._running += 1
                if self._open is batch:
                    self._open = None  # sealed: later callers start the next group
        if lead:
            self._lead(batch)
        else:
            batch.done.wait()
        got = batch.results[index]
        if isinstance(got, BaseException):
            raise got
        return got

    def _lead(self, batch: _Batch[A, R]) -> None:
        results: Sequence[R | BaseException]
        try:
            results = self._run(batch.args)
            if len(results) != len(batch.args):
                raise AssertionError("a group function answered the wrong number of results")
        except BaseException as exc:  # every member sees the group's failure
            results = [exc] * len(batch.args)
        batch.results = results
        with self._cond:
            self._running -= 1
            self._cond.notify_all()  # only leaders waiting for a slot wait here
        batch.done.set()
