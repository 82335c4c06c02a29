"""Twilio SMS and voice webhooks: ``X-Twilio-Signature`` checked by twilio's
``RequestValidator`` over the configured public URL (never the incoming Host
header), normalisation, and TwiML answers built with twilio's TwiML classes."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import parse_qsl, urlsplit

from twilio.request_validator import RequestValidator
from twilio.twiml.voice_response import Gather, VoiceResponse

from .answers import Answer, twiml
from .envelope import IntakeEnvelope, Rejection, json_object, number

HEADER = "x-twilio-signature"


class _Params(dict[str, str]):
    """Form parameters for the validator; a name sent more than once keeps
    every value (the validator signs each)."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__(pairs)
        self._all: dict[str, list[str]] = {}
        for k, v in pairs:
            self._all.setdefault(k, []).append(v)

    def getall(self, name: str) -> list[str]:
        return self._all[name]


def form(body: bytes) -> list[tuple[str, str]] | None:
    """The POST parameters of a form body, or None when it is not one."""
    try:
        return parse_qsl(body.decode(), keep_blank_values=True, strict_parsing=bool(body))
    except (UnicodeDecodeError, ValueError):
        return None


def verify(auth_token: str, url: str, headers: Mapping[str, str], body: bytes) -> bool:
    """Signature over ``url`` (public base + path + query): form bodies add
    their sorted parameters; JSON bodies are pinned by ``bodySHA256`` in the URL."""
    sig = headers.get(HEADER, "")
    if not sig or not auth_token:
        return False
    validator = RequestValidator(auth_token)
    if "bodySHA256" in dict(parse_qsl(urlsplit(url).query, keep_blank_values=True)):
        try:
            return bool(validator.validate(url, body.decode(), sig))
        except UnicodeDecodeError:
            return False
    params = form(body)
    if params is None:
        return False
    return bool(validator.validate(url, _Params(params), sig))


def params_of(body: bytes, url: str) -> dict[str, str] | None:
    """The authenticated parameters (form or JSON body), or None when malformed."""
    if "bodySHA256=" in urlsplit(url).query:
        doc = json_object(body)
        return None if doc is None else {str(k): str(v) for k, v in doc.items()}
    pairs = form(body)
    return None if pairs is None else dict(pairs)


def sms(p: Mapping[str, str], installation: str) -> IntakeEnvelope | Rejection:
    """An inbound SMS; status callbacks are recorded, never triggers."""
    acct, sid = p.get("AccountSid", ""), p.get("MessageSid") or p.get("SmsSid") or ""
    if not acct or not sid:
        return Rejection("malformed", "")
    if "MessageStatus" in p and "Body" not in p:
        return Rejection("status_callback", f"{acct}:{sid}:{p['MessageStatus']}")
    sender = p.get("From", "")
    media = [p[f"MediaUrl{i}"] for i in range(number(p.get("NumMedia"), 0)) if f"MediaUrl{i}" in p]
    return IntakeEnvelope(
        connector="twilio",
        installation=installation,
        source_id=f"{acct}:{sid}",
        conversation=sender,
        sender=sender,
        text=p.get("Body", ""),
        channel=p.get("To", ""),
        message_key=sid,
        kind="sms",
        attachments=tuple(f"twilio-media:{m}" for m in media),
        is_dm=True,
    )


def voice(p: Mapping[str, str], installation: str, step: int) -> IntakeEnvelope | Rejection:
    """One voice step (CallSid + step); the greeting step is recorded only."""
    acct, call = p.get("AccountSid", ""), p.get("CallSid", "")
    if not acct or not call:
        return Rejection("malformed", "")
    source = f"{acct}:{call}:{step}"
    speech = p.get("SpeechResult", "")
    if step == 0 or not speech:
        return Rejection("greeting" if step == 0 else "no_speech", source, conversation=call)
    return IntakeEnvelope(
        connector="twilio",
        installation=installation,
        source_id=source,
        conversation=call,
        sender=p.get("From", ""),
        text=speech,
        channel=p.get("To", ""),
        message_key=f"{call}:{step}",
        kind="voice",
        is_dm=True,
        extra={"step": step},
    )


def gather(base: str, step: int, say: str) -> Answer:
    """Say something and listen for the caller's next words (the next step)."""
    response = VoiceResponse()
    listen = Gather(input="speech", method="POST", action=f"{base}/voice?step={step}")
    listen.say(say)
    response.append(listen)
    return twiml(response)


def hold(base: str, call: str, step: int, poll: int) -> Answer:
    """A short pause, then ask again whether the turn has its reply."""
    response = VoiceResponse()
    response.say("One moment.")
    response.pause(length=2)
    response.redirect(f"{base}/voice/status?step={step}&call={call}&poll={poll}", method="POST")
    return twiml(response)


def apology(say: str = "Sorry, we cannot take your call right now. Please try again later.") -> Answer:
    """Explain and hang up (input that can never be accepted)."""
    response = VoiceResponse()
    response.say(say)
    response.hangup()
    return twiml(response)
