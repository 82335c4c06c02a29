"""The ``agentdispatch`` command line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import AgentDispatchError, ConfigError, TaskQueueUnavailable
from . import exits
from .app import App
from .usage import OneLineGroup


class Group(OneLineGroup):
    """Turns our errors into one clear line and a non-zero exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TaskQueueUnavailable as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exits.UNAVAILABLE)
        except (AgentDispatchError, ConfigError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exits.ERROR)


@click.group(cls=Group)
@click.version_option(package_name="agentdispatch")
@click.pass_context
def main(ctx: click.Context) -> None:
    """agentdispatch: run AI-agent turns from a durable queue.

    Configuration comes from the environment (TASK_QUEUE_BACKEND, STATE_DB_URI,
    AGENT_DISPATCH_MAX_DEPTH, AGENT_DISPATCH_CLAIM_TTL_S, ...); see `doctor`.
    """
    ctx.obj = App()


def emit(data: Any, as_json: bool, human: Callable[[], None]) -> None:
    """Print ``data`` as JSON, or call the human renderer."""
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human()


def _register() -> None:
    from . import demo, doctor, gateway, intake, jobs, schedule, worker

    for module in (jobs, schedule, worker, demo, doctor, gateway, intake):
        module.register(main)


_register()
