"""The knobs of one async worker process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RuntimeOptions:
    """How many turns run at once and how the worker paces its store traffic."""

    #: Turns in flight at most (the ceiling of the adaptive limit).
    concurrency: int = 16
    #: Threads running synchronous handlers (an ``async def`` handler needs none).
    threads: int = 16
    #: Threads making the ledger writes of ``side_effect_async`` (off the loop).
    io_threads: int = 32
    grace_s: float = 30.0
    heartbeat_s: float = 30.0
    get_wait_s: float = 0.5
    reconcile: bool = True
    #: Turns claimed per statement at most (freed capacity is refilled in
    #: claims of up to this many).
    claim_batch: int = 256
    #: How often the worker looks for cancelled turns it runs (one read per poll).
    cancel_poll_s: float = 1.0
    #: Finished turns committed and acknowledged per transaction at most.
    commit_batch: int = 256
    #: Ledger batches written at once at most (0: four on PostgreSQL, where
    #: batches of different turns lock different rows; one elsewhere, where
    #: one writer holds the file).
    ledger_writers: int = 0
    #: Ops queued, with every ledger writer busy, before another writer starts
    #: (fewer, larger batches: each costs a transaction and a durable commit).
    ledger_spill: int = 32
