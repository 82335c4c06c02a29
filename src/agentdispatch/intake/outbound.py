"""Replies through the providers' APIs: Slack by slack_sdk's ``WebClient``
(its rate-limit retry handler honours ``Retry-After``), Telegram's Bot API and
Twilio's Messages API by httpx with the same 429 handling. Base URLs are per
installation, so tests point them at a local fake provider. Never logs URLs or
tokens (a Telegram bot token is part of its URL path)."""

from __future__ import annotations

import email.utils
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

from .envelope import IntakeEnvelope

TIMEOUT_S = 10.0
#: Rate-limited answers retried per send (after the wait the provider asks for).
RATE_LIMIT_RETRIES = 2
#: A provider asking for a longer wait fails the send instead: the turn is
#: retried by the queue, rather than holding a worker thread and its lease.
MAX_WAIT_S = 30.0


class SendFailed(Exception):
    """The provider refused or could not be reached (retryable)."""


class _RedactBotToken(logging.Filter):
    """httpx logs each request's URL at INFO; a Telegram URL holds the bot token."""

    _TOKEN = re.compile(r"/bot[^/\s]+/")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "/bot" in text:
            record.msg, record.args = self._TOKEN.sub("/bot<redacted>/", text), ()
        return True


logging.getLogger("httpx").addFilter(_RedactBotToken())


def retry_after(resp: httpx.Response) -> float:
    """Seconds a 429 asks us to wait: ``Retry-After`` (seconds or an HTTP
    date), else Telegram's ``parameters.retry_after``, else 1."""
    value = resp.headers.get("retry-after", "").strip()
    if value.isdigit():
        return float(value)
    if value:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            pass  # neither form: look in the body
    try:
        doc = resp.json()
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("parameters"), dict):
        wait = doc["parameters"].get("retry_after")
        if isinstance(wait, int | float) and not isinstance(wait, bool):
            return float(wait)
    return 1.0


def post(
    url: str,
    *,
    headers: dict[str, str],
    json: dict[str, Any] | None = None,
    data: dict[str, str] | None = None,
    auth: tuple[str, str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """POST with 429/Retry-After handling; raises :class:`SendFailed`."""
    with httpx.Client(timeout=TIMEOUT_S, auth=auth) as client:
        for attempt in range(RATE_LIMIT_RETRIES + 1):
            try:
                resp = client.post(url, headers=headers, json=json, data=data)
            except httpx.HTTPError as exc:
                raise SendFailed(f"provider unreachable ({type(exc).__name__})") from None
            if resp.status_code != 429 or attempt == RATE_LIMIT_RETRIES:
                break
            wait = retry_after(resp)
            if wait > MAX_WAIT_S:
                raise SendFailed(f"provider rate-limited us for {wait:.0f} s")
            sleep(wait)
    if resp.status_code >= 400:
        raise SendFailed(f"provider answered HTTP {resp.status_code}")
    try:
        doc = resp.json() if resp.content else {}
    except ValueError:
        doc = {}
    if isinstance(doc, dict) and doc.get("ok") is False:
        raise SendFailed(f"provider refused: {str(doc.get('description') or doc.get('error') or 'error')[:80]}")
    return {"status": resp.status_code}


def slack_client(base: str, token: str, key: str) -> WebClient:
    """A WebClient that retries rate-limited calls after their ``Retry-After``."""
    client = WebClient(token=token, base_url=base + "/", timeout=int(TIMEOUT_S), headers={"Idempotency-Key": key})
    client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=RATE_LIMIT_RETRIES))
    return client


def send(inst: dict[str, Any], creds: dict[str, Any], env: IntakeEnvelope, text: str, key: str) -> dict[str, Any]:
    """Post ``text`` as a reply to ``env``; ``key`` travels as the idempotency key."""
    base = str(inst["api_base"]).rstrip("/")
    headers = {"Idempotency-Key": key}
    if env.connector == "slack":
        client = slack_client(base, str(creds["bot_token"]), key)
        try:
            resp = client.chat_postMessage(channel=env.channel, text=text, thread_ts=env.thread or None)
        except SlackApiError as exc:
            error = exc.response.get("error", "error") if exc.response is not None else "error"
            raise SendFailed(f"provider refused: {str(error)[:80]}") from None
        except (SlackClientError, OSError) as exc:
            raise SendFailed(f"provider unreachable ({type(exc).__name__})") from None
        return {"via": "slack", "status": resp.status_code}
    if env.connector == "telegram":
        body: dict[str, Any] = {"chat_id": env.channel, "text": text}
        if env.thread.isdigit():
            body["reply_to_message_id"] = int(env.thread)
        url = f"{base}/bot{creds['bot_token']}/sendMessage"
        return {"via": "telegram", **post(url, headers=headers, json=body)}
    if env.kind == "voice":
        return {"via": "twiml"}  # the caller hears it from the status webhook
    account = str(inst["route_key"])
    form = {"To": env.sender, "From": env.channel, "Body": text}
    url = f"{base}/2010-04-01/Accounts/{account}/Messages.json"
    return {"via": "twilio", **post(url, headers=headers, data=form, auth=(account, str(creds["auth_token"])))}
