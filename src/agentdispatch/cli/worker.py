"""``agentdispatch worker`` and the ``agent-dispatch-worker`` console script."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import click

from ..errors import AgentDispatchError, TaskQueueUnavailable
from ..fleet import named_worker_id
from ..logs import configure as configure_logs
from ..metrics import Exposition, FleetCollector, Metrics
from ..runtime import AsyncWorker, RuntimeOptions
from ..settings import check_worker_name
from ..stores.base import Store
from ..transports.base import Transport
from . import exits
from .app import App
from .usage import OneLineCommand

CONCURRENCY = click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(1, 100_000),
    default=None,
    help="Turns in flight at most, on one event loop: async def handlers are awaited as tasks "
    f"[default: {RuntimeOptions.concurrency}; with --workers N: N].",
)
THREADS = click.option(
    "--threads",
    type=click.IntRange(1, 1024),
    default=None,
    help="Threads running synchronous handlers (async def handlers need none) "
    f"[default: {RuntimeOptions.threads}; with --workers N: N].",
)
WORKERS = click.option(
    "--workers",
    "-w",
    type=click.IntRange(1, 1024),
    default=None,
    help="Kept for compatibility: --workers N means --concurrency N --threads N "
    "(N turns at once, each sync handler on a thread of its own).",
)
APP = click.option("--app", "app_spec", default=None, help="Handlers as module:registry [env: AGENT_DISPATCH_APP].")
GRACE = click.option(
    "--grace",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds turns in flight get after SIGTERM; then they are cancelled and their leases released.",
)
METRICS = click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics on PORT (this worker's turns and the fleet gauges).",
)
METRICS_HOST = click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the --metrics-port server binds (no authentication: keep it private).",
)
NAME = click.option(
    "--name",
    default=None,
    help="This worker's stable name, e.g. its pod name: starting under a name takes over at once the turns "
    "its earlier incarnations held [env: AGENT_DISPATCH_WORKER_NAME].",
)
BATCH = click.option(
    "--batch",
    type=click.IntRange(1, 1024),
    default=RuntimeOptions.claim_batch,
    show_default=True,
    help="Turns claimed per statement at most when capacity frees up.",
)


def options_of(
    concurrency: int | None, threads: int | None, workers: int | None, grace: float, batch: int
) -> RuntimeOptions:
    """The runtime options the flags ask for (``--workers`` as the alias it is)."""
    defaults = RuntimeOptions()
    return RuntimeOptions(
        concurrency=concurrency or workers or defaults.concurrency,
        threads=threads or workers or defaults.threads,
        grace_s=grace,
        claim_batch=batch,
    )


def serve_metrics(port: int, host: str, metrics: Metrics, store: Store, transport: Transport) -> None:
    """Serve this worker's series and the fleet gauges (read from the store at
    each scrape, as the gateway does) on ``host:port``."""
    from prometheus_client import start_http_server

    fleet = FleetCollector(lambda: (store, transport))
    start_http_server(port, addr=host, registry=Exposition(metrics.registry, fleet))


def run_worker(
    obj: App,
    options: RuntimeOptions,
    app_spec: str | None,
    metrics_port: int | None,
    metrics_host: str = "127.0.0.1",
    name: str | None = None,
) -> None:
    """Preflight (exit 2 on failure, naming the setting), then run until SIGTERM/SIGINT."""
    obj.app_spec = app_spec
    if name is not None:
        try:
            check_worker_name(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--name'") from None
    try:
        settings = obj.settings
        configure_logs(settings.log_format.value)
        store, transport = obj.backends
        name = name or settings.worker_name
        worker_id = named_worker_id(name) if name else None
        worker = AsyncWorker(settings, store, transport, obj.registry, options=options, worker_id=worker_id)
        worker.preflight()
    except TaskQueueUnavailable as exc:
        # A message that names its remedy (a full disk, a setting) is not
        # followed by a guess that would send the operator elsewhere.
        guess = "" if exc.explained else " (check TASK_QUEUE_BACKEND / STATE_DB_URI / KAFKA_BOOTSTRAP_SERVERS)"
        click.echo(f"error: preflight failed: {exc}{guess}", err=True)
        sys.exit(exits.PREFLIGHT)
    except sqlite3.DatabaseError:
        # Raised as is at run time (a worker exits non-zero); at start-up it is a setting to check.
        click.echo(
            "error: preflight failed: the SQLite queue file is not a database (check AGENT_DISPATCH_DATA_DIR)",
            err=True,
        )
        sys.exit(exits.PREFLIGHT)
    if metrics_port is not None:
        serve_metrics(metrics_port, metrics_host, worker.metrics, store, transport)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        worker.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    click.echo(
        f"worker {worker.worker_id}: up to {options.concurrency} turn(s) in flight "
        f"({options.threads} thread(s) for sync handlers) on {transport.name}; "
        f"kinds: {', '.join(obj.registry.kinds())}",
        err=True,
    )
    clean = worker.run_forever()
    if worker.fatal is not None:
        # Exit non-zero so that a supervisor restarts the process.
        click.echo(f"worker {worker.worker_id}: stopped by an unrecoverable error: {worker.fatal!r}", err=True)
        sys.exit(exits.WORKER_FATAL)
    state = "clean" if clean else "grace period ran out; the turns left were released"
    click.echo(f"worker {worker.worker_id}: stopped ({state})", err=True)
    if not clean and _abandoned_threads():
        # A sync handler past the grace cannot be interrupted; its lease is
        # released and its guard revoked, so nothing of it can land. Exit
        # now: the interpreter would otherwise wait for it to return.
        for closing in (transport, store):
            with contextlib.suppress(Exception):
                closing.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(0)


def _abandoned_threads() -> bool:
    """Whether threads other than the main one would hold up the exit."""
    main = threading.main_thread()
    return any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate())


def _flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    for flag in reversed((CONCURRENCY, THREADS, WORKERS, APP, GRACE, METRICS, METRICS_HOST, NAME, BATCH)):
        fn = flag(fn)
    return fn


def register(main: click.Group) -> None:
    """Attach ``worker`` to ``main``."""

    @main.command()
    @_flags
    @click.pass_obj
    def worker(
        obj: App,
        concurrency: int | None,
        threads: int | None,
        workers: int | None,
        app_spec: str | None,
        grace: float,
        metrics_port: int | None,
        metrics_host: str,
        name: str | None,
        batch: int,
    ) -> None:
        """Run turns until SIGTERM/SIGINT: up to --concurrency at once in one process."""
        options = options_of(concurrency, threads, workers, grace, batch)
        run_worker(obj, options, app_spec, metrics_port, metrics_host, name)


@click.command(cls=OneLineCommand)
@_flags
def worker_main(
    concurrency: int | None,
    threads: int | None,
    workers: int | None,
    app_spec: str | None,
    grace: float,
    metrics_port: int | None,
    metrics_host: str,
    name: str | None,
    batch: int,
) -> None:
    """agent-dispatch-worker: run turns until SIGTERM/SIGINT, up to --concurrency at once."""
    try:
        options = options_of(concurrency, threads, workers, grace, batch)
        run_worker(App(), options, app_spec, metrics_port, metrics_host, name)
    except AgentDispatchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
