"""Telegram bot webhooks: the secret-token header and update normalisation."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from .envelope import IntakeEnvelope, Rejection, json_object

HEADER = "x-telegram-bot-api-secret-token"


def verify(secret_token: str, headers: Mapping[str, str]) -> bool:
    """The shared secret token matches (constant-time compare)."""
    got = headers.get(HEADER, "")
    return bool(secret_token) and hmac.compare_digest(got.encode(), secret_token.encode())


#: The JSON object of an authenticated body, or None when malformed.
parse = json_object


def normalise(doc: Mapping[str, Any], bot_id: str, installation: str, username: str) -> IntakeEnvelope | Rejection:
    """An update as an envelope; the source identity is bot + exact update_id."""
    update_id = doc.get("update_id")
    if not isinstance(update_id, int) or isinstance(update_id, bool):
        return Rejection("malformed", "")
    source = f"{bot_id}:{update_id}"
    edited = "edited_message" in doc
    msg = doc.get("message") or doc.get("edited_message") or doc.get("channel_post")
    if not isinstance(msg, dict):
        return Rejection("unsupported_type", source)
    chat = msg.get("chat") or {}
    if not isinstance(chat, dict) or "id" not in chat:
        return Rejection("malformed", source)
    sender = msg.get("from") or {}
    sender_id = str(sender.get("id", "")) if isinstance(sender, dict) else ""
    text = str(msg.get("text") or msg.get("caption") or "")
    chat_id = str(chat["id"])
    thread = str(msg.get("message_thread_id") or "")
    key = f"{chat_id}:{msg.get('message_id')}" + (f":edit:{update_id}" if edited else "")
    reply_to = msg.get("reply_to_message") or {}
    replied_to_bot = isinstance(reply_to, dict) and str((reply_to.get("from") or {}).get("id", "")) == bot_id
    files = [p.get("file_id") for p in msg.get("photo") or [] if isinstance(p, dict)]
    if isinstance(msg.get("document"), dict):
        files.append(msg["document"].get("file_id"))
    return IntakeEnvelope(
        connector="telegram",
        installation=installation,
        source_id=source,
        conversation=f"{chat_id}:{thread}" if thread else chat_id,
        sender=sender_id,
        text=text,
        channel=chat_id,
        message_key=key,
        kind="edited_message" if edited else "message",
        attachments=tuple(f"telegram-file:{f}" for f in files if f),
        provider_ts=float(msg["date"]) if isinstance(msg.get("date"), int) else None,
        is_dm=chat.get("type") == "private",
        mentions_bot=replied_to_bot or (bool(username) and f"@{username}".lower() in text.lower()),
        self_authored=sender_id == bot_id,
        thread=str(msg.get("message_id", "")),
    )
