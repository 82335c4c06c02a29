"""What the request path answers: a status, a media type and a body, stored
with the receipt so a duplicate answers exactly like the original."""

from __future__ import annotations

from dataclasses import dataclass, field

from twilio.twiml import TwiML
from twilio.twiml.messaging_response import MessagingResponse


@dataclass(frozen=True)
class Answer:
    """One HTTP answer to a provider."""

    status: int
    media_type: str = "text/plain"
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)


#: An empty TwiML document (SMS: nothing to say now; the reply goes by the API).
EMPTY_TWIML = str(MessagingResponse())


def ok() -> Answer:
    """200, empty body (Slack, Telegram)."""
    return Answer(200)


def twiml(document: TwiML | None = None) -> Answer:
    """200 with TwiML (Twilio expects a TwiML document in the answer)."""
    return Answer(200, "text/xml", EMPTY_TWIML if document is None else str(document))
