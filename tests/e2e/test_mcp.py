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
from e2e.gatewayproc import cli_env
from ports import free_port

HANDLE_KEYS = {"job_id", "session_id", "kind", "dispatch", "status", "status_url", "status_request"}


def _result(res: Any, *, error: bool = False) -> dict[str, Any]:
    """The tool's JSON: structured content, mirrored as text for older clients;
    ``error``: the call must be flagged as failed (``isError``)."""
    assert res.is_error is error, res
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
        out["missing"] = _result(
            await session.call_tool("graph_jobs", {"action": "status", "job_id": "nope"}), error=True
        )
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
    assert proc.returncode == 0, (tmp_path / "mcp.log").read_text()  # SIGTERM is a clean stop


BIG = "x" * (2 * 1024 * 1024)


async def _refusals(data_dir: Path) -> dict[str, Any]:
    """Calls an agent gets wrong, each answered as an error (and nothing stored)."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "agentdispatch", "mcp", "--tenant", "acme"], env=cli_env(data_dir)
    )
    out: dict[str, Any] = {}
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        init = await session.initialize()
        out["server"] = (init.server_info.name, init.server_info.version)
        out["schemas"] = {t.name: t.input_schema for t in (await session.list_tools()).tools}
        call = session.call_tool
        out["unknown_job"] = await call("graph_jobs", {"action": "cancel", "job_id": "no-such-job"})
        out["no_job_id"] = await call("graph_orchestrate", {"action": "status"})
        out["bad_priority"] = await call("graph_orchestrate", {"action": "dispatch", "kind": "echo", "priority": 500})
        out["empty_kind"] = await call("graph_orchestrate", {"action": "dispatch", "kind": ""})
        out["bad_session"] = await call("graph_orchestrate", {"action": "dispatch", "session_id": "a b"})
        out["too_long_delay"] = await call("graph_orchestrate", {"action": "dispatch", "delay_s": 10**9})
        out["big"] = await call("graph_orchestrate", {"action": "dispatch", "kind": "echo", "payload": BIG})
        out["both_times"] = await call(
            "graph_orchestrate", {"action": "dispatch", "kind": "echo", "delay_s": 5, "not_before": 2e9}
        )
        out["good"] = await call("graph_orchestrate", {"action": "dispatch", "kind": "echo", "priority": 100})
    return out


def test_mcp_flags_refusals_as_errors_and_stores_nothing(tmp_path: Path) -> None:
    import agentdispatch
    from agentdispatch.gateway.api import GraphRequest

    out = anyio.run(_refusals, tmp_path / "data")
    assert out["server"] == ("agentdispatch", agentdispatch.__version__)

    # The store's refusals carry the HTTP error bodies.
    assert _result(out["unknown_job"], error=True) == {"status": "not_found", "error": "Job no-such-job not found"}
    assert _result(out["no_job_id"], error=True)["error"] == "invalid_input"
    big = _result(out["big"], error=True)
    assert big["error"] == "payload_too_large" and "limit is 1048576" in big["message"]
    assert "not both" in _result(out["both_times"], error=True)["message"]
    # The schema's constraints are checked by the SDK before the tool runs.
    for name, field in (("bad_priority", "priority"), ("empty_kind", "kind"), ("bad_session", "session_id")):
        res = out[name]
        assert res.is_error, (name, res)
        assert field in res.content[0].text, (name, res.content[0].text)
    assert out["too_long_delay"].is_error and "delay_s" in out["too_long_delay"].content[0].text

    # The tool schemas are the HTTP API's: same bounds, same descriptions.
    http = GraphRequest.model_json_schema()["properties"]
    tool = out["schemas"]["graph_orchestrate"]["properties"]
    for name in ("kind", "priority", "session_id", "deadline_unix", "dependencies", "delay_s", "reason", "job_id"):
        assert tool[name]["description"] == http[name]["description"], name
        assert {k: v for k, v in tool[name].items() if k != "title"} == {
            k: v for k, v in http[name].items() if k != "title"
        }, name
    assert (tool["priority"]["minimum"], tool["priority"]["maximum"]) == (-100, 100)
    assert tool["kind"]["pattern"] and tool["kind"]["maxLength"] == 100
    jobs = out["schemas"]["graph_jobs"]
    assert jobs["required"] == ["action", "job_id"] and jobs["properties"]["job_id"]["description"]

    good = _result(out["good"])
    h = sqlite_harness(tmp_path)  # of all those calls only the valid one reached the store
    try:
        assert h.store.counts(None) == {"ready": 1}
        assert h.store.get(good["job_id"], "acme").priority == 100
    finally:
        h.close()
