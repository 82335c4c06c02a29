"""Handlers for the operations tests: ``ok`` logs a line and sends one side
effect, ``boom`` raises (a retryable failure: dead-lettered at the last attempt)."""

from __future__ import annotations

import logging

from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import LeaseGuard

registry = Registry()
log = logging.getLogger("ops_app")


@registry.register("ok")
def ok(turn: Turn, guard: LeaseGuard) -> dict[str, str]:
    log.info("handling a turn")
    sent = guard.side_effect(f"send:{turn.job_id}", lambda: "sent")
    return {"sent": sent}


@registry.register("boom")
def boom(turn: Turn, guard: LeaseGuard) -> None:
    raise RuntimeError("the model provider is down")
