"""``create_app(services)``: the gateway's ASGI application."""

# No `from __future__ import annotations`: FastAPI must evaluate the route
# signatures, which use aliases local to the router factory.
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import heap
from ..schedules import Firer
from . import api, errors, intake, ops, schedules_api
from .auth import Caller, authenticate
from .services import Services

_ASSETS = {n: "text/javascript" for n in ("app.js", "chart.js", "drawer.js")} | {"app.css": "text/css"}
#: The dashboard only talks to its own origin and never runs inline code.
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'"


#: A 1 MiB payload plus its JSON envelope fits; anything larger is refused unread.
MAX_BODY_BYTES = 2 * 1024 * 1024


class BodyLimit:
    """413 for request bodies over :data:`MAX_BODY_BYTES`, before buffering
    them; 408 for a body not complete within ``timeout_s`` of its request
    (the head has its own deadline, :mod:`.protocol`). Without it a caller,
    with or without a token, that sent a head and then trickled its body held
    a connection for as long as it liked. Webhooks read theirs under the same
    deadline themselves, answering each provider its own way."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES, timeout_s: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            path = scope["path"]
            if path.startswith(intake.PREFIX):
                # Answered as the webhook answers its own refusals (Slack is told not to retry).
                await intake.declared_too_large(path)(scope, receive, send)
            else:
                await errors.map_exception(_too_large(self.limit))(scope, receive, send)
            return
        timed = self.timeout_s is not None and not scope["path"].startswith(intake.PREFIX)
        deadline = asyncio.get_running_loop().time() + (self.timeout_s or 0.0)
        seen, complete = 0, False
        refusal: errors.ApiError | None = None

        async def counted() -> Message:
            nonlocal seen, complete, refusal
            if timed and not complete:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    refusal = _too_slow()
                    raise refusal from None
            else:  # a read past the body's end (waiting for a disconnect) has no deadline
                message = await receive()
            complete = complete or message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:  # chunked bodies have no Content-Length to check up front
                refusal = _too_large(self.limit)
                raise refusal
            return message

        async def guarded(message: Message) -> None:
            # FastAPI turns a failed body read into its own 400; answer 413/408 instead.
            if refusal is None:
                await send(message)
            elif message["type"] == "http.response.start":
                await errors.map_exception(refusal)(scope, receive, send)

        await self.app(scope, counted, guarded)


def _too_large(limit: int) -> errors.ApiError:
    # The rest of the body is never read: close rather than wait for it.
    message = f"request bodies are limited to {limit} bytes"
    return errors.ApiError(413, "body_too_large", message, headers={"Connection": "close"})


def _too_slow() -> errors.ApiError:
    return errors.ApiError(408, "body_timeout", "request body not received in time", headers={"Connection": "close"})


def _asset(name: str) -> bytes:
    return resources.files("agentdispatch.gateway").joinpath("dashboard", name).read_bytes()


def create_app(services: Services) -> FastAPI:
    """Build the gateway: jobs API, fleet, metrics, dashboard."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Intake retention runs beside the webhooks that fill it.
        cfg = services.settings
        from ..factory import open_intake_store
        from ..intake.janitor import Scrubber

        istore = open_intake_store(services.store)
        scrubber = Scrubber(istore, every_s=cfg.intake_scrub_every_s, retention_s=cfg.intake_scrub_age_s)
        scrubber.start()
        # Gateways fire periodic schedules too (workers do beside their reconciler).
        firer = Firer(services.dispatcher).start()
        # What start-up built (~100k objects: modules, classes, routes, models)
        # out of every collection while serving: a full collection walked all
        # of it with the GIL held, 30-50 ms (230 ms on a busy machine) during
        # which no webhook was answered. Young collections keep their pace: a
        # request's objects live milliseconds, not a turn's seconds.
        try:
            with heap.serving(rarer_young=False):
                yield
        finally:
            firer.stop()
            scrubber.stop()

    app = FastAPI(
        lifespan=lifespan,
        title="agentdispatch gateway",
        version="1",
        description="Submit, inspect and cancel agent turns; watch the fleet. "
        "Every data route needs `Authorization: Bearer <token>` (a token is bound to one tenant).",
    )
    app.state.services = services
    app.add_middleware(BodyLimit, timeout_s=services.settings.intake_body_timeout_s)
    bearer = HTTPBearer(auto_error=False, description="A token from `agentdispatch token create --tenant T`.")

    async def caller(
        request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None
    ) -> Caller:
        # HTTPBearer only documents the scheme; authenticate() parses the raw header
        # here (no I/O) and defers the token lookup to the route's worker thread.
        return authenticate(services, request.headers.get("authorization"))

    async def authenticated_first(request: Request) -> None:
        # FastAPI validates the body before it resolves dependencies: on a
        # route that takes a caller, authenticate before answering 422.
        route = request.scope.get("route")
        dependant = getattr(route, "dependant", None)
        if dependant is None or not any(d.call is caller for d in dependant.dependencies):
            return
        who = authenticate(services, request.headers.get("authorization"))
        await run_in_threadpool(lambda: who.tenant)

    errors.install(app, authenticated_first)

    app.include_router(api.build_router(services, caller))
    app.include_router(ops.build_router(services, caller))
    app.include_router(schedules_api.build_router(services, caller))
    # Durable intake (another module) plugs in here with one line:
    app.include_router(intake.build_router(services))
    _dashboard(app)
    return app


def _dashboard(app: FastAPI) -> None:
    cache: dict[str, bytes] = {}

    def load(name: str) -> bytes:
        if name not in cache:
            cache[name] = _asset(name)
        return cache[name]

    headers = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> Response:
        return HTMLResponse(load("index.html"), headers=headers)

    @app.get("/dashboard/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in _ASSETS:
            return Response(status_code=404)
        return Response(load(name), media_type=_ASSETS[name], headers=headers)
