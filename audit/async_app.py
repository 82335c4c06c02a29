"""Async handlers for the SIGKILL audit: each turn sleeps 0.1-1 s and records one
guarded effect in an O_APPEND sink the verify callback can read back."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import NOT_HAPPENED, LeaseGuard

registry = Registry()


def _sink(kind: str, *fields: object) -> None:
    path = Path(os.environ["CRASH_SINK_DIR"]) / f"{os.getpid()}.log"
    line = " ".join([kind, str(os.getpid()), *map(str, fields), repr(time.time())]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _sent(job_id: str) -> bool:
    for log in Path(os.environ["CRASH_SINK_DIR"]).glob("*.log"):
        for line in log.read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == "effect" and parts[2] == job_id:
                return True
    return False


@registry.register("audit_turn")
async def audit_turn(turn: Turn, guard: LeaseGuard) -> dict[str, object]:
    _sink("start", turn.session_id, turn.job_id, turn.payload["i"])
    try:
        await asyncio.sleep(random.uniform(0.05, 0.5))

        async def effect() -> None:
            _sink("effect", turn.job_id)

        async def verify() -> object:
            return None if _sent(turn.job_id) else NOT_HAPPENED

        await guard.side_effect_async(f"effect:{turn.job_id}", effect, verify=verify)
        await asyncio.sleep(random.uniform(0.05, 0.5))
    finally:
        _sink("end", turn.session_id, turn.job_id, turn.payload["i"])
    return {"pid": os.getpid()}
