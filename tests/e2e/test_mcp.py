"""``agentdispatch mcp`` over stdio with the official SDK client: dispatch a
job, read its status, cancel it; the shapes are those of the HTTP API."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from backends import sqlite_harness
from e2e.gatewayproc import cli_env, free_port

HANDLE_KEYS = {"job_id", "session_id", "kind", "dispatch", "status", "status_url", "status_request"}


def _result(res: Any) -> dict[str, Any]:
    """The tool's JSON: structured content, mirrored as text for older clients."""
    assert not res.is_error, res
    assert res.structured_content is not None
    assert json.loads(res.content[0].text) == res.structured_content
    return dict(res.structured_content)


async def _session(data_dir: Path) -> dict[str, Any]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentdispatch", "mcp", "--tenant", "acme"],
        env=cli_env(data_dir),
    )
    out: dict[str, Any] = {}
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = {t.name for t in (await session.list_tools()).tools}
        out["tools"] = tools
        handle = _result(
            await session.call_tool(
                "graph_orchestrate", {"action": "dispatch", "kind": "echo", "payload": {"n": 1}, "session_id": "mcp-s"}
            )
        )
        out["handle"] = handle
        out["status"] = _result(await session.call_tool("graph_jobs", {"action": "status", "job_id": handle["job_id"]}))
        out["orchestrate_status"] = _result(
            await session.call_tool("graph_orchestrate", {"action": "status", "job_id": handle["job_id"]})
        )
        out["missing"] = _result(await session.call_tool("graph_jobs", {"action": "status", "job_id": "nope"}))
        out["cancel"] = _result(await session.call_tool("graph_jobs", {"action": "cancel", "job_id": handle["job_id"]}))
    return out


def test_mcp_stdio_dispatches_and_reads_status(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    out = anyio.run(_session, data_dir)
    assert {"graph_orchestrate", "graph_jobs"} <= out["tools"]
    handle = out["handle"]
    assert set(handle) == HANDLE_KEYS and handle["dispatch"] == "queued" and handle["status"] == "pending"
    assert handle["status_request"] == {"action": "status", "job_id": handle["job_id"]}
    assert out["status"]["job_id"] == handle["job_id"] and out["status"]["status"] == "ready"
    assert out["status"]["tenant"] == "acme" and out["status"]["session_id"] == "mcp-s"
    assert "lease_token" not in out["status"]
    assert out["orchestrate_status"] == out["status"]
    assert out["missing"] == {"status": "not_found", "error": "Job nope not found"}
    assert out["cancel"]["status"] == "cancelled"

    h = sqlite_harness(tmp_path)  # the job is really in the store, for the MCP tenant
    try:
        item = h.store.get(handle["job_id"], "acme")
        assert item.status.value == "cancelled" and item.payload == {"n": 1}
    finally:
        h.close()


async def _http_session(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        handle = _result(await session.call_tool("graph_orchestrate", {"action": "dispatch", "kind": "echo"}))
        view = _result(await session.call_tool("graph_jobs", {"action": "status", "job_id": handle["job_id"]}))
    return handle, view


def test_mcp_streamable_http_dispatches_and_reads_status(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "mcp.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "mcp", "--transport", "streamable-http", "--port", str(port)],
        env=cli_env(tmp_path / "data"),
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "mcp.log").read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        handle, view = anyio.run(_http_session, f"http://127.0.0.1:{port}/mcp")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    assert set(handle) == HANDLE_KEYS
    assert view["job_id"] == handle["job_id"] and view["status"] == "ready" and view["tenant"] == "default"
