"""Handlers of the PostgreSQL chaos audit (scripts/chaos/chaos_pg.py): async
turns that await a mock model for 0.2-2 s and send one or two effects through
the guard, each logged to a per-process O_APPEND sink with its lease fence."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import Fence, LeaseGuard

registry = Registry()


def _sink(*fields: object) -> None:
    path = Path(os.environ["CHAOS_SINK_DIR"]) / f"{os.getpid()}.log"
    line = " ".join(map(str, fields)) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@registry.register("chaos_turn")
async def chaos_turn(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    pid, fence = os.getpid(), guard.fence
    i = turn.payload["i"]
    _sink("start", pid, turn.session_id, turn.job_id, i, fence.epoch, repr(time.time()))
    outcome = "raised"
    try:
        for n in range(int(turn.payload["effects"])):
            await asyncio.sleep(random.uniform(0.1, 1.0))
            key = f"fx:{turn.job_id}:{n}"

            async def send(fence: Fence, key: str = key) -> str:
                t0 = time.time()
                _sink("fnstart", pid, key, fence.job_id, fence.epoch, repr(t0))
                await asyncio.sleep(random.uniform(0.0, 0.05))
                _sink("effect", pid, key, fence.job_id, fence.epoch, fence.token, repr(t0), repr(time.time()))
                return key

            _sink("begin", pid, key, turn.job_id, fence.epoch, repr(time.time()))
            await guard.side_effect_async(key, send)
        await asyncio.sleep(random.uniform(0.0, 0.3))
        outcome = "ok"
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        _sink("end", pid, turn.session_id, turn.job_id, i, fence.epoch, repr(time.time()), outcome)
    return {"pid": pid, "epoch": fence.epoch}
