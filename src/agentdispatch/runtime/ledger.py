"""The side-effect ledger writes of every turn in flight, in groups: whatever
queued while one durable transaction was written goes in the next
(``Store.ledger_many``), so thousands of turns share a handful of commits and
one thread hop per group instead of one each."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from ..stores.base import LedgerAnswer, LedgerOp, Store


class Ledger:
    """Queues :class:`LedgerOp` from the loop and writes them in batches on
    ``executor``, up to ``writers`` batches at a time: one on SQLite (one
    writer per file anyway), several on PostgreSQL, where batches of different
    turns lock different rows (one stuck behind a lock holds up only its own).
    Another writer starts only once ``spill`` ops wait while every writer is
    busy: each batch costs a transaction and its commit, so a few large
    batches cost the database less than many small ones."""

    def __init__(
        self, store: Store, executor: Executor, *, max_batch: int = 1024, writers: int = 1, spill: int = 1
    ) -> None:
        self.store = store
        self.executor = executor
        self.max_batch = max_batch
        self.writers = writers
        self.spill = spill
        self._pending: list[tuple[LedgerOp, asyncio.Future[LedgerAnswer]]] = []
        self._active = 0
        #: Batches written, and ops in them (statements per turn in the benchmark).
        self.batches = 0
        self.ops = 0
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps tasks weakly

    def submit(self, op: LedgerOp) -> asyncio.Future[LedgerAnswer]:
        """Queue ``op``; the future gets its answer once its batch committed
        (or the batch's exception)."""
        fut: asyncio.Future[LedgerAnswer] = asyncio.get_running_loop().create_future()
        self._pending.append((op, fut))
        if self._active == 0 or (self._active < self.writers and len(self._pending) >= self.spill):
            self._active += 1
            self._tasks.add(task := asyncio.get_running_loop().create_task(self._write()))
            task.add_done_callback(self._tasks.discard)
        return fut

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                ops = [op for op, _ in batch]
                try:
                    answers = await loop.run_in_executor(self.executor, self.store.ledger_many, ops)
                except Exception as exc:  # the whole batch failed: each caller gets the error
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                self.batches += 1
                self.ops += len(ops)
                for (_, fut), answer in zip(batch, answers, strict=True):
                    if not fut.done():
                        fut.set_result(answer)
        finally:
            self._active -= 1
