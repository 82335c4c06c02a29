"""``build_router(services)``: the Slack, Telegram and Twilio webhooks.

Request path, in order: read the body (1 MiB cap, read deadline), authenticate
the raw bytes, resolve the installation from authenticated identifiers only,
normalise, then one durable transaction (receipt + WorkItem), and only then
answer. Everything else happens in the worker (:mod:`.handler`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from ..factory import open_intake_store
from ..intake import slack, telegram, twilio
from ..intake.admin import MAX_MESSAGES, messages
from ..intake.admit import Abandoned, BacklogFull, Incoming, admit, answer_of, refused
from ..intake.answers import Answer, ok, twiml
from ..intake.base import IntakeStore
from ..intake.body import BodyRejected, read_capped
from ..intake.credentials import CredentialError, open_credentials
from ..intake.envelope import Rejection, number
from .auth import authenticate
from .errors import RETRY_AFTER_S, ApiError, error_body, is_outage
from .services import Services

log = logging.getLogger(__name__)
T = TypeVar("T")
#: Seconds an installation lookup is reused by the request path.
CACHE_S = 2.0
#: Threads for the request path's store calls. Each is one short transaction
#: (commits are shared: group commit on SQLite and on PostgreSQL), so a few
#: threads keep the store busy; more only take the GIL from the event loop
#: that parses requests and sends the answers. An intake store may ask for
#: more (``request_threads``; both database stores do): a thread waiting for
#: its group's commit holds no CPU, and a group holds no more deliveries than
#: there are threads.
STORE_THREADS = 8
#: Where the webhooks live (they read their bodies under their own deadline).
PREFIX = "/intake/"


class Unavailable(Exception):
    """The store failed or was too slow, or the agent's backlog is full: answer
    503 so the provider retries."""

    def __init__(self, reason: str = "unavailable") -> None:
        super().__init__(reason)
        self.reason = reason


def _send(answer: Answer) -> Response:
    return Response(answer.body, status_code=answer.status, media_type=answer.media_type, headers=answer.headers)


#: Error codes of the refusals, by HTTP status.
_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 408: "timeout", 413: "too_large"}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """A refusal in the gateway's one error shape (JSON, with its content type)."""
    return JSONResponse(error_body(_CODES.get(status, "error"), message), status_code=status, headers=headers)


