"""``agentdispatch intake install|agent|route|...``: durable intake administration."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from . import emit
from .app import App

if TYPE_CHECKING:
    from ..intake.base import IntakeStore

_SPEC = {
    # connector: (external id options, route key option)
    "slack": (("app_id", "team_id"), "app_id"),
    "telegram": (("bot_id",), "bot_id"),
    "twilio": (("account_sid", "number"), "account_sid"),
}


def _istore(obj: App) -> IntakeStore:
    from ..factory import open_intake_store

    return open_intake_store(obj.store)


def register(main: click.Group) -> None:
    """Attach ``intake`` to ``main``."""

    @main.group()
    def intake() -> None:
        """Slack, Telegram and Twilio intake: installations, agents, routes."""

    @intake.command("install")
    @click.argument("connector", type=click.Choice(sorted(_SPEC)))
    @click.option("--tenant", required=True, help="Tenant the installation's turns belong to.")
    @click.option("--app-id", default="", help="Slack api_app_id.")
    @click.option("--team-id", default="", help="Slack team (or enterprise) id.")
    @click.option("--bot-id", default="", help="Telegram bot id (the number before ':' in its token).")
    @click.option("--account-sid", default="", help="Twilio AccountSid.")
    @click.option("--number", default="", help="Twilio phone number (the To of inbound messages).")
    @click.option("--bot-user-id", default="", help="The bot's own user ids (comma-separated; Telegram: username).")
    @click.option("--public-url", default="", help="Public base URL providers call (Twilio signs it).")
    @click.option("--api-base", default="", help="Provider API base URL (default: the provider's).")
    @click.option("--credentials-ref", default=None, help="file:/path/to/credentials.json (read when needed).")
    @click.option(
        "--credentials-stdin",
        is_flag=True,
        help="Read credentials as JSON from stdin and seal them with AGENT_DISPATCH_INTAKE_KEY.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_obj
    def install(obj: App, /, connector: str, tenant: str, credentials_ref: str | None, credentials_stdin: bool,
                as_json: bool, **opts: str) -> None:  # fmt: skip
        """Create or update an installation (credentials never echoed)."""
        from ..intake.admin import install as do_install

        parts, route_opt = _SPEC[connector]
        if any(not opts[p] for p in parts):
            raise click.UsageError(f"{connector} needs " + ", ".join("--" + p.replace("_", "-") for p in parts))
        if (credentials_ref is None) == (not credentials_stdin):
            raise click.UsageError("give exactly one of --credentials-ref or --credentials-stdin")
        secrets = None
        if credentials_stdin:
            try:
                secrets = {str(k): str(v) for k, v in json.loads(sys.stdin.read()).items()}
            except (ValueError, AttributeError):
                raise click.UsageError("--credentials-stdin expects a JSON object") from None
        key = obj.settings.intake_key
        try:
            inst_id = do_install(
                _istore(obj),
                connector=connector,
                external_id=":".join(opts[p] for p in parts),
                route_key=opts[route_opt],
                tenant=tenant,
                master_key=key.get_secret_value() if key else None,
                secrets=secrets,
                reference=credentials_ref,
                bot_user_id=opts["bot_user_id"],
                api_base=opts["api_base"],
                public_url=opts["public_url"],
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        emit({"installation_id": inst_id}, as_json, lambda: click.echo(inst_id))

    @intake.command("stop")
    @click.argument("installation_id")
    @click.pass_obj
    def stop(obj: App, installation_id: str) -> None:
        """Stop an installation: its queued turns are rejected (installation_stopped)."""
        _status(obj, installation_id, "stopped")

    @intake.command("start")
    @click.argument("installation_id")
    @click.pass_obj
    def start(obj: App, installation_id: str) -> None:
        """Restart a stopped installation."""
        _status(obj, installation_id, "active")

    @intake.command("list")
    @click.argument("what", type=click.Choice(["installations", "agents", "routes", "receipts"]))
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_obj
    def listing(obj: App, what: str, as_json: bool) -> None:
        """List installations, agents, routes, or receipt counts by state."""
        from ..intake.admin import listing as do_list

        rows = do_list(_istore(obj), what)
        emit(rows, as_json, lambda: click.echo("\n".join("  ".join(f"{k}={v}" for k, v in r.items()) for r in rows)))

    @intake.command("agent")
    @click.argument("action", type=click.Choice(["add", "enable", "disable"]))
    @click.argument("name")
    @click.pass_obj
    def agent(obj: App, action: str, name: str) -> None:
        """Add, enable or disable an agent (a disabled agent's turns are rejected)."""
        from ..intake.admin import set_agent

        try:
            set_agent(_istore(obj), name, enabled=action != "disable")
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        click.echo(f"agent {name}: {'disabled' if action == 'disable' else 'enabled'}")

    @intake.command("route")
    @click.argument("action", type=click.Choice(["set", "rm"]))
    @click.argument("installation_id")
    @click.argument("channel")
    @click.argument("agent", required=False)
    @click.pass_obj
    def route(obj: App, action: str, installation_id: str, channel: str, agent: str | None) -> None:
        """Route CHANNEL (``*`` = every channel) of an installation to AGENT, or remove the route."""
        from ..intake.admin import set_route

        if action == "set" and not agent:
            raise click.UsageError("route set needs an AGENT")
        set_route(_istore(obj), installation_id, channel, agent if action == "set" else None)
        click.echo(f"route {channel}: {agent if action == 'set' else 'removed'}")

    @intake.command("scrub")
    @click.option(
        "--age-days",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="Scrub bodies older than this [default: AGENT_DISPATCH_INTAKE_SCRUB_AGE_S, 7 days].",
    )
    @click.pass_obj
    def scrub(obj: App, age_days: float | None) -> None:
        """Clear bodies of terminal receipts; identities stay so late duplicates are caught."""
        age_s = obj.settings.intake_scrub_age_s if age_days is None else age_days * 86400.0
        click.echo(f"scrubbed {_istore(obj).scrub(age_s)} receipts")

    @intake.command("messages")
    @click.argument("installation_id")
    @click.argument("conversation")
    @click.option("--tenant", required=True, help="Tenant scope: another tenant's conversation is not found.")
    @click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True, help="Newest N messages.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_obj
    def messages(obj: App, installation_id: str, conversation: str, tenant: str, limit: int, as_json: bool) -> None:
        """A conversation's captured messages, oldest first (coalesced and steered ones too)."""
        from ..intake.admin import messages as read

        rows = read(_istore(obj), installation_id, conversation, tenant=tenant, limit=limit)
        if rows is None:
            click.echo(f"error: conversation {conversation} of {installation_id} not found", err=True)
            sys.exit(1)
        emit(rows, as_json, lambda: click.echo("\n".join(f"{r['role']:<5} {r['sender']}: {r['text']}" for r in rows)))


def _status(obj: App, installation_id: str, status: str) -> None:
    from ..intake.admin import set_installation_status

    if not set_installation_status(_istore(obj), installation_id, status):
        click.echo(f"error: no installation {installation_id}", err=True)
        sys.exit(1)
    click.echo(f"installation {installation_id}: {status}")
