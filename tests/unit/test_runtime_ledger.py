"""The runtime's ledger queue writes up to ``writers`` batches at once
(batches of different turns touch different rows), and starts another writer
only once ``spill`` ops wait (fewer, larger batches cost the database less)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentdispatch import Submission, load_settings, open_backends
from agentdispatch.dispatch import Dispatcher
from agentdispatch.runtime.ledger import Ledger
from agentdispatch.stores.base import LedgerOp


class Gate:
    """A real store whose ``ledger_many`` waits until ``parties`` calls are
    inside it at once (a broken barrier: they never were)."""

    def __init__(self, store, parties: int) -> None:
        self.store = store
        self.barrier = threading.Barrier(parties, timeout=20)
        self.overlapped = 0

    def ledger_many(self, ops):
        self.barrier.wait()
        self.overlapped += 1
        return self.store.ledger_many(ops)


def _leases(tmp_path: Path, n: int):
    settings = load_settings(TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_DATA_DIR=str(tmp_path))
    store, transport = open_backends(settings, migrate=True)
    d = Dispatcher(store, transport, settings)
    jobs = [d.submit(Submission(kind="echo", tenant="t")) for _ in range(n)]
    leases = [store.claim(j.job_id, "t", owner="w:1", ttl_s=30).lease for j in jobs]
    return store, transport, leases


def test_two_writers_write_two_batches_at_once(tmp_path: Path) -> None:
    store, transport, leases = _leases(tmp_path, 2)
    gate = Gate(store, 2)
    ledger = Ledger(gate, ThreadPoolExecutor(2), writers=2)  # type: ignore[arg-type]

    async def go():
        first = ledger.submit(LedgerOp(leases[0], "a", ttl_s=30))
        await asyncio.sleep(0)  # the first batch is on its way alone
        second = ledger.submit(LedgerOp(leases[1], "b", ttl_s=30))
        return await asyncio.gather(first, second)

    try:
        assert asyncio.run(go()) == [None, None]  # both marked intended
        assert gate.overlapped == 2 and ledger.batches == 2
    finally:
        transport.close()
        store.close()


def test_one_writer_writes_what_queued_before_it_ran_in_one_batch(tmp_path: Path) -> None:
    store, transport, leases = _leases(tmp_path, 3)
    ledger = Ledger(store, ThreadPoolExecutor(1), writers=1)

    async def go():
        futs = [ledger.submit(LedgerOp(lease, f"k{i}", ttl_s=30)) for i, lease in enumerate(leases)]
        return await asyncio.gather(*futs)

    try:
        assert asyncio.run(go()) == [None, None, None]
        # Queued before the writer ran: one batch, one transaction.
        assert (ledger.batches, ledger.ops) == (1, 3)
    finally:
        transport.close()
        store.close()


class Held:
    """A real store whose first ``ledger_many`` waits for :attr:`release`
    (a batch stuck behind a lock); records each call's size and whether it
    came while the first was held."""

    def __init__(self, store) -> None:
        self.store = store
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[tuple[int, bool]] = []

    def ledger_many(self, ops):
        self.calls.append((len(ops), not self.release.is_set()))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(20)
        return self.store.ledger_many(ops)


def test_another_writer_starts_only_once_spill_ops_wait(tmp_path: Path) -> None:
    store, transport, leases = _leases(tmp_path, 3)
    held = Held(store)
    ledger = Ledger(held, ThreadPoolExecutor(2), writers=2, spill=2)  # type: ignore[arg-type]

    async def go():
        loop = asyncio.get_running_loop()
        first = ledger.submit(LedgerOp(leases[0], "a", ttl_s=30))
        await loop.run_in_executor(None, held.entered.wait)  # the first writer is stuck
        second = ledger.submit(LedgerOp(leases[1], "b", ttl_s=30))  # one waits: no second writer yet
        await asyncio.sleep(0)  # (a writer started now would take it alone)
        third = ledger.submit(LedgerOp(leases[2], "c", ttl_s=30))  # two wait: a second writer takes both
        got = await asyncio.gather(second, third)
        held.release.set()
        return [await first, *got]

    try:
        assert asyncio.run(go()) == [None, None, None]
        assert held.calls == [(1, True), (2, True)]
    finally:
        transport.close()
        store.close()
