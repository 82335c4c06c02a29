"""``agents_app.agent_turn`` as a Procrastinate task (its async worker)."""

from __future__ import annotations

import os
from typing import Any

import procrastinate
from agents_app import run_plain

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(
        conninfo=os.environ.get("BENCH_PROCRASTINATE_DSN", ""), min_size=2, max_size=20
    )
)


@app.task(name="agent")
async def agent(job_id: str, payload: dict[str, Any]) -> None:
    await run_plain(job_id, payload)
