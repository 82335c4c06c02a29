"""``agentdispatch schedule add|list|pause|resume|delete``: periodic jobs."""

from __future__ import annotations

from typing import Any

import click

from .app import App
from .jobs import JSON, TENANT, human_value, parse_json_option


def _emit(data: Any, as_json: bool, human: Any) -> None:
    from . import emit

    emit(data, as_json, human)


def _line(view: dict[str, Any]) -> None:
    state = "paused" if view["paused"] else f"next at {human_value('next_at', view['next_at'])}"
    click.echo(f"{view['name']}: {view['cron']} ({view['tz']}) {view['kind']}, {state}")


def register(main: click.Group) -> None:
    """Attach the ``schedule`` group to ``main``."""
    from ..schedules import Schedules

    def schedules(obj: App, *, check_kinds: bool = False) -> Schedules:
        return Schedules(obj.dispatcher(check_kinds=check_kinds))

    @main.group()
    def schedule() -> None:
        """Periodic schedules: one job per cron tick, fired once across the fleet."""

    @schedule.command("add")
    @click.argument("name")
    @click.argument("kind")
    @click.option("--cron", required=True, help="Cron expression, e.g. '*/5 * * * *' (6 fields: seconds last).")
    @click.option("--tz", default="UTC", show_default=True, help="IANA time zone of the cron expression.")
    @click.option("--payload", default="null", help="JSON payload of every job.")
    @click.option("--session", "session_id", default=None, help="Serial scope of the ticks (default: each its own).")
    @click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
    @click.option("--paused", is_flag=True, help="Store it paused.")
    @click.option("--app", "app_spec", default=None, help="module:registry to check kinds [env: AGENT_DISPATCH_APP].")
    @TENANT
    @JSON
    @click.pass_obj
    def add(
        obj: App, /, name: str, kind: str, payload: str, tenant: str, as_json: bool, app_spec: str | None, **kw: Any
    ) -> None:
        """Add schedule NAME firing a job of KIND at each tick."""
        body = parse_json_option(payload, "--payload")
        obj.app_spec = app_spec
        view = schedules(obj, check_kinds=True).add(tenant, name, kind=kind, payload=body, **kw)
        _emit(view, as_json, lambda: _line(view))

    @schedule.command("list")
    @TENANT
    @JSON
    @click.pass_obj
    def list_(obj: App, tenant: str, as_json: bool) -> None:
        """The tenant's schedules."""
        views = schedules(obj).entries(tenant)

        def human() -> None:
            from rich.console import Console  # only for a person's table
            from rich.table import Table

            table = Table("name", "cron", "tz", "kind", "paused", "next_at", "last_job_id")
            for v in views:
                cells = (v["name"], v["cron"], v["tz"], v["kind"], v["paused"], human_value("next_at", v["next_at"]))
                table.add_row(*map(str, cells), v["last_job_id"] or "")
            Console().print(table)

        _emit(views, as_json, human)

    for verb, doc in (
        ("pause", "Stop firing NAME until resumed."),
        ("resume", "Fire NAME again from its first tick after now."),
        ("delete", "Delete NAME (the jobs it fired stay)."),
    ):

        def act(obj: App, name: str, tenant: str, as_json: bool, verb: str = verb) -> None:
            view = getattr(schedules(obj), verb)(tenant, name)
            _emit(view, as_json, lambda: click.echo(f"{name}: {verb}d"))

        act.__doc__ = doc
        command = click.argument("name")(TENANT(JSON(click.pass_obj(act))))
        schedule.command(verb)(command)
