"""submit, status, cancel, jobs, dlq, migrate."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from ..dispatch import Submission
from ..errors import InvalidInput
from ..stores.base import JobFilter
from ..waiting import MAX_WAIT_S
from ..workitem import Status, WorkItem
from .app import App

TENANT = click.option("--tenant", default="default", show_default=True, help="Tenant scope.")
JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON (times stay Unix seconds).")
ALL_TENANTS = click.option(
    "--all-tenants", is_flag=True, help="Every tenant (the operator's view; the CLI reads the store directly)."
)
STATUSES = click.Choice([s.value for s in Status])


def _emit(data: Any, as_json: bool, human: Any) -> None:
    from . import emit

    emit(data, as_json, human)


def _table(items: list[WorkItem], *, tenants: bool = False) -> None:
    """Jobs as a table that reads at 80 columns: ids whole (they are copied
    into other commands), free text shortened with an ellipsis, and the
    reason column only when some job has one."""
    # rich loads only for a person's table, not for each --json call of a script.
    from rich import box
    from rich.console import Console
    from rich.table import Column, Table

    reasons = any(it.reason for it in items)
    columns = [
        Column("job_id", no_wrap=True, min_width=41),
        Column("status", no_wrap=True),
        Column("att", no_wrap=True, justify="right"),
        Column("kind", no_wrap=True, overflow="ellipsis", max_width=16),
    ]
    if tenants:
        columns.append(Column("tenant", no_wrap=True, overflow="ellipsis", max_width=12))
    if reasons:
        columns.append(Column("reason", no_wrap=True, overflow="ellipsis"))
    table = Table(*columns, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for it in items:
        row = [it.id, it.status.value, f"{it.attempt}/{it.max_attempts}", it.kind]
        row += [it.tenant] if tenants else []
        row += [it.reason or ""] if reasons else []
        table.add_row(*row)
    Console().print(table)


#: View keys holding Unix times (of jobs and schedules): shown as ISO 8601 (UTC) to people.
_TIMES = frozenset(
    {"created_at", "ready_at", "updated_at", "completed_at", "deadline_unix", "at", "next_at", "last_tick"}
)


def human_value(key: str, value: Any) -> str:
    """One value of a job view as a person reads it (``--json`` keeps the raw one)."""
    if value is None or value == "" or value == []:
        return "-"
    if key in _TIMES and isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_json_option(text: str, option: str) -> Any:
    """The JSON value of an option, or :class:`InvalidInput` naming it (also
    for a value nested deeper than the parser's recursion limit)."""
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidInput(f"{option} is not valid JSON") from None
    except RecursionError:
        raise InvalidInput(f"{option} nests too deeply") from None


def parse_duration(text: str, option: str = "--delay") -> float:
    """``30s``, ``5m``, ``2h``, ``1d`` or plain seconds."""
    m = _DURATION.match(text.lower())
    if m is None:
        raise InvalidInput(f"{option} {text!r} is not a duration like 30s, 5m, 2h or 1d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_when(text: str) -> float:
    """An ISO 8601 time as unix seconds; without an offset it is local time."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise InvalidInput(f"--at {text!r} is not an ISO 8601 time like 2026-05-01T09:30:00+02:00") from None
    return when.timestamp()


def _moment(text: str | None, option: str) -> float | None:
    """A point in time: ISO 8601, or a duration before now."""
    if text is None:
        return None
    if _DURATION.match(text.lower()):
        return time.time() - parse_duration(text)
    try:
        return parse_when(text)
    except InvalidInput:
        raise InvalidInput(f"{option} {text!r} is neither an ISO 8601 time nor a duration like 2h") from None


def register(main: click.Group) -> None:
    """Attach the commands to ``main``."""

    @main.command()
    @click.argument("kind")
    @click.option("--payload", default="null", help="JSON payload (max 1 MiB), or @file to read it.")
    @click.option("--session", "session_id", default=None, help="Serial scope (default: the job id).")
    @click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
    @click.option(
        "--deadline", "deadline_unix", type=float, default=None, help="Unix time; cancelled as expired after."
    )
    @click.option("--depends-on", "dependencies", multiple=True, help="Job id this one waits for (repeatable).")
    @click.option("--job-id", default=None, help="Caller-chosen id (a retry returns the same job).")
    @click.option("--idempotency-key", default=None, help="Derive the job id from this key.")
    @click.option("--delay", default=None, help="Start no earlier than this from now: 30s, 5m, 2h, 1d.")
    @click.option("--at", "at", default=None, help="Start no earlier than this ISO 8601 time (local if no offset).")
    @click.option("--timeout", default=None, help="Cancel and retry an attempt running longer than this: 90s, 5m.")
    @click.option("--app", "app_spec", default=None, help="module:registry to check kinds [env: AGENT_DISPATCH_APP].")
    @TENANT
    @JSON
    @click.pass_obj
    def submit(
        obj: App, /, kind: str, payload: str, tenant: str, as_json: bool, app_spec: str | None, **kw: Any
    ) -> None:
        """Submit one turn and print its job handle."""
        if payload.startswith("@"):
            # Large payloads come from a file: one argv string is capped at 128 KiB.
            try:
                payload = Path(payload[1:]).read_text(encoding="utf-8")
            except OSError as exc:
                raise InvalidInput(f"--payload file cannot be read ({exc.strerror})") from None
            except UnicodeDecodeError:
                raise InvalidInput("--payload file is not UTF-8 text") from None
        body = parse_json_option(payload, "--payload")
        obj.app_spec = app_spec
        delay, at = kw.pop("delay"), kw.pop("at")
        if delay is not None and at is not None:
            raise InvalidInput("give --delay or --at, not both")
        kw["delay_s"] = None if delay is None else parse_duration(delay)
        kw["not_before"] = None if at is None else parse_when(at)
        timeout = kw.pop("timeout")
        kw["timeout_s"] = None if timeout is None else parse_duration(timeout, "--timeout")
        sub = Submission(kind=kind, payload=body, tenant=tenant, **{**kw, "dependencies": tuple(kw["dependencies"])})
        handle = obj.dispatcher(check_kinds=True).submit(sub)
        _emit(handle.model_dump(), as_json, lambda: click.echo(handle.job_id))

    @main.command()
    @click.argument("job_id")
    @click.option("--history", is_flag=True, help="Include events and the side-effect ledger.")
    @click.option(
        "--wait",
        "wait_s",
        type=click.FloatRange(0, MAX_WAIT_S),
        default=0,
        help=f"Seconds (at most {MAX_WAIT_S:g}) to wait for the job to end first.",
    )
    @TENANT
    @JSON
    @click.pass_obj
    def status(obj: App, job_id: str, tenant: str, history: bool, wait_s: float, as_json: bool) -> None:
        """Show one job (with --wait: once it ended, or when the wait is over)."""
        d = obj.dispatcher()
        if wait_s > 0:
            d.wait(job_id, tenant, wait_s)
        view: dict[str, Any] = d.history(job_id, tenant) if history else d.status(job_id, tenant)

        def human() -> None:
            job = view["job"] if history else view
            for k, v in job.items():
                click.echo(f"{k:>14}: {human_value(k, v)}")
            for ev in view.get("events", []):
                click.echo(
                    f"  {human_value('at', ev.get('at'))} {ev['event']:<14} status={ev['status']} "
                    f"attempt={ev['attempt']} epoch={ev['epoch']}"
                )
            for eff in view.get("side_effects", []):
                click.echo(f"  effect {eff['key']} {eff['state']} epoch={eff['epoch']}")

        _emit(view, as_json, human)

    @main.command()
    @click.argument("job_id")
    @TENANT
    @JSON
    @click.pass_obj
    def cancel(obj: App, job_id: str, tenant: str, as_json: bool) -> None:
        """Cancel a job (fences out a running worker)."""
        view = obj.dispatcher().cancel(job_id, tenant)
        _emit(view, as_json, lambda: click.echo(f"{job_id}: {view['status']}"))

    @main.command()
    @click.option("--status", "status_", type=STATUSES, default=None, help="Filter by status.")
    @click.option("--kind", default=None, help="Only this kind.")
    @click.option("--session", "session_id", default=None, help="Only this session.")
    @click.option("--agent", "agent_name", default=None, help="Only this agent.")
    @click.option("--since", default=None, help="Created at or after: ISO 8601 time, or a duration ago (2h).")
    @click.option("--until", default=None, help="Created before: ISO 8601 time, or a duration ago (2h).")
    @click.option("--search", "id_contains", default=None, help="Text in the job id.")
    @click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
    @click.option("--offset", type=click.IntRange(0), default=0, show_default=True)
    @TENANT
    @ALL_TENANTS
    @JSON
    @click.pass_obj
    def jobs(
        obj: App,
        /,
        status_: str | None,
        since: str | None,
        until: str | None,
        limit: int,
        offset: int,
        tenant: str,
        all_tenants: bool,
        as_json: bool,
        **kw: Any,
    ) -> None:
        """List jobs, newest first; filters apply across every page."""
        filters = JobFilter(created_from=_moment(since, "--since"), created_to=_moment(until, "--until"), **kw)
        status = Status(status_) if status_ else None
        scope = None if all_tenants else tenant
        items = obj.dispatcher().jobs(scope, status, limit=limit, offset=offset, filters=filters)
        _emit([i.view() for i in items], as_json, lambda: _table(items, tenants=all_tenants))

    @main.group()
    def dlq() -> None:
        """The dead-letter queue."""

    @dlq.command("list")
    @click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
    @TENANT
    @ALL_TENANTS
    @JSON
    @click.pass_obj
    def dlq_list(obj: App, limit: int, tenant: str, all_tenants: bool, as_json: bool) -> None:
        """Dead-lettered jobs and poison envelopes."""
        items = obj.dispatcher().jobs(None if all_tenants else tenant, Status.DEAD_LETTER, limit=limit)
        poison = obj.store.poison(limit=limit)

        def human() -> None:
            _table(items, tenants=all_tenants)
            if not items and not all_tenants:
                counts = obj.store.counts(None).get(Status.DEAD_LETTER.value, 0)
                if counts:
                    click.echo(f"tenant {tenant}: none; {counts} in other tenants (--all-tenants shows them)")
            for p in poison:
                click.echo(f"poison {p['digest'][:12]}  {p['reason']}")

        _emit({"jobs": [i.view() for i in items], "poison": poison}, as_json, human)

    @dlq.command("replay")
    @click.argument("job_id")
    @TENANT
    @JSON
    @click.pass_obj
    def dlq_replay(obj: App, job_id: str, tenant: str, as_json: bool) -> None:
        """Move a dead-lettered job back to ready (a new attempt)."""
        d = obj.dispatcher()
        view = d.replay(job_id, tenant)
        effects = d.history(job_id, tenant)["side_effects"]

        def human() -> None:
            click.echo(f"{job_id}: {view['status']} (attempt {view['attempt']} of {view['max_attempts']})")
            for eff in effects:
                click.echo(f"  side effect {eff['key']}: {eff['state']}")

        _emit({"job": view, "side_effects": effects}, as_json, human)

    @main.command()
    @click.pass_obj
    def migrate(obj: App) -> None:
        """Create or upgrade the schema of the configured store."""
        from ..factory import open_store

        store = open_store(obj.settings, migrate=True)
        click.echo(f"schema version {store.schema_version()} ({store.name})")
