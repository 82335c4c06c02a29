"""``agents_app.agent_turn`` as a Celery task (threads pool: a loop per thread)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from agents_app import run_plain
from celery import Celery

app = Celery("bench_agents", broker=os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/15"))
app.conf.update(
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
_local = threading.local()


def _loop() -> asyncio.AbstractEventLoop:
    loop: asyncio.AbstractEventLoop | None = getattr(_local, "loop", None)
    if loop is None:
        loop = _local.loop = asyncio.new_event_loop()
    return loop


@app.task(name="agent")
def agent(job_id: str, payload: dict[str, Any]) -> None:
    _loop().run_until_complete(run_plain(job_id, payload))
