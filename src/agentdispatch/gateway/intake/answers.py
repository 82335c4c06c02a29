"""What the request path answers: a status, a media type and a body, stored
with the receipt so a duplicate answers exactly like the original."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Answer:
    """One HTTP answer to a provider."""

    status: int
    media_type: str = "text/plain"
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)


EMPTY_TWIML = '<?xml version="1.0" encoding="UTF-8"?><Response/>'


def ok() -> Answer:
    """200, empty body (Slack, Telegram)."""
    return Answer(200)


def twiml(body: str = "") -> Answer:
    """200 with TwiML (Twilio expects a TwiML document in the answer)."""
    if not body:
        return Answer(200, "text/xml", EMPTY_TWIML)
    return Answer(200, "text/xml", f'<?xml version="1.0" encoding="UTF-8"?><Response>{body}</Response>')
