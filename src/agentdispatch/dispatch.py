"""submit / status / cancel / replay / jobs: the one entry point that the
gateway, the CLI and the MCP server share."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from . import tracing
from .envelope import MAX_PAYLOAD_BYTES, JobHandle, new_job_id
from .errors import InvalidInput, JobNotFound, PayloadTooLarge, TaskQueueUnavailable
from .settings import Settings
from .stores.base import Accepted, JobFilter, NewJob, Store
from .transports.base import Sender
from .waiting import wait_view
from .workitem import Status, WorkItem

log = logging.getLogger("agentdispatch.dispatch")

_IDENT = re.compile(r"^[A-Za-z0-9_.:@/+=-]{1,200}$")
_KIND = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
SUBMIT_FIELDS = frozenset(
    {
        "kind", "payload", "tenant", "session_id", "priority", "deadline_unix",
        "dependencies", "job_id", "idempotency_key", "agent_name", "not_before", "delay_s",
        "timeout_s",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Submission:
    """A caller's request to run one turn (validated by :func:`validate`)."""

    kind: str
    payload: Any = None
    tenant: str = "default"
    session_id: str | None = None
    priority: int = 0
    deadline_unix: float | None = None
    dependencies: tuple[str, ...] = ()
    job_id: str | None = None
    idempotency_key: str | None = None
    agent_name: str = ""
    #: Start no earlier than this unix time (absolute)...
    not_before: float | None = None
    #: ...or this many seconds after acceptance (not both).
    delay_s: float | None = None
    #: Cancel an attempt running longer than this many seconds; it fails
    #: retryably with reason ``timeout`` (overrides the kind's ``timeout_s``).
    timeout_s: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, tenant: str | None = None) -> Submission:
        """Build from JSON-like input; unknown fields are an error."""
        if not isinstance(data, Mapping):
            raise InvalidInput("a submission must be a JSON object")
        unknown = set(data) - SUBMIT_FIELDS - {"action", "task"}
        if unknown:
            raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
        fields = {k: v for k, v in data.items() if k in SUBMIT_FIELDS}
        if "task" in data and "payload" not in data:
            fields["payload"] = {"task": data["task"]}
        deps = fields.get("dependencies") or ()
        if isinstance(deps, str):
            try:
                deps = json.loads(deps) if deps.strip() else []
            except ValueError:
                raise InvalidInput("dependencies must be a list of job ids") from None
        if not isinstance(deps, (list, tuple)):
            raise InvalidInput("dependencies must be a list of job ids")
        fields["dependencies"] = tuple(deps)
        if tenant is not None:
            fields["tenant"] = tenant
        fields.setdefault("kind", "orchestrator_task")
        return cls(**fields)


def _ident(name: str, value: Any) -> str:
    if not isinstance(value, str) or not _IDENT.match(value):
        raise InvalidInput(f"{name} must be 1-200 characters of letters, digits and _.:@/+=-")
    return value


#: The payload check's encoder (``json.dumps`` with options builds one per call).
_PAYLOAD_JSON = json.JSONEncoder(allow_nan=False)


