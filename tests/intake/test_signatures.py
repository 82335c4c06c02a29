"""Signature vectors per provider, on the verify functions: signatures made by
the providers' SDKs and their documented examples."""

from __future__ import annotations

import hashlib
import json

from slack_sdk.signature import SignatureVerifier

from agentdispatch.intake import slack, telegram, twilio
from intake.kit import slack_sign, twilio_sign

BODY = b'{"type":"event_callback","event_id":"Ev1"}'
NOW = 1_700_000_000.0


def _slack(body: bytes, *, secret: str = "s3cret", at: float = NOW) -> dict[str, str]:
    ts = str(int(at))
    return {"x-slack-request-timestamp": ts, "x-slack-signature": slack_sign(secret, ts, body)}


def test_slack_vectors() -> None:
    # Slack's documented example signature, checked as of its own timestamp.
    ts, body = (
        "1531420618",
        (
            b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V"
            b"&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text="
            b"&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
            b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
        ),
    )
    expected = "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"
    documented = {"x-slack-request-timestamp": ts, "x-slack-signature": expected}
    assert slack.verify("8f742231b10e8888abcd99yyyzzz85a5", documented, body, float(ts))
    assert not slack.verify("8f742231b10e8888abcd99yyyzzz85a5", documented, body, float(ts) + 301)
    assert slack.verify("s3cret", _slack(BODY), BODY, NOW)
    flipped = BODY[:-2] + b"X" + BODY[-1:]
    assert not slack.verify("s3cret", _slack(BODY), flipped, NOW)
    assert not slack.verify("s3cret", _slack(BODY, secret="wrong"), BODY, NOW)
    assert not slack.verify("s3cret", _slack(BODY, at=NOW - 301), BODY, NOW)
    assert not slack.verify("s3cret", _slack(BODY, at=NOW + 301), BODY, NOW)
    assert slack.verify("s3cret", _slack(BODY, at=NOW - 299), BODY, NOW)
    assert not slack.verify("s3cret", {}, BODY, NOW)
    assert not slack.verify("", _slack(BODY), BODY, NOW)  # an empty secret verifies nothing
    # The test helper signs as the SDK does.
    assert slack_sign("s", "1", b"x") == SignatureVerifier("s").generate_signature(timestamp="1", body=b"x")


def test_telegram_vectors() -> None:
    assert telegram.verify("tok_EN-1", {telegram.HEADER: "tok_EN-1"})
    assert not telegram.verify("tok_EN-1", {telegram.HEADER: "tok_EN-2"})
    assert not telegram.verify("tok_EN-1", {})
    assert not telegram.verify("", {telegram.HEADER: ""})


def test_twilio_vectors() -> None:
    # The example of Twilio's webhook security page (and of twilio-python's
    # tests): token 12345, this URL and these parameters sign to this value.
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = [("CallSid", "CA1234567890ABCDE"), ("Caller", "+12349013030"), ("Digits", "1234"),
              ("From", "+12349013030"), ("To", "+18005551212")]  # fmt: skip
    documented = "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
    body = "&".join(f"{k}={v}" for k, v in params).replace("+", "%2B").encode()
    assert twilio.verify("12345", url, {twilio.HEADER: documented}, body)  # with a query string
    headers = {twilio.HEADER: twilio_sign("12345", url, params)}
    assert twilio.verify("12345", url, headers, body)
    assert not twilio.verify("wrong", url, headers, body)
    assert not twilio.verify("12345", url, headers, body.replace(b"1234&", b"1235&"))
    # A proxy rewrote the host (or scheme): the URL we check is the configured one, so it fails.
    assert not twilio.verify("12345", "http://internal:8080/myapp.php?foo=1&bar=2", headers, body)
    assert not twilio.verify("12345", url, {}, body)


def test_twilio_json_body_sha256() -> None:
    body = json.dumps({"AccountSid": "AC1", "MessageSid": "SM1", "Body": "hi"}).encode()
    digest = hashlib.sha256(body).hexdigest()
    url = f"https://hooks.example/intake/twilio/AC1/sms?bodySHA256={digest}"
    headers = {twilio.HEADER: twilio_sign("tok", url)}
    assert twilio.verify("tok", url, headers, body)
    assert not twilio.verify("tok", url, headers, body + b" ")  # body no longer matches its hash
    assert twilio.params_of(body, url) == {"AccountSid": "AC1", "MessageSid": "SM1", "Body": "hi"}
