"""The agent handler of ``bench_agents.py``, and the same handler as a Celery
task and a Procrastinate task (``agents_celery.py``, ``agents_procrastinate.py``).

A turn streams one model call from the mock server (``BENCH_MODEL_URL``), then
makes two side effects through its guard: it records the transcript, and sends
the reply (a POST to the mock, which counts each turn's reply once)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx

from agentdispatch.handlers import Registry, Turn

registry = Registry()
# A log line per HTTP request would cost the runner under test CPU per turn.
logging.getLogger("httpx").setLevel(logging.WARNING)
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=None)
_TIMEOUT = httpx.Timeout(600.0, connect=30.0)
# One TLS context for every client: a client per thread's loop must not cost
# each thread its own copy of the CA bundle (about 1 MB).
_SSL = httpx.create_ssl_context()
_async_clients: dict[tuple[int, int], httpx.AsyncClient] = {}
_local = threading.local()


def _model_url() -> str:
    return os.environ["BENCH_MODEL_URL"]


#: Clients per event loop. httpcore's pool scans every connection it holds
#: (and asks each idle one's socket whether it is readable) for each request
#: and each release, so a pool's cost per call grows with the turns it
#: serves: many small pools keep it flat.
_SHARDS = 1024


def _aclient(key: str = "") -> httpx.AsyncClient:
    """One of ``_SHARDS`` clients of this event loop, by ``key`` (the thread
    worker runs a loop per thread)."""
    loop = asyncio.get_running_loop()
    shard = (id(loop), hash(key) % _SHARDS)
    client = _async_clients.get(shard)
    if client is None:
        client = _async_clients[shard] = httpx.AsyncClient(
            base_url=_model_url(), limits=_LIMITS, timeout=_TIMEOUT, verify=_SSL
        )
    return client


#: The handler's HTTP client: ``aiohttp`` (C parser; the default) or ``httpx``
#: (pure Python, as the OpenAI SDK uses). Per turn httpx costs several times
#: the CPU, which on a small machine caps every runner below its ideal.
CLIENT = os.environ.get("BENCH_CLIENT", "aiohttp")
_sessions: dict[int, aiohttp.ClientSession] = {}


def _session() -> aiohttp.ClientSession:
    """This event loop's aiohttp session (one unbounded connection pool)."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(id(loop))
    if session is None:
        session = _sessions[id(loop)] = aiohttp.ClientSession(
            base_url=_model_url(),
            connector=aiohttp.TCPConnector(limit=0, ssl=False),
            timeout=aiohttp.ClientTimeout(total=600, connect=30),
        )
    return session


def _client() -> httpx.Client:
    client: httpx.Client | None = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(base_url=_model_url(), timeout=_TIMEOUT, verify=_SSL)
    return client


class ModelOverloaded(RuntimeError):
    """The model answered 429 (used where agentdispatch has no ``Overloaded``)."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"model overloaded; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


def _overloaded(retry_after_s: float) -> Exception:
    import agentdispatch

    cls = getattr(agentdispatch, "Overloaded", None)
    if cls is not None:
        try:
            exc: Exception = cls(retry_after_s)
            exc.retry_after_s = retry_after_s  # type: ignore[attr-defined]
            return exc
        except TypeError:
            pass
    return ModelOverloaded(retry_after_s)


async def _effect(guard: Any, key: str, fn: Callable[[], Any], afn: Callable[[], Awaitable[Any]]) -> Any:
    """A side effect through whichever guard API the runtime offers."""
    side_effect_async = getattr(guard, "side_effect_async", None)
    if side_effect_async is not None:
        return await side_effect_async(key, afn)
    result = guard.side_effect(key, fn)
    return await result if inspect.isawaitable(result) else result


@registry.register("agent")
async def agent_turn(turn: Turn, guard: Any) -> dict[str, Any]:
    """One agent turn: a streamed model call, then two side effects."""
    p = turn.payload
    body = {
        "job": turn.job_id,
        "submitted_at": p["submitted_at"],
        "started_at": time.time(),
        "attempt_start": True,
        "messages": [{"role": "user", "content": f"turn {p['i']}"}],
    }
    tokens: list[str] = []
    if CLIENT == "aiohttp":
        async with _session().post("/v1/chat", json=body) as ar:
            if ar.status == 429:
                raise _overloaded(float(ar.headers.get("retry-after", "1")))
            ar.raise_for_status()
            async for data in ar.content.iter_any():
                tokens.append(data.decode())
    else:
        async with _aclient(turn.job_id).stream("POST", "/v1/chat", json=body) as r:
            if r.status_code == 429:
                raise _overloaded(float(r.headers.get("retry-after", "1")))
            r.raise_for_status()
            async for chunk in r.aiter_text():
                tokens.append(chunk)
    answer = "".join(tokens)
    reply = {"job": turn.job_id, "text": answer[:200]}

    def record() -> int:
        return len(answer)

    async def arecord() -> int:
        return len(answer)

    def send() -> Any:
        return _client().post("/v1/reply", json=reply).json()["id"]

    async def asend() -> Any:
        if CLIENT == "aiohttp":
            async with _session().post("/v1/reply", json=reply) as ar:
                return (await ar.json())["id"]
        return (await _aclient(turn.job_id).post("/v1/reply", json=reply)).json()["id"]

    await _effect(guard, f"transcript:{turn.job_id}", record, arecord)
    sent = await _effect(guard, f"reply:{turn.job_id}", send, asend)
    return {"tokens": len(answer.split()), "sent": sent}


class PlainGuard:
    """What Celery and Procrastinate offer in place of a lease guard: the
    effect simply runs (no lease, no fence, no at-most-once ledger)."""

    def side_effect(self, key: str, fn: Callable[[], Any]) -> Any:
        return fn()

    async def side_effect_async(self, key: str, afn: Callable[[], Awaitable[Any]]) -> Any:
        return await afn()


def turn_of(job_id: str, payload: dict[str, Any]) -> Turn:
    return Turn(job_id=job_id, session_id=job_id, tenant="bench", kind="agent", payload=payload, attempt=1)


async def run_plain(job_id: str, payload: dict[str, Any]) -> None:
    """The handler outside agentdispatch: a 429 is waited out and retried here."""
    while True:
        try:
            await agent_turn(turn_of(job_id, payload), PlainGuard())
            return
        except Exception as exc:
            retry_after = getattr(exc, "retry_after_s", None)
            if retry_after is None:
                raise
            await asyncio.sleep(float(retry_after))