def validate(sub: Submission, *, max_attempts: int, known_kinds: frozenset[str] | None) -> NewJob:
    """Turn a :class:`Submission` into a :class:`NewJob` or raise
    :class:`InvalidInput` / :class:`PayloadTooLarge`."""
    if not isinstance(sub.kind, str) or not _KIND.match(sub.kind):
        raise InvalidInput("kind must be 1-100 characters of letters, digits and _.:-")
    if known_kinds is not None and sub.kind not in known_kinds:
        raise InvalidInput(f"unknown kind {sub.kind!r}; known: {', '.join(sorted(known_kinds))}")
    tenant = _ident("tenant", sub.tenant)
    try:
        body = _PAYLOAD_JSON.encode(sub.payload)
    except (TypeError, ValueError):
        raise InvalidInput("payload must be JSON-serialisable (no NaN/Infinity)") from None
    except RecursionError:
        raise InvalidInput("payload nests too deeply to be stored as JSON") from None
    if len(body) > MAX_PAYLOAD_BYTES:  # ASCII (non-ASCII is escaped): characters are bytes
        raise PayloadTooLarge(f"payload is {len(body)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    if isinstance(sub.priority, bool) or not isinstance(sub.priority, int) or not -100 <= sub.priority <= 100:
        raise InvalidInput("priority must be an integer between -100 and 100 (higher runs first)")
    deadline = sub.deadline_unix
    if deadline is not None:
        if (
            isinstance(deadline, bool)
            or not isinstance(deadline, (int, float))
            or not math.isfinite(deadline)
            or deadline <= 0
        ):
            raise InvalidInput("deadline_unix must be a positive number of seconds since the epoch")
        deadline = float(deadline)
    not_before, delay_s = _timing(sub.not_before, sub.delay_s)
    if isinstance(sub.dependencies, (str, bytes)) or not isinstance(sub.dependencies, Iterable):
        # A bare id would be read as a sequence of one-character ids.
        raise InvalidInput("dependencies must be a list of job ids")
    deps = tuple(_ident("dependency", d) for d in sub.dependencies)
    if len(deps) > 100:
        raise InvalidInput("at most 100 dependencies")
    if sub.job_id is not None:
        job_id = _ident("job_id", sub.job_id)
    elif sub.idempotency_key is not None:
        key = _ident("idempotency_key", sub.idempotency_key)
        job_id = "dispatch-" + hashlib.sha256(f"{tenant}\x1f{key}".encode()).hexdigest()[:32]
    else:
        job_id = new_job_id()
    if job_id in deps:
        raise InvalidInput("a job cannot depend on itself")
    session = _ident("session_id", sub.session_id) if sub.session_id else job_id
    if not isinstance(sub.agent_name, str) or len(sub.agent_name) > 200 or "\x00" in sub.agent_name:
        raise InvalidInput("agent_name must be a string of at most 200 characters (no NUL)")
    timeout_s = _timeout(sub.timeout_s)
    return NewJob(
        job_id=job_id,
        tenant=tenant,
        session_id=session,
        kind=sub.kind,
        payload=sub.payload,
        max_attempts=max_attempts,
        agent_name=sub.agent_name,
        priority=sub.priority,
        dependencies=deps,
        deadline_unix=deadline,
        not_before=not_before,
        delay_s=delay_s,
        timeout_s=timeout_s,
    )


#: The longest execution timeout a submission may ask for (a week).
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT_S
    ):
        raise InvalidInput(f"timeout_s must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}")
    return float(value)


def _known(job_id: str) -> str:
    """``job_id`` to look up. No job id holds a NUL (submissions are checked),
    and PostgreSQL cannot even compare one: such an id is unknown, not an
    outage."""
    if "\x00" in job_id:
        raise JobNotFound(job_id)
    return job_id


def _check_filters(f: JobFilter) -> None:
    for name in ("kind", "session_id", "agent_name", "id_contains"):
        value = getattr(f, name)
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 200 or "\x00" in value):
            raise InvalidInput(f"the {name} filter must be 1-200 characters (no NUL)")
    for name in ("created_from", "created_to"):
        value = getattr(f, name)
        if value is not None and not _number(value):
            raise InvalidInput(f"the {name} filter must be a unix time")


#: The longest delay a submission may ask for.
MAX_DELAY_S = 366 * 86400.0


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _timing(not_before: Any, delay_s: Any) -> tuple[float | None, float]:
    """Validated ``(not_before, delay_s)`` of a submission."""
    if not_before is not None and delay_s is not None:
        raise InvalidInput("give not_before or delay_s, not both")
    if not_before is not None:
        if not _number(not_before) or not 0 < not_before < 2**42:
            raise InvalidInput("not_before must be a positive number of seconds since the epoch")
        return float(not_before), 0.0
    if delay_s is not None:
        if not _number(delay_s) or not 0 <= delay_s <= MAX_DELAY_S:
            raise InvalidInput(f"delay_s must be a number of seconds between 0 and {MAX_DELAY_S:g}")
        return None, float(delay_s)
    return None, 0.0


