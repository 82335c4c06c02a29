"""An async agent handler for the runtime's process tests: it awaits a long
model call (unless RUNTIME_APP_FAST is set) and then sends one effect."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import Fence, LeaseGuard

registry = Registry()


def _log(line: str) -> None:
    path = Path(os.environ["RUNTIME_SINK_DIR"]) / f"{os.getpid()}.log"
    with path.open("a") as f:
        f.write(line + "\n")


@registry.register("think")
async def think(turn: Turn, guard: LeaseGuard) -> dict[str, int]:
    """Start, await the model, send one recorded effect."""
    _log(f"start {turn.job_id}")
    if not os.environ.get("RUNTIME_APP_FAST"):
        await asyncio.sleep(3600)

    async def send() -> str:
        _log(f"effect {turn.job_id}")
        return turn.job_id

    await guard.side_effect_async(f"send:{turn.job_id}", send)
    return {"pid": os.getpid()}


@registry.register("hold")
async def hold(turn: Turn, guard: LeaseGuard) -> dict[str, int]:
    """Await the model for ``hold_s`` seconds, then one effect that logs the
    fence it ran under; ``end`` is logged however the turn stops."""
    epoch = guard.fence.epoch
    _log(f"start {turn.job_id} {epoch}")
    try:
        await asyncio.sleep(float(turn.payload.get("hold_s", 0)))

        async def send(fence: Fence) -> int:
            _log(f"effect {turn.job_id} {fence.epoch}")
            return fence.epoch

        await guard.side_effect_async(f"send:{turn.job_id}", send)
    finally:
        _log(f"end {turn.job_id} {epoch}")
    return {"pid": os.getpid()}


@registry.register("block")
def block(turn: Turn, guard: LeaseGuard) -> str:
    """A sync handler stuck in a call that never looks at its guard."""
    _log(f"start {turn.job_id}")
    time.sleep(3600)
    return "woke"


@registry.register("stamp")
async def stamp(turn: Turn, guard: LeaseGuard) -> dict[str, int]:
    """Log when the turn started (wall clock: the database's, on one host)."""
    _log(f"start {turn.job_id} {time.time():.6f}")
    return {"pid": os.getpid()}


@registry.register("gate")
async def gate(turn: Turn, guard: LeaseGuard) -> dict[str, int]:
    """Start, wait until the file ``payload["go"]`` exists, then one effect;
    lines carry the wall clock (the database's, on one host), the effect's
    also the lease expiry the worker last had confirmed."""
    epoch = guard.fence.epoch
    _log(f"start {turn.job_id} {epoch} {time.time():.6f}")
    go = Path(turn.payload["go"])
    try:
        while not go.exists():
            await asyncio.sleep(0.01)

        async def send(fence: Fence) -> int:
            _log(f"effect {turn.job_id} {fence.epoch} {time.time():.6f} {guard.lease.expires_at:.6f}")
            return fence.epoch

        await guard.side_effect_async(f"send:{turn.job_id}", send)
    except asyncio.CancelledError:
        _log(f"stopped {turn.job_id} {epoch} {time.time():.6f}")
        raise
    return {"pid": os.getpid()}
