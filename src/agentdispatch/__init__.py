"""agentdispatch: run AI-agent turns from a durable queue.

A caller submits a turn and gets a job handle at once; workers claim it under a
renewable, fenced lease, commit the outcome, then acknowledge the delivery.
"""

from typing import TYPE_CHECKING, Any

from .dispatch import Dispatcher, Submission
from .envelope import Envelope, JobHandle, new_job_id
from .errors import (
    AgentDispatchError,
    ConfigError,
    DepthUnavailable,
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

if TYPE_CHECKING:
    from .client import AsyncClient, Client

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The gateway client needs httpx (the ``client`` extra): imported on first use.
    if name in ("Client", "AsyncClient"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'agentdispatch' has no attribute {name!r}")


__all__ = [
    "NOT_HAPPENED",
    "AgentDispatchError",
    "AsyncClient",
    "AsyncWorker",
    "Client",
    "ConfigError",
    "DepthUnavailable",
    "Dispatcher",
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