class Write(Protocol):
    """Where :meth:`Dispatcher.submit_many` writes the validated jobs:
    :meth:`Store.submit`, or a caller's transaction that records more with them."""

    def __call__(self, jobs: Sequence[NewJob], /, *, max_depth: int) -> list[Accepted]:
        """Insert the jobs durably, admitting against ``max_depth`` active items."""


class Dispatcher:
    """Submit and inspect jobs over one store and one transport."""

    def __init__(
        self,
        store: Store,
        transport: Sender,
        settings: Settings,
        *,
        known_kinds: Iterable[str] | None = None,
    ) -> None:
        self.store = store
        self.transport = transport
        self.settings = settings
        self.known_kinds = frozenset(known_kinds) if known_kinds is not None else None

    def submit(self, sub: Submission) -> JobHandle:
        """Accept one turn; returns its handle once it is durable."""
        return self.submit_many([sub])[0]

    def submit_many(self, subs: Sequence[Submission], *, write: Write | None = None) -> list[JobHandle]:
        """Accept a batch in one transaction (all or nothing). ``write``: the
        store write, when the caller records more in its transaction (durable
        intake: the receipt); it commits before it returns, and may accept
        none of the jobs (a duplicate delivery). Such a write admits on its
        own, without the transport's bound: intake bounds each agent's backlog
        and must record a delivery while the store answers, even with a broker
        down (the reconciler publishes it later)."""
        jobs = [validate(s, max_attempts=self.settings.max_attempts, known_kinds=self.known_kinds) for s in subs]
        if not jobs:
            return []
        with tracing.span("submit", turns=len(jobs), kind=jobs[0].kind if len(jobs) == 1 else None) as s:
            if write is None:
                self.transport.admit(len(jobs), self.settings.max_depth)
            accepted = (write or self.store.submit)(jobs, max_depth=self.settings.max_depth)
            if s is not None and len(accepted) == 1:
                s.set_attribute("agentdispatch.job_id", accepted[0].item.id)
            self._publish()
        return [JobHandle.for_job(a.item.id, a.item.session_id, a.item.kind) for a in accepted]

    def _publish(self) -> None:
        # The rows are durable (accepted); a transport that cannot publish now
        # (a Kafka broker gone) leaves them in the outbox for the reconciler,
        # and the caller gets its handles instead of an error it might retry.
        try:
            self.transport.relay(self.store)
        except TaskQueueUnavailable as exc:
            log.warning("turns stored; publishing deferred to the reconciler: %s", exc)

    def status(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        """The WorkItem view (no lease secrets); raises :class:`JobNotFound`."""
        return self.store.get(_known(job_id), tenant).view()

    def wait(self, job_id: str, tenant: str | None, timeout_s: float) -> dict[str, Any]:
        """The job's view once it is terminal, or after ``timeout_s`` seconds
        (at most 60) with whatever status it has then."""
        return wait_view(lambda: self.status(job_id, tenant), timeout_s)

    def cancel(self, job_id: str, tenant: str | None, reason: str = "cancelled") -> dict[str, Any]:
        """Cancel a non-terminal job; terminal jobs are returned unchanged."""
        if not isinstance(reason, str) or "\x00" in reason:
            raise InvalidInput("reason must be a string without NUL")
        return self.store.cancel(_known(job_id), tenant, reason).view()

    def replay(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        """Replay a dead-lettered job as a new attempt."""
        item = self.store.replay(_known(job_id), tenant)
        self._publish()
        return item.view()

    def jobs(
        self,
        tenant: str | None,
        status: Status | None = None,
        *,
        limit: int = 50,
        offset: int = 0,
        filters: JobFilter | None = None,
    ) -> list[WorkItem]:
        """Jobs newest first, filtered in the store (so across every page)."""
        if filters:
            _check_filters(filters)
        return self.store.list_jobs(tenant=tenant, status=status, limit=limit, offset=offset, filters=filters)

    def history(self, job_id: str, tenant: str | None) -> dict[str, Any]:
        """A job's events and side-effect ledger."""
        return self.store.history(_known(job_id), tenant)
