"""Replies through the providers' APIs over real HTTP, against a local fake
provider: Slack by slack_sdk's WebClient, Telegram and Twilio by httpx; a 429
is retried after the wait the provider asks for; errors are SendFailed."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from agentdispatch.intake import outbound
from agentdispatch.intake.envelope import IntakeEnvelope
from agentdispatch.intake.handler import ACKNOWLEDGEMENT, acknowledge
from agentdispatch.intake.processor import Context
from intake.fakeapi import OK, Answer, serve

Script = list[tuple[int, dict[str, str], bytes]]


@dataclass
class Provider:
    """A fake provider API: answers each POST with the next scripted answer
    (then 200 ``{"ok": true}``) and records (path, headers, body)."""

    url: str = ""
    script: Script = field(default_factory=list)
    calls: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture()
def provider() -> Iterator[Provider]:
    p = Provider()

    def answer(path: str, headers: dict[str, str], raw: bytes) -> Answer:
        with p.lock:
            p.calls.append((path, headers, raw))
            status, extra, out = p.script.pop(0) if p.script else OK
        return status, {"Content-Type": "application/json", **extra}, out

    with serve(answer) as p.url:
        yield p


def _env(connector: str, **kw: Any) -> IntakeEnvelope:
    base: dict[str, Any] = {
        "connector": connector, "installation": "inst-1", "source_id": "s", "conversation": "c",
        "sender": "+15559999", "text": "my card is 4111", "channel": "C1", "thread": "42",
    }  # fmt: skip
    return IntakeEnvelope(**{**base, **kw})


def _inst(provider: Provider, route_key: str = "AC0001") -> dict[str, Any]:
    return {"api_base": provider.url, "route_key": route_key}


def test_slack_web_client_retries_a_rate_limited_post(provider: Provider) -> None:
    provider.script = [(429, {"Retry-After": "0"}, b'{"ok": false, "error": "ratelimited"}')]
    out = outbound.send(_inst(provider), {"bot_token": "xoxb-1"}, _env("slack"), "hello", "key-1")
    assert out == {"via": "slack", "status": 200}
    assert len(provider.calls) == 2  # the 429, then the retry
    path, headers, body = provider.calls[-1]
    assert path == "/chat.postMessage"
    assert headers["authorization"] == "Bearer xoxb-1" and headers["idempotency-key"] == "key-1"
    assert json.loads(body) == {"channel": "C1", "text": "hello", "thread_ts": "42"}


def test_slack_refusal_is_send_failed(provider: Provider) -> None:
    provider.script = [(200, {}, b'{"ok": false, "error": "channel_not_found"}')]
    with pytest.raises(outbound.SendFailed, match="channel_not_found"):
        outbound.send(_inst(provider), {"bot_token": "xoxb-1"}, _env("slack"), "hello", "key-1")


def test_telegram_waits_as_long_as_asked_then_sends(provider: Provider) -> None:
    # The Bot API says how long in its body (parameters.retry_after), the header may be absent.
    provider.script = [(429, {}, b'{"ok": false, "error_code": 429, "parameters": {"retry_after": 3}}')]
    waits: list[float] = []
    url = f"{provider.url}/bot7001:tok/sendMessage"
    out = outbound.post(url, headers={"Idempotency-Key": "k"}, json={"chat_id": "1", "text": "x"}, sleep=waits.append)
    assert out == {"status": 200} and waits == [3.0] and len(provider.calls) == 2


def test_telegram_send_over_real_http(provider: Provider) -> None:
    provider.script = [(429, {"Retry-After": "0"}, b'{"ok": false, "error_code": 429}')]
    out = outbound.send(_inst(provider), {"bot_token": "7001:tok"}, _env("telegram"), "hello", "key-2")
    assert out == {"via": "telegram", "status": 200}
    path, headers, body = provider.calls[-1]
    assert path == "/bot7001:tok/sendMessage" and headers["idempotency-key"] == "key-2"
    assert json.loads(body) == {"chat_id": "C1", "text": "hello", "reply_to_message_id": 42}


def test_a_long_rate_limit_fails_the_send_instead_of_waiting(provider: Provider) -> None:
    provider.script = [(429, {"Retry-After": "120"}, b"{}")]
    waits: list[float] = []
    with pytest.raises(outbound.SendFailed, match="rate-limited"):
        outbound.post(f"{provider.url}/x", headers={}, json={}, sleep=waits.append)
    assert waits == [] and len(provider.calls) == 1


def test_persistent_rate_limit_and_errors_are_send_failed(provider: Provider) -> None:
    provider.script = [(429, {"Retry-After": "0"}, b"{}")] * 3
    with pytest.raises(outbound.SendFailed, match="HTTP 429"):
        outbound.post(f"{provider.url}/x", headers={}, json={}, sleep=lambda _s: None)
    assert len(provider.calls) == 1 + outbound.RATE_LIMIT_RETRIES
    provider.script = [(400, {}, b'{"ok": false, "description": "Bad Request: chat not found"}')]
    with pytest.raises(outbound.SendFailed, match="HTTP 400"):
        outbound.post(f"{provider.url}/x", headers={}, json={})
    with pytest.raises(outbound.SendFailed, match="unreachable"):
        outbound.post("http://127.0.0.1:9/x", headers={}, json={})


def test_twilio_sms_posts_the_form_with_basic_auth(provider: Provider) -> None:
    env = _env("twilio", kind="sms", channel="+15550001")
    out = outbound.send(_inst(provider), {"auth_token": "tw-token"}, env, "hello", "key-3")
    assert out == {"via": "twilio", "status": 200}
    path, headers, body = provider.calls[-1]
    assert path == "/2010-04-01/Accounts/AC0001/Messages.json"
    assert headers["authorization"] == "Basic " + base64.b64encode(b"AC0001:tw-token").decode()
    assert body == b"To=%2B15559999&From=%2B15550001&Body=hello"


def test_the_built_in_responder_never_echoes_the_customer() -> None:
    env = _env("slack", text="my card is 4111 1111 1111 1111")
    reply = acknowledge(Context(envelope=env, agent="helper", steered=[_env("slack", text="and my PIN 1234")]))
    assert reply == ACKNOWLEDGEMENT
    assert "4111" not in reply and "1234" not in reply
