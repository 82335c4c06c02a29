"""Handlers for the poison test: one kind kills its own worker process on
every attempt; the other awaits a short model call."""

from __future__ import annotations

import asyncio
import os
import signal

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import LeaseGuard

registry = Registry()


@registry.register("poison")
async def poison(turn: Turn, guard: LeaseGuard) -> None:
    """Let the batch-mates start, then take the whole process down."""
    await asyncio.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


@registry.register("work")
async def work(turn: Turn, guard: LeaseGuard) -> str:
    """An innocent turn that is in flight when the poison strikes."""
    await asyncio.sleep(float(turn.payload["seconds"]))
    return "done"
