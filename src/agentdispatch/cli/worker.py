"""``agentdispatch worker`` and the ``agent-dispatch-worker`` console script."""

from __future__ import annotations

import logging
import signal
import sqlite3
import sys
from types import FrameType

import click

from ..errors import AgentDispatchError, TaskQueueUnavailable
from ..worker import Worker, WorkerOptions
from .app import App
from .usage import OneLineCommand

WORKERS = click.option(
    "--workers", "-w", type=click.IntRange(1, 256), default=1, show_default=True, help="Worker threads."
)
APP = click.option("--app", "app_spec", default=None, help="Handlers as module:registry [env: AGENT_DISPATCH_APP].")
GRACE = click.option(
    "--grace", type=float, default=30.0, show_default=True, help="Seconds running turns get after SIGTERM."
)
METRICS = click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
BATCH = click.option(
    "--batch",
    type=click.IntRange(1, 256),
    default=WorkerOptions.batch_max,
    show_default=True,
    help="Turns a claim thread runs per commit at most, while turns are fast (1: a commit per turn).",
)


def run_worker(
    obj: App, workers: int, app_spec: str | None, grace: float, metrics_port: int | None, batch: int
) -> None:
    """Preflight (exit 2 on failure), then run until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    obj.app_spec = app_spec
    try:
        settings = obj.settings
        store, transport = obj.backends
        options = WorkerOptions(threads=workers, grace_s=grace, batch_max=batch)
        worker = Worker(settings, store, transport, obj.registry, options=options)
        worker.preflight()
    except TaskQueueUnavailable as exc:
        click.echo(
            f"error: preflight failed: {exc} (check TASK_QUEUE_BACKEND / STATE_DB_URI / KAFKA_BOOTSTRAP_SERVERS)",
            err=True,
        )
        sys.exit(2)
    except sqlite3.DatabaseError:
        # Raised as is at run time (a worker exits non-zero); at start-up it is a setting to check.
        click.echo(
            "error: preflight failed: the SQLite queue file is not a database (check AGENT_DISPATCH_DATA_DIR)",
            err=True,
        )
        sys.exit(2)
    if metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr="127.0.0.1", registry=worker.metrics.registry)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        worker.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    click.echo(
        f"worker {worker.worker_id}: {workers} thread(s) on {transport.name}; kinds: {', '.join(obj.registry.kinds())}",
        err=True,
    )
    clean = worker.run_forever()
    if worker.fatal is not None:
        # Exit non-zero so that a supervisor restarts the process.
        click.echo(f"worker {worker.worker_id}: stopped by an unrecoverable error: {worker.fatal!r}", err=True)
        sys.exit(3)
    click.echo(f"worker {worker.worker_id}: stopped ({'clean' if clean else 'grace period ran out'})", err=True)
    sys.exit(0)


def register(main: click.Group) -> None:
    """Attach ``worker`` to ``main``."""

    @main.command()
    @WORKERS
    @APP
    @GRACE
    @METRICS
    @BATCH
    @click.pass_obj
    def worker(
        obj: App, workers: int, app_spec: str | None, grace: float, metrics_port: int | None, batch: int
    ) -> None:
        """Run worker threads until SIGTERM/SIGINT."""
        run_worker(obj, workers, app_spec, grace, metrics_port, batch)


@click.command(cls=OneLineCommand)
@WORKERS
@APP
@GRACE
@METRICS
@BATCH
def worker_main(workers: int, app_spec: str | None, grace: float, metrics_port: int | None, batch: int) -> None:
    """agent-dispatch-worker: run worker threads until SIGTERM/SIGINT."""
    try:
        run_worker(App(), workers, app_spec, grace, metrics_port, batch)
    except AgentDispatchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