class Intake:
    """The request-path steps shared by the three connectors."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.istore: IntakeStore = open_intake_store(services.store)
        # Store calls leave the event loop; a slow one is abandoned, not awaited.
        threads = int(getattr(self.istore, "request_threads", STORE_THREADS))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="intake")
        self._insts: dict[tuple[str, str], tuple[float, list[dict[str, Any]]]] = {}
        self._inst_reads: dict[tuple[str, str], asyncio.Future[list[dict[str, Any]]]] = {}
        self._secrets: dict[tuple[str, str], dict[str, Any]] = {}

    def secrets(self, inst: dict[str, Any]) -> dict[str, Any]:
        cached = self._secrets.get((inst["id"], inst["credentials"]))
        if cached is None:
            key = self.services.settings.intake_key
            cached = open_credentials(key.get_secret_value() if key else None, inst["id"], inst["credentials"])
            if len(self._secrets) > 10_000:
                self._secrets.clear()
            self._secrets[(inst["id"], inst["credentials"])] = cached
        return cached

    async def db(self, fn: Callable[[threading.Event], T]) -> T:
        """Run ``fn`` in the pool; past the commit timeout answer 503 and tell
        ``fn`` (through the event) to roll back instead of committing late."""
        abandoned = threading.Event()
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, abandoned)
        try:
            async with asyncio.timeout(self.services.settings.intake_commit_timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            abandoned.set()
            fut.add_done_callback(lambda f: f.exception())  # consumed: no "never retrieved" noise
            log.warning("intake store slower than the commit timeout: answered 503")
            raise Unavailable() from None
        except Abandoned:
            log.warning("intake transaction finished after its 503: rolled back")
            raise Unavailable() from None
        except Exception as exc:
            if is_outage(exc) or type(exc).__name__ == "QueueFull":
                log.warning("intake store unavailable (%s: %s): answered 503", type(exc).__name__, exc)
                raise Unavailable() from None
            raise

    async def installations(self, connector: str, route_key: str) -> list[dict[str, Any]]:
        # Cached briefly: a rotated secret or a new installation counts within CACHE_S.
        key = (connector, route_key)
        hit = self._insts.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        # One read per key at a time: when the entry expires under load, the
        # requests of that moment share it instead of each taking a thread.
        read = self._inst_reads.get(key)
        if read is None:
            read = self._inst_reads[key] = asyncio.ensure_future(self._read_installations(key))
            read.add_done_callback(lambda f: self._read_done(key, f))
        return await asyncio.shield(read)

    def _read_done(self, key: tuple[str, str], read: asyncio.Future[list[dict[str, Any]]]) -> None:
        self._inst_reads.pop(key, None)
        if not read.cancelled():
            read.exception()  # retrieved: no "never retrieved" noise when every waiter left

    async def _read_installations(self, key: tuple[str, str]) -> list[dict[str, Any]]:
        connector, route_key = key
        rows = await self.db(lambda _: self.istore.installations(connector, route_key))
        if len(self._insts) > 10_000:
            self._insts.clear()
        self._insts[key] = (time.monotonic() + CACHE_S, rows)
        return rows

    async def record(self, inc: Incoming) -> Answer:
        s = self.services.settings
        deadline = time.monotonic() + s.intake_commit_timeout_s
        try:
            return await self.db(
                lambda abandoned: admit(
                    self.istore, self.services.dispatcher, inc, abandoned=abandoned, deadline=deadline
                )
            )
        except BacklogFull:
            self.services.metrics.intake_backlog_full.labels(connector=inc.connector).inc()
            log.warning("intake: an agent's backlog is full: answered 503 (backlog_full)")
            raise Unavailable("backlog_full") from None

    async def body(self, request: Request) -> bytes:
        return await read_capped(request, timeout_s=self.services.settings.intake_body_timeout_s)


def _body_refused(exc: BodyRejected, headers: dict[str, str] | None = None) -> Response:
    """A refused body (too large, too slow, gone). The rest of it is never read:
    close the connection rather than wait for it, or a sender trickling it
    would hold the connection for as long as it liked."""
    return _error(exc.status, str(exc), {**(headers or {}), "Connection": "close"})


def declared_too_large(path: str) -> Response:
    """The answer to a webhook whose declared body is past even the gateway's
    limit (refused before its route reads it): its provider's own refusal."""
    no_retry = {"X-Slack-No-Retry": "1"} if path.startswith(f"{PREFIX}slack/") else None
    return _body_refused(BodyRejected(413, "body larger than 1 MiB"), no_retry)


