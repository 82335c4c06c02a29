"""``agents_app.agent_turn`` with no queue at all: the floor of one process.

Turns arrive as JSON lines on stdin (``[job_id, payload]``) and run as asyncio
tasks, at most ``--in-flight`` at once (no lease, ledger, or durable write):
what this machine allows the handler and the mock before any runner's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from agents_app import run_plain


async def main(in_flight: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    slots = asyncio.Semaphore(in_flight)
    tasks: set[asyncio.Task[None]] = set()

    async def one(job_id: str, payload: dict[str, Any]) -> None:
        try:
            await run_plain(job_id, payload)
        finally:
            slots.release()

    # The backlog is read as it comes, not as slots free up: a writer blocked
    # on a full pipe would stretch the submission (and the bench's steady
    # window starts once the submission ended), as no queue's submit would.
    backlog: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()

    async def feed() -> None:
        while line := await reader.readline():
            job_id, payload = json.loads(line)
            backlog.put_nowait((job_id, payload))
        backlog.put_nowait(None)

    feeder = asyncio.create_task(feed())
    while (turn := await backlog.get()) is not None:
        job_id, payload = turn
        await slots.acquire()
        task = asyncio.create_task(one(job_id, payload))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await feeder
    if tasks:
        await asyncio.wait(tasks)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--in-flight", type=int, required=True)
    asyncio.run(main(parser.parse_args().in_flight))
