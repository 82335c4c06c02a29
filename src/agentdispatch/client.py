"""A Python client for the gateway: :class:`Client` and :class:`AsyncClient`.

Both speak the HTTP API of ``agentdispatch gateway`` (httpx, installed with the
``client`` extra) and raise the library's own exceptions, mapped from the
gateway's stable error codes. Idempotent calls are retried on connection
failures, 429 and 503 (after ``Retry-After``); a submission is idempotent
because the client gives every submission an idempotency key (its own, or a
fresh one kept across the retries of that call)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .envelope import JobHandle
from .errors import (
    AgentDispatchError,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    JobNotFound,
    PayloadTooLarge,
    QueueFull,
    TaskQueueUnavailable,
)
from .schedules import ScheduleExists, ScheduleNotFound
from .waiting import MAX_WAIT_S, is_done

if TYPE_CHECKING:
    import httpx

#: Retry pauses grow from this, doubling, up to :data:`MAX_PAUSE_S`.
FIRST_PAUSE_S = 0.2
MAX_PAUSE_S = 5.0


class GatewayError(AgentDispatchError):
    """An answer of the gateway that maps onto no narrower exception."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class Unauthorized(GatewayError):
    """401 / 403: the token is missing, unknown, revoked or not for this tenant."""


@dataclass(frozen=True)
class _Call:
    """One request, built the same way by both clients."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    #: Whether sending it twice does no more than sending it once.
    idempotent: bool = True
    #: Read timeout of this call (a long-poll waits longer than a plain read).
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        # httpx encodes the body as strict JSON when sending; a body it cannot
        # encode is the caller's mistake, answered like the gateway would.
        if self.body is None:
            return
        try:
            json.dumps(self.body, allow_nan=False)
        except (TypeError, ValueError):
            raise InvalidInput("the request must be JSON (no NaN/Infinity, sets or objects)") from None
        except RecursionError:
            raise InvalidInput("the request nests too deeply to be sent as JSON") from None


def _key() -> str:
    return f"client-{uuid.uuid4().hex}"


def _submission(kind: str, payload: Any, fields: Mapping[str, Any]) -> dict[str, Any]:
    body = {"kind": kind, "payload": payload, **{k: v for k, v in fields.items() if v is not None}}
    if "dependencies" in body:
        body["dependencies"] = list(body["dependencies"])
    if "job_id" not in body and "idempotency_key" not in body:
        body["idempotency_key"] = _key()  # the same on every retry of this call
    return body


def _error(resp: httpx.Response) -> AgentDispatchError:
    """The library exception for an error answer."""
    try:
        body = resp.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    code = str(body.get("error", "http_error"))
    message = str(body.get("message") or body.get("error") or resp.reason_phrase)
    status = resp.status_code
    if status == 404 and body.get("status") == "not_found":
        path = str(resp.request.url.path)
        if path.startswith("/v1/schedules/"):
            return ScheduleNotFound(path.removeprefix("/v1/schedules/").split("/")[0])
        return JobNotFound(path.removeprefix("/v1/jobs/").split("/")[0])
    if code == "idempotency_conflict":
        return IdempotencyConflict(str(body.get("job_id", "")), message=message)
    simple: dict[str, type[AgentDispatchError]] = {
        "payload_too_large": PayloadTooLarge,
        "body_too_large": PayloadTooLarge,
        "invalid_input": InvalidInput,
        "invalid_request": InvalidInput,
        "queue_full": QueueFull,
        "schedule_exists": ScheduleExists,
        "invalid_transition": InvalidTransition,
        "unavailable": TaskQueueUnavailable,
    }
    if code in simple:
        return simple[code](message)
    if status in (401, 403):
        return Unauthorized(status, code, message)
    return GatewayError(status, code, message)


def _retryable(resp: httpx.Response | None, call: _Call) -> bool:
    if not call.idempotent:
        return False
    return resp is None or resp.status_code in (429, 502, 503, 504)


def _pause(resp: httpx.Response | None, attempt: int) -> float:
    backoff = min(MAX_PAUSE_S, FIRST_PAUSE_S * 2**attempt)
    after = resp.headers.get("Retry-After") if resp is not None else None
    if after is not None and after.isdigit():
        return min(MAX_PAUSE_S, float(after))
    return float(backoff)


def _result(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        raise _error(resp)
    return resp.json()


class _Calls:
    """The requests of the API, shared by both clients."""

    @staticmethod
    def submit(kind: str, payload: Any, fields: Mapping[str, Any]) -> _Call:
        return _Call("POST", "/v1/jobs", body=_submission(kind, payload, fields))

    @staticmethod
    def submit_many(jobs: Sequence[Mapping[str, Any]]) -> _Call:
        body = []
        for job in jobs:
            job = dict(job)
            body.append(_submission(str(job.pop("kind", "orchestrator_task")), job.pop("payload", None), job))
        return _Call("POST", "/v1/jobs/batch", body={"jobs": body})

    @staticmethod
    def status(job_id: str, wait_s: float = 0, timeout_s: float | None = None) -> _Call:
        params = {"wait": wait_s} if wait_s > 0 else {}
        return _Call("GET", f"/v1/jobs/{job_id}", params=params, timeout_s=timeout_s)

    @staticmethod
    def cancel(job_id: str, reason: str | None) -> _Call:
        return _Call("POST", f"/v1/jobs/{job_id}/cancel", body={"reason": reason} if reason else None)

    @staticmethod
    def replay(job_id: str) -> _Call:
        # A second replay of the same job is refused (it is no longer dead-lettered).
        return _Call("POST", f"/v1/jobs/{job_id}/replay", idempotent=False)

    @staticmethod
    def jobs(filters: Mapping[str, Any]) -> _Call:
        return _Call("GET", "/v1/jobs", params={k: v for k, v in filters.items() if v is not None})

    @staticmethod
    def schedule_add(name: str, cron: str, kind: str, fields: Mapping[str, Any]) -> _Call:
        body = {"name": name, "cron": cron, "kind": kind, **{k: v for k, v in fields.items() if v is not None}}
        # Not retried: a retry after a lost answer would meet its own schedule (409).
        return _Call("POST", "/v1/schedules", body=body, idempotent=False)

    @staticmethod
    def schedule(name: str, verb: str | None) -> _Call:
        if verb is None:
            return _Call("GET", f"/v1/schedules/{name}")
        if verb == "delete":
            return _Call("DELETE", f"/v1/schedules/{name}", idempotent=False)
        return _Call("POST", f"/v1/schedules/{name}/{verb}")


def _handle(data: Mapping[str, Any]) -> JobHandle:
    return JobHandle.model_validate(dict(data))


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0:
        raise InvalidInput("timeout must be a number of seconds >= 0")
    return float(timeout_s)


class Client:
    """A blocking client of the gateway at ``base_url``, acting with ``token``.

    ``retries`` bounds the retries of one idempotent call; ``transport`` is
    passed to httpx (tests, proxies)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(self, call: _Call) -> Any:
        import httpx

        attempt = 0
        while True:
            resp: httpx.Response | None = None
            try:
                resp = self._http.request(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.body,
                    headers=call.headers,
                    timeout=call.timeout_s or self.timeout_s,
                )
            except httpx.TransportError:
                if attempt >= self.retries or not call.idempotent:
                    raise TaskQueueUnavailable(f"the gateway cannot be reached at {self._http.base_url}") from None
            if resp is not None and not _retryable(resp, call):
                return _result(resp)
            if attempt >= self.retries:
                return _result(resp) if resp is not None else None
            time.sleep(_pause(resp, attempt))
            attempt += 1

    def submit(self, kind: str, payload: Any = None, **fields: Any) -> JobHandle:
        """Submit one turn (fields as in :class:`Submission`: ``session_id``,
        ``priority``, ``deadline_unix``, ``dependencies``, ``job_id``,
        ``idempotency_key``, ``agent_name``, ``delay_s``, ``not_before``)."""
        return _handle(self._call(_Calls.submit(kind, payload, fields)))

    def submit_many(self, jobs: Sequence[Mapping[str, Any]]) -> list[JobHandle]:
        """Submit a batch (each a mapping with ``kind``, ``payload`` and the
        fields of :meth:`submit`) all or nothing."""
        return [_handle(h) for h in self._call(_Calls.submit_many(jobs))["jobs"]]

    def status(self, job_id: str) -> dict[str, Any]:
        """The job's view (raises :class:`JobNotFound`)."""
        return dict(self._call(_Calls.status(job_id)))

    def wait(self, job_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The job's view once it is terminal, or when ``timeout_s`` is over
        (check ``view["status"]``). Long-polls the gateway."""
        deadline = time.monotonic() + _check_timeout(timeout_s)
        while True:
            left = max(0.0, deadline - time.monotonic())
            wait = min(MAX_WAIT_S, left)
            view = dict(self._call(_Calls.status(job_id, wait, timeout_s=wait + self.timeout_s)))
            if is_done(view) or left <= wait:
                return view

    def cancel(self, job_id: str, reason: str | None = None) -> dict[str, Any]:
        """Cancel a job (a terminal one is returned unchanged)."""
        return dict(self._call(_Calls.cancel(job_id, reason)))

    def replay(self, job_id: str) -> dict[str, Any]:
        """Replay a dead-lettered job: ``{"job": view, "side_effects": [...]}``."""
        return dict(self._call(_Calls.replay(job_id)))

    def jobs(self, **filters: Any) -> dict[str, Any]:
        """A page of jobs, newest first: ``{"jobs": [...], "page": {...}}``
        (filters as the query parameters of ``GET /v1/jobs``)."""
        return dict(self._call(_Calls.jobs(filters)))

    def schedules(self) -> list[dict[str, Any]]:
        """The tenant's periodic schedules."""
        return list(self._call(_Call("GET", "/v1/schedules"))["schedules"])

    def schedule_add(self, name: str, cron: str, kind: str, payload: Any = None, **fields: Any) -> dict[str, Any]:
        """Add a schedule firing a job of ``kind`` at each tick of ``cron``
        (fields: ``tz``, ``session_id``, ``priority``, ``agent_name``, ``paused``)."""
        return dict(self._call(_Calls.schedule_add(name, cron, kind, {"payload": payload, **fields})))

    def schedule_get(self, name: str) -> dict[str, Any]:
        """One schedule (raises :class:`ScheduleNotFound`)."""
        return dict(self._call(_Calls.schedule(name, None)))

    def schedule_pause(self, name: str) -> dict[str, Any]:
        """Stop firing until resumed."""
        return dict(self._call(_Calls.schedule(name, "pause")))

    def schedule_resume(self, name: str) -> dict[str, Any]:
        """Fire again from the first tick after now."""
        return dict(self._call(_Calls.schedule(name, "resume")))

    def schedule_delete(self, name: str) -> dict[str, Any]:
        """Delete a schedule (the jobs it fired stay)."""
        return dict(self._call(_Calls.schedule(name, "delete")))


class AsyncClient:
    """:class:`Client` for asyncio (``await client.submit(...)``)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _call(self, call: _Call) -> Any:
        import httpx

        attempt = 0
        while True:
            resp: httpx.Response | None = None
            try:
                resp = await self._http.request(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.body,
                    headers=call.headers,
                    timeout=call.timeout_s or self.timeout_s,
                )
            except httpx.TransportError:
                if attempt >= self.retries or not call.idempotent:
                    raise TaskQueueUnavailable(f"the gateway cannot be reached at {self._http.base_url}") from None
            if resp is not None and not _retryable(resp, call):
                return _result(resp)
            if attempt >= self.retries:
                return _result(resp) if resp is not None else None
            await asyncio.sleep(_pause(resp, attempt))
            attempt += 1

    async def submit(self, kind: str, payload: Any = None, **fields: Any) -> JobHandle:
        """See :meth:`Client.submit`."""
        return _handle(await self._call(_Calls.submit(kind, payload, fields)))

    async def submit_many(self, jobs: Sequence[Mapping[str, Any]]) -> list[JobHandle]:
        """See :meth:`Client.submit_many`."""
        return [_handle(h) for h in (await self._call(_Calls.submit_many(jobs)))["jobs"]]

    async def status(self, job_id: str) -> dict[str, Any]:
        """See :meth:`Client.status`."""
        return dict(await self._call(_Calls.status(job_id)))

    async def wait(self, job_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """See :meth:`Client.wait`."""
        deadline = time.monotonic() + _check_timeout(timeout_s)
        while True:
            left = max(0.0, deadline - time.monotonic())
            wait = min(MAX_WAIT_S, left)
            view = dict(await self._call(_Calls.status(job_id, wait, timeout_s=wait + self.timeout_s)))
            if is_done(view) or left <= wait:
                return view

    async def cancel(self, job_id: str, reason: str | None = None) -> dict[str, Any]:
        """See :meth:`Client.cancel`."""
        return dict(await self._call(_Calls.cancel(job_id, reason)))

    async def replay(self, job_id: str) -> dict[str, Any]:
        """See :meth:`Client.replay`."""
        return dict(await self._call(_Calls.replay(job_id)))

    async def jobs(self, **filters: Any) -> dict[str, Any]:
        """See :meth:`Client.jobs`."""
        return dict(await self._call(_Calls.jobs(filters)))

    async def schedules(self) -> list[dict[str, Any]]:
        """See :meth:`Client.schedules`."""
        return list((await self._call(_Call("GET", "/v1/schedules")))["schedules"])

    async def schedule_add(self, name: str, cron: str, kind: str, payload: Any = None, **fields: Any) -> dict[str, Any]:
        """See :meth:`Client.schedule_add`."""
        return dict(await self._call(_Calls.schedule_add(name, cron, kind, {"payload": payload, **fields})))

    async def schedule_get(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.schedule_get`."""
        return dict(await self._call(_Calls.schedule(name, None)))

    async def schedule_pause(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.schedule_pause`."""
        return dict(await self._call(_Calls.schedule(name, "pause")))

    async def schedule_resume(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.schedule_resume`."""
        return dict(await self._call(_Calls.schedule(name, "resume")))

    async def schedule_delete(self, name: str) -> dict[str, Any]:
        """See :meth:`Client.schedule_delete`."""
        return dict(await self._call(_Calls.schedule(name, "delete")))
