"""The versioned, normalised intake envelope every connector produces."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

VERSION = 1


#: What a NUL character in provider text becomes (the replacement character).
NUL_STANDS_IN = "\ufffd"


def _scrub(value: Any) -> Any:
    """``value`` with every NUL character in its strings replaced."""
    if isinstance(value, str):
        return value.replace("\x00", NUL_STANDS_IN)
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_scrub(v) for v in value)
    return value


@dataclass(frozen=True)
class IntakeEnvelope:
    """One inbound provider event, normalised (references, never media bytes)."""

    connector: str
    installation: str
    source_id: str
    conversation: str
    sender: str
    text: str
    channel: str = ""
    message_key: str = ""
    kind: str = "message"
    attachments: tuple[str, ...] = ()
    provider_ts: float | None = None
    received_at: float = 0.0
    is_dm: bool = False
    mentions_bot: bool = False
    self_authored: bool = False
    thread: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def __post_init__(self) -> None:
        # PostgreSQL text cannot hold NUL: a provider message with one would be
        # refused on every retry and stall its conversation's webhooks.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str | dict | tuple) and (clean := _scrub(value)) != value:
                object.__setattr__(self, f.name, clean)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys)."""
        data = asdict(self)
        data["attachments"] = list(self.attachments)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> IntakeEnvelope:
        """Parse an envelope written by :meth:`to_json` (any known version)."""
        data = json.loads(text)
        if int(data.get("version", 0)) != VERSION:
            raise ValueError(f"unknown intake envelope version {data.get('version')!r}")
        data["attachments"] = tuple(data.get("attachments") or ())
        return cls(**data)

    def with_receipt_time(self, received_at: float) -> IntakeEnvelope:
        """The same envelope stamped with the database receipt time."""
        data = asdict(self)
        data["attachments"] = self.attachments
        data["received_at"] = received_at
        return IntakeEnvelope(**data)


@dataclass(frozen=True)
class Rejection:
    """Authenticated input that can never be accepted (stored, answered 200)."""

    reason: str
    source_id: str
    conversation: str = ""


def json_object(body: bytes) -> dict[str, Any] | None:
    """The JSON object of an authenticated body, or None when malformed (not
    JSON, not an object, or nested too deeply to read)."""
    try:
        doc = json.loads(body)
        if _HALF_PAIR.search(body):
            # A lone surrogate is a valid JSON escape but not text: PostgreSQL
            # refuses it, and a 503 would have the provider resend it for good.
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return doc if isinstance(doc, dict) else None


#: A surrogate escape in a JSON body (paired ones, such as emoji, pass the check).
_HALF_PAIR = re.compile(rb"\\u[dD][89a-fA-F]")


def number(text: str | None, default: int) -> int:
    """A small count from a header, query or form field (retry number, step,
    media count); anything else is ``default``, never an error."""
    return int(text) if text and text.isascii() and text.isdigit() and len(text) <= 6 else default
