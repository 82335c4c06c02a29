"""agentdispatch: run AI-agent turns from a durable queue.

A caller submits a turn and gets a job handle at once; workers claim it under a
renewable, fenced lease, commit the outcome, then acknowledge the delivery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .dispatch import Dispatcher, Submission
    from .envelope import Envelope, JobHandle, new_job_id
    from .errors import (
        AgentDispatchError,
        ConfigError,
        DepthUnavailable,
        EffectInFlight,
        EffectUnknown,
        IdempotencyConflict,
        InvalidEnvelope,
        InvalidInput,
        InvalidTransition,
        JobNotFound,
        LeaseLost,
        NonRetryableError,
        OutcomeConflict,
        Overloaded,
        PayloadTooLarge,
        QueueFull,
        TaskQueueUnavailable,
    )
    from .factory import open_backends
    from .handlers import Registry, Turn
    from .lease import NOT_HAPPENED, Fence, LeaseGuard
    from .runtime import AsyncWorker, RuntimeOptions
    from .settings import Settings, load_settings
    from .worker import Worker, WorkerOptions
    from .workitem import Outcome, Status, WorkItem

__version__ = "0.1.0"

# Where each public name lives. They are imported on first use, so a process
# that needs one corner of the package (``agentdispatch --help``, a CLI command,
# the gateway) does not pay for loading all of it at start-up. The gateway
# client needs httpx (the ``client`` extra), which this keeps optional too.
_HOMES = {
    "Client": "client",
    "AsyncClient": "client",
    "Dispatcher": "dispatch",
    "Submission": "dispatch",
    "Envelope": "envelope",
    "JobHandle": "envelope",
    "new_job_id": "envelope",
    **dict.fromkeys(
        (
            "AgentDispatchError",
            "ConfigError",
            "DepthUnavailable",
            "EffectInFlight",
            "EffectUnknown",
            "IdempotencyConflict",
            "InvalidEnvelope",
            "InvalidInput",
            "InvalidTransition",
            "JobNotFound",
            "LeaseLost",
            "NonRetryableError",
            "OutcomeConflict",
            "Overloaded",
            "PayloadTooLarge",
            "QueueFull",
            "TaskQueueUnavailable",
        ),
        "errors",
    ),
    "open_backends": "factory",
    "Registry": "handlers",
    "Turn": "handlers",
    "NOT_HAPPENED": "lease",
    "Fence": "lease",
    "LeaseGuard": "lease",
    "AsyncWorker": "runtime",
    "RuntimeOptions": "runtime",
    "Settings": "settings",
    "load_settings": "settings",
    "Worker": "worker",
    "WorkerOptions": "worker",
    "Outcome": "workitem",
    "Status": "workitem",
    "WorkItem": "workitem",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'agentdispatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "NOT_HAPPENED",
    "AgentDispatchError",
    "AsyncClient",
    "AsyncWorker",
    "Client",
    "ConfigError",
    "DepthUnavailable",
    "Dispatcher",
    "EffectInFlight",
    "EffectUnknown",
    "Envelope",
    "Fence",
    "IdempotencyConflict",
    "InvalidEnvelope",
    "InvalidInput",
    "InvalidTransition",
    "JobHandle",
    "JobNotFound",
    "LeaseGuard",
    "LeaseLost",
    "NonRetryableError",
    "Outcome",
    "OutcomeConflict",
    "Overloaded",
    "PayloadTooLarge",
    "QueueFull",
    "Registry",
    "RuntimeOptions",
    "Settings",
    "Status",
    "Submission",
    "TaskQueueUnavailable",
    "Turn",
    "WorkItem",
    "Worker",
    "WorkerOptions",
    "__version__",
    "load_settings",
    "new_job_id",
    "open_backends",
]
