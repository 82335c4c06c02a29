"""The ``agentdispatch`` command line."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import AgentDispatchError, ConfigError, TaskQueueUnavailable
from . import exits
from .app import App
from .usage import OneLineGroup

#: The module that registers each top-level command. A command's module is
#: imported only when that command runs, so ``agentdispatch token create`` does
#: not load the worker runtime or the demo's terminal UI.
_COMMANDS = {
    **dict.fromkeys(("cancel", "dlq", "jobs", "migrate", "status", "submit"), "jobs"),
    "schedule": "schedule",
    "worker": "worker",
    "demo": "demo",
    "doctor": "doctor",
    **dict.fromkeys(("gateway", "mcp", "token"), "gateway"),
    "intake": "intake",
}
_MODULES = ("jobs", "schedule", "worker", "demo", "doctor", "gateway", "intake")
_registered: set[str] = set()


def _register(group: click.Group, modules: tuple[str, ...] = _MODULES) -> None:
    for name in modules:
        if name not in _registered:
            _registered.add(name)
            importlib.import_module(f"{__name__}.{name}").register(group)


class Group(OneLineGroup):
    """Turns our errors into one clear line and a non-zero exit code."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            # An unknown name loads every module: the error then lists them all.
            home = _COMMANDS.get(cmd_name)
            _register(self, (home,) if home else _MODULES)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        _register(self)
        return super().list_commands(ctx)

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
