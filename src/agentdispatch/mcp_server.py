"""``agentdispatch mcp``: the MCP tools ``graph_orchestrate`` and ``graph_jobs``,
answering with the same JSON shapes as the HTTP gateway."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import anyio.to_thread
from mcp.server.mcpserver import MCPServer

from .dispatch import Dispatcher, Submission

SUBMIT_ARGS = (
    "kind", "payload", "task", "session_id", "priority", "deadline_unix", "dependencies", "job_id",
    "not_before", "delay_s", "timeout_s",
)  # fmt: skip


async def _answer(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run a store call off the event loop; errors become the HTTP error bodies."""
    from .gateway.errors import error_payload

    try:
        result = await anyio.to_thread.run_sync(fn)
    except Exception as exc:
        return error_payload(exc)[1]
    return result if isinstance(result, dict) else {"result": result}


def build_server(dispatcher: Dispatcher, *, tenant: str) -> MCPServer[Any]:
    """An MCP server whose tools act for ``tenant`` through ``dispatcher``."""
    server: MCPServer[Any] = MCPServer(
        "agentdispatch",
        instructions="Dispatch agent turns to a durable queue and follow them by job id.",
    )

    def status(job_id: str) -> dict[str, Any]:
        return dispatcher.status(job_id, tenant)

    def cancel(job_id: str, reason: str | None) -> dict[str, Any]:
        return dispatcher.cancel(job_id, tenant, reason or "cancelled")

    @server.tool()
    async def graph_orchestrate(
        action: Literal["dispatch", "status", "cancel"],
        kind: str = "orchestrator_task",
        payload: Any = None,
        task: str | None = None,
        session_id: str | None = None,
        priority: int = 0,
        deadline_unix: float | None = None,
        dependencies: list[str] | None = None,
        job_id: str | None = None,
        idempotency_key: str | None = None,
        reason: str | None = None,
        not_before: float | None = None,
        delay_s: float | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Dispatch a turn (returns its job handle), or read / cancel a job by job_id.
        A turn starts no earlier than ``not_before`` (unix time) or ``delay_s``
        seconds from now; an attempt running past ``timeout_s`` seconds is
        cancelled and retried."""
        if action == "dispatch":
            given = dict(locals())
            data = {k: given[k] for k in SUBMIT_ARGS if given[k] is not None}
            if idempotency_key is not None:
                data["idempotency_key"] = idempotency_key
            sub = Submission.from_mapping(data, tenant=tenant)
            return await _answer(lambda: dispatcher.submit(sub).model_dump())
        if not job_id:
            return {"status": "error", "error": "invalid_input", "message": f"job_id is required for {action}"}
        if action == "status":
            return await _answer(lambda: status(job_id))
        return await _answer(lambda: cancel(job_id, reason))

    @server.tool()
    async def graph_jobs(action: Literal["status", "cancel"], job_id: str, reason: str | None = None) -> dict[str, Any]:
        """Read (the WorkItem view, no lease secrets) or cancel one job."""
        if action == "status":
            return await _answer(lambda: status(job_id))
        return await _answer(lambda: cancel(job_id, reason))

    return server
