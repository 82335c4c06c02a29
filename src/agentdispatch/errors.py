"""The exception tree of agentdispatch.

::

    AgentDispatchError
     +-- ConfigError              a setting is invalid (names the variable)
     +-- TaskQueueUnavailable     a store or transport cannot be reached
     |    +-- DepthUnavailable    the depth probe failed: admission rejects
     +-- QueueFull                admission refused: the depth bound is reached
     +-- InvalidInput             bad caller input (payload, kind, ids...)
     |    +-- InvalidEnvelope     an envelope failed validation (poison)
     |    +-- PayloadTooLarge     payload over 1 MiB
     |    +-- IdempotencyConflict a known job id or key with a different body
     +-- JobNotFound              unknown job id, or another tenant's job
     +-- InvalidTransition        the state machine refused a move
     |    +-- OutcomeConflict     a terminal item was committed differently
     +-- LeaseLost                fenced: stale epoch/token, expiry or cancel
     +-- EffectUnknown            a side effect may have run; a human decides
     +-- NonRetryableError        raised by a handler: fail without retrying
     |    +-- Retired             raised by a handler: end cancelled with a reason
     +-- Overloaded               raised by a handler: the model gateway is overloaded
"""

from __future__ import annotations


class AgentDispatchError(Exception):
    """Base class of every error agentdispatch raises on purpose."""


class ConfigError(AgentDispatchError):
    """A setting is invalid; the message names the environment variable."""


class TaskQueueUnavailable(AgentDispatchError):
    """A store or transport cannot be reached; never degrades silently."""

    #: The message says what to look at: a caller adds no guess of its own.
    explained = False


def explained(exc: TaskQueueUnavailable) -> TaskQueueUnavailable:
    """``exc``, marked as saying what to look at."""
    exc.explained = True
    return exc


class DepthUnavailable(TaskQueueUnavailable):
    """The queue depth could not be read; admission rejects (never reads 0)."""


class QueueFull(AgentDispatchError):
    """Admission refused: accepting would exceed AGENT_DISPATCH_MAX_DEPTH."""


class InvalidInput(AgentDispatchError):
    """Caller input is invalid; nothing was changed."""


class InvalidEnvelope(InvalidInput):
    """An envelope failed validation (a poison message)."""


class PayloadTooLarge(InvalidInput):
    """The payload is larger than the 1 MiB limit."""


class IdempotencyConflict(InvalidInput):
    """A submission reused the job id (or idempotency key) of an existing job
    with a different body; nothing was written (HTTP 409 ``idempotency_conflict``)."""

    def __init__(self, job_id: str, fields: tuple[str, ...] = (), *, message: str | None = None) -> None:
        super().__init__(
            message
            or f"job {job_id} already exists with a different {', '.join(fields) or 'body'}; "
            "use a new idempotency key (or job id) for a different submission"
        )
        self.job_id = job_id
        self.fields = fields


class JobNotFound(AgentDispatchError):
    """No such job for this tenant (another tenant's job looks the same)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"Job {job_id} not found")
        self.job_id = job_id


class InvalidTransition(AgentDispatchError):
    """The state machine does not allow this move from the current status."""


class OutcomeConflict(InvalidTransition):
    """A terminal item was committed again with a different outcome."""


class LeaseLost(AgentDispatchError):
    """The lease is stale (epoch, token, expiry or cancellation): fenced out."""


class EffectUnknown(AgentDispatchError):
    """A side effect was started by an earlier attempt and never confirmed."""


class EffectInFlight(AgentDispatchError):
    """Another job's live attempt is running the side effect with this key
    (keys are tenant-wide): the turn fails retryably and its next attempt
    finds the effect settled."""


class NonRetryableError(AgentDispatchError):
    """Raised by a handler to fail the item at once, without retries;
    ``reason`` (default ``non_retryable``) is the item's visible reason."""

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class Retired(NonRetryableError):
    """Raised by a handler to end the item as ``cancelled`` with ``reason``:
    a policy decided not to run it (like an expired deadline), not a failure."""


class Overloaded(AgentDispatchError):
    """Raised by a handler when a downstream (a model gateway) is overloaded:
    the turn is retried later and the worker lowers its concurrency limit."""

    def __init__(self, retry_after_s: float = 1.0, message: str = "") -> None:
        super().__init__(message or f"overloaded: retry after {retry_after_s:g} s")
        self.retry_after_s = max(0.0, float(retry_after_s))
