"""An async agent handler for the runtime's process tests: it awaits a long
model call (unless RUNTIME_APP_FAST is set) and then sends one effect."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import LeaseGuard

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


@registry.register("block")
def block(turn: Turn, guard: LeaseGuard) -> str:
    """A sync handler stuck in a call that never looks at its guard."""
    _log(f"start {turn.job_id}")
    time.sleep(3600)
    return "woke"
