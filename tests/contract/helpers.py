"""Small helpers shared by the contract tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from agentdispatch.envelope import Envelope
from agentdispatch.transports.base import Delivery, Transport


def get_delivery(
    transport: Transport, owner: str = "t:0", timeout: float = 30.0, visibility_s: float = 30.0
) -> Delivery:
    """Wait for one delivery or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = transport.get(owner, visibility_s=visibility_s, wait_s=0.2)
        if d is not None:
            return d
    raise AssertionError("no delivery arrived")


def get_for(transport: Transport, job_id: str, owner: str = "t:0", timeout: float = 30.0) -> Delivery:
    """Wait for the delivery of ``job_id``, acking unrelated ones."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = transport.get(owner, visibility_s=30.0, wait_s=0.2)
        if d is None:
            continue
        if Envelope.from_json(d.raw).job_id == job_id:
            return d
        transport.ack(d)
    raise AssertionError(f"no delivery of {job_id}")


def wait_until(cond: Callable[[], bool], timeout: float = 15.0, every: float = 0.05) -> None:
    """Poll ``cond`` until true or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise AssertionError("condition not met in time")
