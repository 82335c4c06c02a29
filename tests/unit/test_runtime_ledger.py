"""The runtime's ledger queue writes up to ``writers`` batches at once (a
PostgreSQL batch costs round trips per op; batches of different turns touch
different rows)."""

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
