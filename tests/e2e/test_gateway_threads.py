"""The gateway's thread pool retires idle threads and starts new ones; the
SQLite connections each new thread opens must not outlive it, or a gateway
that serves bursts runs out of file descriptors and stops accepting
connections. The app runs over a real SQLite store, requests in concurrent
bursts, with the pool retiring every idle thread at its next call."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from anyio._backends._asyncio import WorkerThread

from agentdispatch.gateway import Services, create_app
from agentdispatch.gateway.auth import mint
from backends import descriptors_of, sqlite_harness

BURSTS = 30
WIDTH = 8


def test_retired_pool_threads_leave_no_connection_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h = sqlite_harness(tmp_path)
    try:
        services = Services.of(h.settings, h.store, h.transport)
        _, token = mint(h.store, "acme")
        # Retire idle pool threads at once instead of after ten idle seconds.
        monkeypatch.setattr(WorkerThread, "MAX_IDLE_TIME", 0)
        app = create_app(services)
        codes: list[int] = []

        async def bursts() -> None:
            transport = httpx.ASGITransport(app=app)
            headers = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
                for i in range(BURSTS):
                    # A write and reads per burst: each opens this thread's connections.
                    calls = [c.post("/v1/jobs", json={"kind": "echo", "job_id": f"j{i}"})]
                    calls += [c.get("/v1/jobs") for _ in range(WIDTH - 1)]
                    codes.extend(r.status_code for r in await asyncio.gather(*calls))

        asyncio.run(bursts())
        assert sorted(set(codes)) == [200, 202], codes
        assert h.store.counts(None) == {"ready": BURSTS}
        # Bounded by the threads alive at the last burst (and the late closes
        # SQLite makes), not by every thread the pool ever started.
        assert descriptors_of(h.store.db.path) <= 4 * WIDTH, descriptors_of(h.store.db.path)
    finally:
        h.close()
