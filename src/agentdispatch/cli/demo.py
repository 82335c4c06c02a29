"""``agentdispatch demo``: workers in-process, a few hundred turns over several
sessions and tenants, a progress bar, and a summary by status."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..dispatch import Submission
from ..handlers import Turn
from ..lease import LeaseGuard
from ..worker import Worker, WorkerOptions
from .app import App


def _flaky(turn: Turn, guard: LeaseGuard) -> Any:
    """Fails its first attempt, then sends one (recorded) notification."""
    if turn.attempt == 1:
        raise RuntimeError("transient upstream error (the demo retries it)")
    return guard.side_effect(f"notify:{turn.job_id}", lambda: {"sent": True})


def register(main: click.Group) -> None:
    """Attach ``demo`` to ``main``."""

    @main.command()
    @click.option("--turns", type=click.IntRange(1, 100_000), default=300, show_default=True)
    @click.option("--sessions", type=click.IntRange(1, 10_000), default=12, show_default=True)
    @click.option("--tenants", type=click.IntRange(1, 100), default=3, show_default=True)
    @click.option("--workers", type=click.IntRange(1, 64), default=4, show_default=True)
    @click.option("--timeout", type=float, default=120.0, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
    @click.pass_obj
    def demo(obj: App, turns: int, sessions: int, tenants: int, workers: int, timeout: float, as_json: bool) -> None:
        """Run a few hundred turns through in-process workers."""
        from . import emit

        registry = obj.registry
        registry.add("demo_flaky", _flaky)
        store, transport = obj.backends
        worker = Worker(obj.settings, store, transport, registry, options=WorkerOptions(threads=workers, grace_s=10))
        worker.preflight()
        worker.start()
        dispatcher = obj.dispatcher()
        subs = []
        for i in range(turns):
            kind = ("echo", "echo", "sleep", "demo_flaky")[i % 4]
            payload: Any = {"seconds": 0.01} if kind == "sleep" else {"n": i}
            subs.append(
                Submission(
                    kind=kind,
                    payload=payload,
                    tenant=f"tenant-{i % tenants}",
                    session_id=f"demo-session-{i % sessions}",
                    priority=1 if i % 10 == 0 else 0,
                )
            )
        handles = []
        for start in range(0, len(subs), 100):
            handles += dispatcher.submit_many(subs[start : start + 100])
        ids = {h.job_id: s.tenant for h, s in zip(handles, subs, strict=True)}
        console = Console(stderr=True)
        final: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        with Progress(
            TextColumn("[bold]turns"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            disable=as_json,
        ) as progress:
            task = progress.add_task("turns", total=len(ids))
            while len(final) < len(ids) and time.monotonic() < deadline:
                for job_id, tenant in ids.items():
                    if job_id not in final:
                        status = store.get(job_id, tenant).status
                        if status.terminal:
                            final[job_id] = status.value
                progress.update(task, completed=len(final))
                time.sleep(0.2)
        worker.stop()
        summary: dict[str, int] = {}
        for job_id in ids:
            st = final.get(job_id) or "unfinished"
            summary[st] = summary.get(st, 0) + 1

        def human() -> None:
            table = Table("status", "turns")
            for k, v in sorted(summary.items()):
                table.add_row(k, str(v))
            console = Console()
            console.print(f"{len(ids)} turns over {sessions} sessions and {tenants} tenants:")
            console.print(table)

        emit({"turns": len(ids), "by_status": summary}, as_json, human)
        if summary.get("unfinished"):
            raise SystemExit(1)