def _unavailable(answer: Answer | None = None, reason: str = "unavailable") -> Response:
    if answer is not None:
        return _send(answer)
    return JSONResponse(
        error_body(reason, f"{reason}, retry later"), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def _digest_source(prefix: str, body: bytes) -> str:
    return f"{prefix}:malformed:{hashlib.sha256(body).hexdigest()[:32]}"


def build_router(services: Services) -> APIRouter:
    """The intake webhooks (provider-authenticated; no bearer tokens)."""
    router = APIRouter(prefix=PREFIX.rstrip("/"), tags=["intake"])
    intake = Intake(services)

    @router.post("/slack/{app_id}", include_in_schema=False)
    async def slack_events(app_id: str, request: Request) -> Response:
        no_retry = {"X-Slack-No-Retry": "1"}
        try:
            body = await intake.body(request)
            insts = await intake.installations("slack", app_id)
        except BodyRejected as exc:
            return _body_refused(exc, no_retry)
        except Unavailable:
            return _unavailable()
        now = time.time()

        def signed(inst: dict[str, Any]) -> Callable[[], bool]:
            return lambda: slack.verify(intake.secrets(inst)["signing_secret"], request.headers, body, now)

        verified = [i for i in insts if _try(signed(i))]
        if not verified:
            return _error(401, "invalid Slack signature or timestamp")
        doc = slack.parse(body)
        if doc is not None and doc.get("type") == "url_verification":
            return JSONResponse({"challenge": str(doc.get("challenge", ""))})
        retry = number(request.headers.get("x-slack-retry-num"), 0)
        reason_hdr = request.headers.get("x-slack-retry-reason")
        rejected = Answer(200, headers=no_retry)
        inc: Incoming
        if doc is None:
            inc = Incoming("slack", _digest_source(app_id, body), body, rejected, state="rejected", reason="malformed")
        else:
            team = slack.team_of(doc)
            inst = next((i for i in verified if i["external_id"] == f"{app_id}:{team}"), None)
            if str(doc.get("api_app_id", "")) != app_id or inst is None:
                event_id = str(doc.get("event_id", "")) or hashlib.sha256(body).hexdigest()[:32]
                source = f"{doc.get('api_app_id', '')}:{team}:{event_id}"
                inc = Incoming("slack", source, body, rejected, state="rejected", reason="unknown_installation")
            else:
                bots = frozenset(b for b in str(inst["bot_user_id"]).split(",") if b)
                got = slack.normalise(doc, inst["id"], bots)
                inc = _incoming("slack", got, body, ok(), rejected, inst, app_id)
        inc = Incoming(**{**inc.__dict__, "retry_num": retry, "retry_reason": reason_hdr})
        try:
            return _send(await intake.record(inc))
        except Unavailable as exc:
            return _unavailable(reason=exc.reason)

    @router.post("/telegram/{bot_id}", include_in_schema=False)
    async def telegram_update(bot_id: str, request: Request) -> Response:
        try:
            body = await intake.body(request)
            insts = [i for i in await intake.installations("telegram", bot_id) if i["external_id"] == bot_id]
        except BodyRejected as exc:
            return _body_refused(exc)
        except Unavailable:
            return _unavailable()
        inst = insts[0] if insts else None
        if inst is None or not _try(lambda: telegram.verify(intake.secrets(inst)["secret_token"], request.headers)):
            return _error(401, "invalid Telegram secret token")
        doc = telegram.parse(body)
        if doc is None:
            inc = Incoming(
                "telegram", _digest_source(bot_id, body), body, ok(), inst, state="rejected", reason="malformed"
            )
        else:
            got = telegram.normalise(doc, bot_id, inst["id"], str(inst["bot_user_id"]))
            inc = _incoming("telegram", got, body, ok(), ok(), inst, bot_id)
        try:
            return _send(await intake.record(inc))
        except Unavailable as exc:
            return _unavailable(reason=exc.reason)

    async def twilio_auth(account: str, request: Request) -> tuple[bytes, dict[str, Any], dict[str, str]] | Response:
        try:
            body = await intake.body(request)
            insts = await intake.installations("twilio", account)
        except BodyRejected as exc:
            return _body_refused(exc)
        except Unavailable:
            return _unavailable()
        query = request.url.query
        for inst in insts:
            url = str(inst["public_url"]).rstrip("/") + request.url.path + (f"?{query}" if query else "")
            if _try(lambda: twilio.verify(intake.secrets(inst)["auth_token"], url, request.headers, body)):  # noqa: B023
                params = twilio.params_of(body, url)
                if params is None or params.get("AccountSid") != account:
                    return _error(400, "malformed Twilio parameters")
                match = next((i for i in insts if i["external_id"] == f"{account}:{params.get('To', '')}"), inst)
                return body, match, params
        return _error(403, "invalid Twilio signature")

    @router.post("/twilio/{account}/sms", include_in_schema=False)
    async def twilio_sms(account: str, request: Request) -> Response:
        got = await twilio_auth(account, request)
        if isinstance(got, Response):
            return got
        body, inst, params = got
        inc = _incoming("twilio", twilio.sms(params, inst["id"]), body, twiml(), twiml(), inst, account)
        try:
            return _send(await intake.record(inc))
        except Unavailable as exc:
            return _unavailable(reason=exc.reason)

    @router.post("/twilio/{account}/voice", include_in_schema=False)
    async def twilio_voice(account: str, request: Request) -> Response:
        got = await twilio_auth(account, request)
        if isinstance(got, Response):
            return got
        body, inst, params = got
        step = number(request.query_params.get("step"), 0)
        base = f"{str(inst['public_url']).rstrip('/')}/intake/twilio/{account}"
        call = params.get("CallSid", "")
        norm = twilio.voice(params, inst["id"], step)
        if isinstance(norm, Rejection) and norm.reason in ("greeting", "no_speech"):
            say = "Hello, how can I help?" if step == 0 else "Sorry, I did not catch that."
            inc = Incoming("twilio", norm.source_id, body, twilio.gather(base, step + 1, say), inst,
                           state="recorded", reason=norm.reason, conversation=call)  # fmt: skip
        else:
            inc = _incoming("twilio", norm, body, twilio.hold(base, call, step, 1), twilio.apology(), inst, account)
        try:
            return _send(await intake.record(inc))
        except Unavailable:
            return _unavailable(twilio.apology("Sorry, please call again in a minute."))

    @router.post("/twilio/{account}/voice/status", include_in_schema=False)
    async def twilio_voice_status(account: str, request: Request) -> Response:
        got = await twilio_auth(account, request)
        if isinstance(got, Response):
            return got
        _body, inst, _params = got
        q = request.query_params
        step, poll, call = number(q.get("step"), 1), number(q.get("poll"), 1), q.get("call", "")
        base = f"{str(inst['public_url']).rstrip('/')}/intake/twilio/{account}"
        try:
            row = await intake.db(lambda _: intake.istore.receipt_by_source("twilio", f"{account}:{call}:{step}"))
        except Unavailable:
            return _unavailable(twilio.apology("Sorry, please call again in a minute."))
        if row is None or refused(row):  # a step refused for a full backlog: as if never heard
            return _send(twilio.apology())
        if row["state"] == "rejected":
            return _send(answer_of(row))
        if row["reply"]:
            return _send(twilio.gather(base, step + 1, str(row["reply"])))
        if row["finished_at"] is not None or poll >= 10:
            return _send(twilio.apology("Sorry, I have no answer for that."))
        return _send(twilio.hold(base, call, step, poll + 1))

    @router.get(
        "/conversations/{installation_id}/{conversation}/messages",
        summary="A conversation's captured messages, oldest first (the caller's tenant only)",
    )
    def conversation_messages(
        installation_id: str, conversation: str, request: Request, limit: int = Query(100, ge=1, le=MAX_MESSAGES)
    ) -> dict[str, Any]:
        tenant = authenticate(services, request.headers.get("authorization")).tenant
        rows = messages(intake.istore, installation_id, conversation, tenant=tenant, limit=limit)
        if rows is None:  # another tenant's installation answers exactly like a missing one
            raise ApiError(404, "not_found", f"Conversation {conversation} of {installation_id} not found")
        return {"installation_id": installation_id, "conversation": conversation, "messages": rows}

    return router


def _incoming(
    connector: str,
    got: Any,
    body: bytes,
    accepted: Answer,
    rejected: Answer,
    inst: dict[str, Any],
    prefix: str,
) -> Incoming:
    if isinstance(got, Rejection):
        source = got.source_id or _digest_source(prefix, body)
        state = "recorded" if got.reason == "status_callback" else "rejected"
        return Incoming(connector, source, body, rejected, inst, state=state, reason=got.reason)
    return Incoming(connector, got.source_id, body, accepted, inst, envelope=got)


def _try(check: Callable[[], bool]) -> bool:
    """A verification that cannot open its credentials is a failed one."""
    try:
        return check()
    except (CredentialError, KeyError):
        log.warning("intake: an installation's credentials cannot be opened")
        return False
