"""``agentdispatch mcp``: the MCP tools ``graph_orchestrate`` and ``graph_jobs``,
answering with the same JSON shapes as the HTTP gateway.

Tool arguments carry the HTTP API's constraints and descriptions (one set of
annotated types, :mod:`agentdispatch.gateway.fields`), so the SDK refuses what
the gateway would refuse before any store call. A refusal the store makes (an
unknown job, a payload too large, a full queue) answers with the gateway's
error body and ``isError: true``, so an agent cannot mistake it for a result.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, Literal

import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent
from pydantic import Field

from .dispatch import Dispatcher, Submission
from .gateway import fields as f
from .gateway.errors import error_body, error_payload

#: A tool's answer: the HTTP body as structured content (and as text for older clients).
Answer = Annotated[CallToolResult, dict[str, Any]]

Action = Annotated[
    Literal["dispatch", "status", "cancel"],
    Field(description="dispatch: submit a turn and get its handle; status / cancel: act on job_id."),
]
JobAction = Annotated[Literal["status", "cancel"], Field(description="Read the job, or cancel it.")]
ExistingJob = Annotated[str, Field(pattern=f.IDENT, max_length=200, description="The job_id a dispatch returned.")]


def package_version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    try:
        return version("agentdispatch")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def _reply(body: dict[str, Any], *, error: bool = False) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(body))],
        structured_content=body,
        is_error=error,
    )


async def _answer(fn: Callable[[], dict[str, Any]]) -> CallToolResult:
    """Run a store call off the event loop; errors become the HTTP error bodies."""
    try:
        result = await anyio.to_thread.run_sync(fn)
    except Exception as exc:
        return _reply(error_payload(exc)[1], error=True)
    return _reply(result)


def _missing_job_id(action: str) -> CallToolResult:
    return _reply(error_body("invalid_input", f"job_id is required for action {action!r}"), error=True)


def build_server(dispatcher: Dispatcher, *, tenant: str) -> MCPServer[Any]:
    """An MCP server whose tools act for ``tenant`` through ``dispatcher``."""
    server: MCPServer[Any] = MCPServer(
        "agentdispatch",
        version=package_version(),
        instructions="Dispatch agent turns to a durable queue and follow them by job id. "
        "A failed call answers isError with {status, error, message}.",
    )

    def status(job_id: str) -> dict[str, Any]:
        return dispatcher.status(job_id, tenant)

    def cancel(job_id: str, reason: str | None) -> dict[str, Any]:
        return dispatcher.cancel(job_id, tenant, reason or "cancelled")

    @server.tool()
    async def graph_orchestrate(
        action: Action,
        kind: f.Kind = "orchestrator_task",
        payload: f.Payload = None,
        task: f.Task = None,
        session_id: f.SessionId = None,
        priority: f.Priority = 0,
        deadline_unix: f.Deadline = None,
        dependencies: f.Dependencies = None,
        job_id: f.JobId = None,
        idempotency_key: f.IdempotencyKey = None,
        agent_name: f.AgentName = "",
        reason: f.Reason = None,
        not_before: f.NotBefore = None,
        delay_s: f.DelayS = None,
        timeout_s: f.TimeoutS = None,
    ) -> Answer:
        """Dispatch a turn (answers its job handle), or read / cancel a job by job_id.
        A turn starts no earlier than ``not_before`` (unix time) or ``delay_s``
        seconds from now; an attempt running past ``timeout_s`` seconds is
        cancelled and retried."""
        if action == "dispatch":
            given = {
                "kind": kind, "payload": payload, "task": task, "session_id": session_id, "priority": priority,
                "deadline_unix": deadline_unix, "dependencies": dependencies, "job_id": job_id,
                "idempotency_key": idempotency_key, "agent_name": agent_name, "not_before": not_before,
                "delay_s": delay_s, "timeout_s": timeout_s,
            }  # fmt: skip
            data = {k: v for k, v in given.items() if v is not None}

            def submit() -> dict[str, Any]:
                return dispatcher.submit(Submission.from_mapping(data, tenant=tenant)).model_dump()

            return await _answer(submit)
        if not job_id:
            return _missing_job_id(action)
        if action == "status":
            return await _answer(lambda: status(job_id))
        return await _answer(lambda: cancel(job_id, reason))

    @server.tool()
    async def graph_jobs(action: JobAction, job_id: ExistingJob, reason: f.Reason = None) -> Answer:
        """Read (the WorkItem view, no lease secrets) or cancel one job."""
        if action == "status":
            return await _answer(lambda: status(job_id))
        return await _answer(lambda: cancel(job_id, reason))

    return server
