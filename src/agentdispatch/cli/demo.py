"""``agentdispatch demo``: an in-process async worker runs a few hundred agent
turns that await a built-in mock model (hundreds of ms to seconds each), many
in flight at once, with live in-flight and turns/s figures, then a summary by
status."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from ..handlers import Turn
    from ..lease import LeaseGuard
    from .app import App


async def mock_model(turn: Turn) -> str:
    """A model call: a latency of a few hundred ms to a few seconds (log-normal
    around 0.8 s, seeded by the turn), then a reply."""
    rng = random.Random(turn.job_id)
    await asyncio.sleep(min(4.0, rng.lognormvariate(-0.2, 0.6)))
    return f"reply to turn {turn.payload.get('n') if isinstance(turn.payload, dict) else ''}"


async def _agent(turn: Turn, guard: LeaseGuard) -> Any:
    """Awaits the mock model, then sends its reply once (a recorded effect)."""
    reply = await mock_model(turn)

    async def send() -> dict[str, Any]:
        return {"sent": reply}

    return await guard.side_effect_async(f"reply:{turn.job_id}", send)


async def _flaky(turn: Turn, guard: LeaseGuard) -> Any:
    """Fails its first attempt (the demo retries it), then behaves as the agent."""
    if turn.attempt == 1:
        raise RuntimeError("transient upstream error (the demo retries it)")
    return await _agent(turn, guard)


def register(main: click.Group) -> None:
    """Attach ``demo`` to ``main``."""

    @main.command()
    @click.option("--turns", type=click.IntRange(1, 100_000), default=300, show_default=True)
    @click.option("--sessions", type=click.IntRange(1, 100_000), default=200, show_default=True)
    @click.option("--tenants", type=click.IntRange(1, 100), default=3, show_default=True)
    @click.option(
        "--concurrency", "-c", type=click.IntRange(1, 100_000), default=200, show_default=True, help="Turns in flight."
    )
    @click.option("--timeout", type=float, default=120.0, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
    @click.pass_obj
    def demo(
        obj: App, turns: int, sessions: int, tenants: int, concurrency: int, timeout: float, as_json: bool
    ) -> None:
        """Run a few hundred agent turns (awaiting a mock model) through an in-process worker."""
        # The runtime and rich load when the demo runs, not when `--help` lists the commands.
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from ..dispatch import Submission
        from ..runtime import AsyncWorker, RuntimeOptions
        from ..transports.flow import TurnEnd
        from . import emit

        # How a turn can end for good (a retried turn comes back).
        final = (TurnEnd.COMPLETED, TurnEnd.DEAD_LETTER, TurnEnd.FAILED, TurnEnd.EXPIRED, TurnEnd.SKIPPED)

        registry = obj.registry
        registry.add("demo_agent", _agent)
        registry.add("demo_flaky", _flaky)
        store, transport = obj.backends
        options = RuntimeOptions(concurrency=concurrency, grace_s=10, get_wait_s=0.1)
        worker = AsyncWorker(obj.settings, store, transport, registry, options=options)
        worker.preflight()
        subs = [
            Submission(
                kind="demo_flaky" if i % 10 == 3 else "demo_agent",
                payload={"n": i},
                tenant=f"tenant-{i % tenants}",
                session_id=f"demo-session-{i % sessions}",
                priority=1 if i % 10 == 0 else 0,
            )
            for i in range(turns)
        ]
        dispatcher = obj.dispatcher()
        handles = []
        for start in range(0, len(subs), 500):
            handles += dispatcher.submit_many(subs[start : start + 500])
        ids = {h.job_id: s.tenant for h, s in zip(handles, subs, strict=True)}
        console = Console(stderr=True)
        thread = threading.Thread(target=worker.run_forever, name="demo-worker", daemon=True)
        started = time.monotonic()
        thread.start()
        deadline = started + timeout
        with Progress(
            TextColumn("[bold]turns"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("in flight {task.fields[inflight]:>5}"),
            TextColumn("{task.fields[rate]:>6.1f} turns/s"),
            TimeElapsedColumn(),
            console=console,
            disable=as_json,
        ) as progress:
            task = progress.add_task("turns", total=len(ids), inflight=0, rate=0.0)
            done = 0
            while done < len(ids) and time.monotonic() < deadline and thread.is_alive():
                time.sleep(0.2)
                done = sum(worker.ended[e] for e in final)
                rate = done / max(1e-9, time.monotonic() - started)
                progress.update(task, completed=done, inflight=len(worker.running), rate=rate)
        wall = time.monotonic() - started
        worker.request_stop()
        thread.join(timeout=30)
        summary: dict[str, int] = {}
        for job_id, tenant in ids.items():
            status = store.get(job_id, tenant).status
            st = status.value if status.terminal else "unfinished"
            summary[st] = summary.get(st, 0) + 1

        def human() -> None:
            table = Table("status", "turns")
            for k, v in sorted(summary.items()):
                table.add_row(k, str(v))
            out = Console()
            out.print(
                f"{len(ids)} agent turns over {sessions} sessions and {tenants} tenants, "
                f"up to {concurrency} in flight: {wall:.1f} s, {len(ids) / wall:.1f} turns/s"
            )
            out.print(table)

        emit({"turns": len(ids), "by_status": summary}, as_json, human)
        if summary.get("unfinished"):
            raise SystemExit(1)
