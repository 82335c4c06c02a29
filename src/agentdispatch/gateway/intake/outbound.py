"""Replies through the providers' APIs (stdlib HTTP; base URLs per installation,
so tests point them at a local recording server). Never logs URLs or tokens."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .envelope import IntakeEnvelope

TIMEOUT_S = 10.0


class SendFailed(Exception):
    """The provider refused or could not be reached (retryable)."""


def _post(url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            data = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raise SendFailed(f"provider answered HTTP {exc.code}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise SendFailed(f"provider unreachable ({type(exc).__name__})") from None
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        doc = {}
    if isinstance(doc, dict) and doc.get("ok") is False:
        raise SendFailed(f"provider refused: {str(doc.get('error', 'error'))[:80]}")
    return {"status": status}


def send(inst: dict[str, Any], creds: dict[str, Any], env: IntakeEnvelope, text: str, key: str) -> dict[str, Any]:
    """Post ``text`` as a reply to ``env``; ``key`` travels as the idempotency key."""
    base = str(inst["api_base"]).rstrip("/")
    headers = {"Idempotency-Key": key, "Content-Type": "application/json; charset=utf-8"}
    if env.connector == "slack":
        headers["Authorization"] = f"Bearer {creds['bot_token']}"
        payload: dict[str, Any] = {"channel": env.channel, "text": text, "thread_ts": env.thread}
        return {"via": "slack", **_post(f"{base}/chat.postMessage", json.dumps(payload).encode(), headers)}
    if env.connector == "telegram":
        body: dict[str, Any] = {"chat_id": env.channel, "text": text}
        if env.thread.isdigit():
            body["reply_to_message_id"] = int(env.thread)
        url = f"{base}/bot{creds['bot_token']}/sendMessage"
        return {"via": "telegram", **_post(url, json.dumps(body).encode(), headers)}
    if env.kind == "voice":
        return {"via": "twiml"}  # the caller hears it from the status webhook
    account = str(inst["route_key"])
    auth = base64.b64encode(f"{account}:{creds['auth_token']}".encode()).decode()
    headers.update({"Authorization": f"Basic {auth}", "Content-Type": "application/x-www-form-urlencoded"})
    form = urllib.parse.urlencode({"To": env.sender, "From": env.channel, "Body": text}).encode()
    return {"via": "twilio", **_post(f"{base}/2010-04-01/Accounts/{account}/Messages.json", form, headers)}
