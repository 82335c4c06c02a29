"""Slack Events API: signatures checked by slack_sdk's ``SignatureVerifier``
(v0 HMAC-SHA256, 300 s window, constant-time compare) and normalisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slack_sdk.signature import Clock, SignatureVerifier

from .envelope import IntakeEnvelope, Rejection, json_object

SUPPORTED = frozenset({"message", "app_mention"})
#: Message subtypes that carry a user's words (others: joins, topic changes...).
MESSAGE_SUBTYPES = frozenset({None, "bot_message", "message_changed", "file_share", "thread_broadcast", "me_message"})


class _At(Clock):
    """The verifier's clock, fixed at the request's arrival."""

    def __init__(self, now: float) -> None:
        self._now = now

    def now(self) -> float:
        return self._now


def verify(secret: str, headers: Mapping[str, str], body: bytes, now: float) -> bool:
    """Signature valid and timestamp within 300 s of ``now`` (slack_sdk checks both)."""
    if not secret:
        return False
    verifier = SignatureVerifier(secret, clock=_At(now))
    try:
        return verifier.is_valid(body, headers.get("x-slack-request-timestamp"), headers.get("x-slack-signature"))
    except (ValueError, TypeError):
        # The SDK raises on a non-numeric timestamp, a body that is not UTF-8 or
        # a non-ASCII signature; none of them comes from Slack, so: not valid.
        return False


#: The JSON object of an authenticated body, or None when malformed.
parse = json_object


def team_of(doc: Mapping[str, Any]) -> str:
    """The workspace (or enterprise) that the authenticated event belongs to."""
    team = doc.get("team_id") or doc.get("enterprise_id")
    if not team:
        auths = doc.get("authorizations") or [{}]
        team = (auths[0] or {}).get("team_id") or (auths[0] or {}).get("enterprise_id")
    return str(team or "")


def normalise(doc: Mapping[str, Any], installation: str, bot_ids: frozenset[str]) -> IntakeEnvelope | Rejection:
    """An ``event_callback`` as an envelope, or why it can never be accepted."""
    app, team, event_id = str(doc.get("api_app_id", "")), team_of(doc), doc.get("event_id")
    event = doc.get("event")
    if not isinstance(event_id, str) or not event_id or not isinstance(event, dict):
        return Rejection("malformed", "")
    source = f"{app}:{team}:{event_id}"
    if doc.get("type") != "event_callback" or event.get("type") not in SUPPORTED:
        return Rejection("unsupported_type", source)
    if event.get("type") == "message" and event.get("subtype") not in MESSAGE_SUBTYPES:
        return Rejection("unsupported_type", source)
    channel = str(event.get("channel", ""))
    inner = event.get("message") if event.get("subtype") == "message_changed" else event
    if not isinstance(inner, dict) or not channel:
        return Rejection("malformed", source)
    ts = str(inner.get("ts") or event.get("ts") or "")
    user = str(inner.get("user") or inner.get("bot_id") or "")
    text = str(inner.get("text") or "")
    thread_ts = str(inner.get("thread_ts") or "")
    key = f"{channel}:{ts}"
    if event.get("subtype") == "message_changed":
        key += f":edit:{event.get('event_ts', event_id)}"
    self_authored = bool(bot_ids) and (user in bot_ids or str(inner.get("bot_id") or "") in bot_ids)
    mentions = event.get("type") == "app_mention" or any(f"<@{b}>" in text for b in bot_ids)
    files = inner.get("files") or []
    return IntakeEnvelope(
        connector="slack",
        installation=installation,
        source_id=source,
        conversation=f"{channel}:{thread_ts}" if thread_ts else channel,
        sender=user,
        text=text,
        channel=channel,
        message_key=key,
        kind=str(event.get("type")),
        attachments=tuple(f"slack-file:{f.get('id')}" for f in files if isinstance(f, dict)),
        provider_ts=float(doc["event_time"]) if isinstance(doc.get("event_time"), int | float) else None,
        is_dm=event.get("channel_type") == "im",
        mentions_bot=mentions,
        self_authored=self_authored,
        thread=thread_ts or ts,
    )
