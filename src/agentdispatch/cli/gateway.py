"""``agentdispatch gateway``, ``token create|revoke`` and ``mcp``."""

from __future__ import annotations

import secrets
import signal
import sys
from types import FrameType
from typing import Any

import click

from .app import App

HOST = click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
GATEWAY_PORT = click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
MCP_PORT = click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)


def gateway_checks(obj: App) -> list[Any]:
    """Doctor lines for the gateway: the app builds with its dashboard assets,
    and the token table answers. Optional extra: absent is not a failure."""
    from .doctor import Check, _try

    try:
        import fastapi  # noqa: F401
        import mcp  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return [Check("gateway", True, f"not installed ({exc.name} missing): pip install 'agentdispatch[gateway]'")]

    def app() -> str:
        from ..gateway import Services, create_app
        from ..gateway.app import _ASSETS, _asset

        paths = create_app(Services.of(obj.settings, obj.store, obj.transport)).openapi()["paths"]
        sizes = [len(_asset(name)) for name in ("index.html", *_ASSETS)]
        return f"app builds, {len(paths)} API paths, dashboard assets present ({sum(sizes)} bytes)"

    def tokens() -> str:
        from ..gateway.auth import hash_token

        # A random hash cannot match: this only proves the table is readable.
        obj.store.token_lookup(hash_token(secrets.token_hex(16)))
        return "token table readable; tokens stored hashed"

    return [_try("gateway", app), _try("gateway_tokens", tokens)]


def _stopped(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside uvicorn's own handler: a clean stop (exit 0)."""
    raise SystemExit(0)


def register(main: click.Group) -> None:
    """Attach ``gateway``, ``token`` and ``mcp`` to ``main``."""

    @main.command()
    @HOST
    @GATEWAY_PORT
    @click.option(
        "--no-auth", is_flag=True, help="Serve without bearer tokens (loopback only; callers act as operator)."
    )
    @click.option("--log-level", default="warning", show_default=True, help="uvicorn log level.")
    @click.pass_obj
    def gateway(obj: App, host: str, port: int, no_auth: bool, log_level: str) -> None:
        """Serve the HTTP API, /metrics and the dashboard (needs the gateway extra)."""
        import uvicorn

        from ..gateway import Services, create_app
        from ..gateway.auth import check_bind
        from ..gateway.protocol import with_head_deadline
        from ..logs import logging_config

        try:
            check_bind(host, auth=not no_auth)
        except ValueError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        services = Services.of(obj.settings, obj.store, obj.transport, auth=not no_auth)
        services.store.ping()
        services.transport.ping()
        mode = "auth off (loopback)" if no_auth else "bearer auth"
        # uvicorn shuts down gracefully on SIGTERM, then raises the signal again
        # under the handler it found: with the default one the process died
        # there (exit 143) before the store and transport were closed.
        signal.signal(signal.SIGTERM, _stopped)
        try:
            config = uvicorn.Config(
                create_app(services),
                host=host,
                port=port,
                # One log format for uvicorn's lines and ours (AGENT_DISPATCH_LOG_FORMAT).
                log_config=logging_config(obj.settings.log_format.value, log_level),
                access_log=False,
                http=with_head_deadline(obj.settings.intake_body_timeout_s),
            )
            # Bound before the URL is printed, so --port 0 prints the port it got.
            sock = config.bind_socket()
            bound = sock.getsockname()[1]
            click.echo(f"gateway on {services.transport.name}, {mode}: {url_of(host, bound)}", err=True)
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            services.close()

    @main.group()
    def token() -> None:
        """Gateway bearer tokens (each bound to one tenant, stored hashed)."""

    @token.command("create")
    @click.option("--tenant", required=True, help="The tenant this token acts for.")
    @click.option("--label", default="", help="A note to recognise the token by.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_obj
    def token_create(obj: App, tenant: str, label: str, as_json: bool) -> None:
        """Mint a token; it is printed once and only its hash is kept."""
        from ..gateway.auth import mint

        try:
            token_id, secret = mint(obj.store, tenant, label)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--tenant") from None
        if as_json:
            import json

            click.echo(json.dumps({"token_id": token_id, "tenant": tenant, "token": secret}))
            return
        click.echo(f"token id: {token_id}  tenant: {tenant}", err=True)
        click.echo("store it now; it will not be shown again:", err=True)
        click.echo(secret)

    @token.command("revoke")
    @click.argument("token_id")
    @click.pass_obj
    def token_revoke(obj: App, token_id: str) -> None:
        """Revoke a token by its id; requests with it answer 401 at once."""
        if not obj.store.token_revoke(token_id):
            click.echo(f"error: no live token with id {token_id}", err=True)
            sys.exit(1)
        click.echo(f"revoked {token_id}")

    @main.command()
    @click.option(
        "--transport",
        "mode",
        type=click.Choice(["stdio", "streamable-http"]),
        default="stdio",
        show_default=True,
        help="How MCP clients connect.",
    )
    @click.option("--tenant", default="default", show_default=True, help="Tenant every tool call acts for.")
    @HOST
    @MCP_PORT
    @click.pass_obj
    def mcp(obj: App, mode: str, tenant: str, host: str, port: int) -> None:
        """Serve the MCP tools graph_orchestrate and graph_jobs."""
        from ..gateway.auth import is_loopback
        from ..mcp_server import build_server

        if mode == "streamable-http" and not is_loopback(host):
            # The MCP endpoint has no token check of its own: keep it on this machine.
            click.echo(f"error: refusing to serve MCP over HTTP on {host}; use a loopback address", err=True)
            sys.exit(2)
        server = build_server(obj.dispatcher(), tenant=tenant)
        signal.signal(signal.SIGTERM, _stopped)  # as for the gateway: uvicorn re-raises it
        if mode == "stdio":
            server.run("stdio")
        else:
            server.run("streamable-http", host=host, port=port)


def url_of(host: str, port: int) -> str:
    """The URL a person can paste: an IPv6 address goes in brackets."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
