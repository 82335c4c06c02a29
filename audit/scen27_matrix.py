"""Scenario 27: the signature and replay matrix per connector, against a real
gateway over HTTP on a SQLite store. Each row: what was sent, the status
expected, the status got, and the receipts/WorkItems it added (replays and
refusals must add no WorkItem).

    python audit/scen27_matrix.py
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from intake.kit import (
    ACCOUNT,
    APP,
    PUBLIC,
    SLACK_SECRET,
    TG_BOT,
    TG_SECRET,
    TWILIO_TOKEN,
    count,
    gateway,
    install_all,
    slack_event,
    slack_headers,
    sms_params,
    tg_update,
    twilio_sign,
)

data = Path(tempfile.mkdtemp(prefix="scen27-")) / "data"
install_all(data)
gw = gateway(data)
c = httpx.Client(base_url=gw.url, timeout=10)
rows: list[tuple[str, int, int, int, int]] = []


def items() -> int:
    return count(data, "SELECT count(*) FROM work_items WHERE kind = 'intake_turn'")


def receipts() -> int:
    return count(data, "SELECT count(*) FROM intake_receipts")


def case(name: str, expect: int, send: Callable[[], httpx.Response], new_items: int) -> None:
    i0, r0 = items(), receipts()
    with httpx.Client(base_url=gw.url, timeout=10) as fresh:  # a refusal may close the connection
        global c
        c = fresh
        got = send().status_code
    di, dr = items() - i0, receipts() - r0
    ok = got == expect and di == new_items
    rows.append((name, expect, got, dr, di))
    print(f"{'ok ' if ok else 'BAD'} {name:55s} expect={expect} got={got} +receipts={dr} +items={di}")


# Slack
sbody = slack_event("EvM1")
spath = f"/intake/slack/{APP}"
case("slack valid", 200, lambda: c.post(spath, content=sbody, headers=slack_headers(sbody)), 1)
case("slack exact replay", 200, lambda: c.post(spath, content=sbody, headers=slack_headers(sbody)), 0)
case("slack flipped body byte", 401,
     lambda: c.post(spath, content=sbody.replace(b"hello", b"hellO"), headers=slack_headers(sbody)), 0)  # fmt: skip
reser = json.dumps(json.loads(sbody), indent=1).encode()
case("slack re-serialized body", 401, lambda: c.post(spath, content=reser, headers=slack_headers(sbody)), 0)
nonutf = b'{"type":"event_callback","x":"\xff"}'


def raw_signed(body: bytes) -> dict[str, str]:
    """Slack's v0 HMAC over the raw bytes (the SDK only signs UTF-8 text)."""
    ts = str(int(time.time()))
    mac = hmac.new(SLACK_SECRET.encode(), b"v0:" + ts.encode() + b":" + body, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": f"v0={mac}"}


case(
    "slack non-UTF-8 body, signed over raw bytes",
    401,
    lambda: c.post(spath, content=nonutf, headers=raw_signed(nonutf)),
    0,
)
for hdr in ("X-Slack-Signature", "X-Slack-Request-Timestamp"):
    h = {k: v for k, v in slack_headers(sbody).items() if k != hdr}
    case(f"slack missing {hdr}", 401, lambda h=h: c.post(spath, content=sbody, headers=h), 0)
b2 = slack_event("EvM2")
case("slack timestamp 301 s old", 401,
     lambda: c.post(spath, content=b2, headers=slack_headers(b2, at=time.time() - 301)), 0)  # fmt: skip
case("slack timestamp 302 s ahead", 401,
     lambda: c.post(spath, content=b2, headers=slack_headers(b2, at=time.time() + 302)), 0)  # fmt: skip
case("slack timestamp 290 s old (inside window)", 200,
     lambda: c.post(spath, content=b2, headers=slack_headers(b2, at=time.time() - 290)), 1)  # fmt: skip
case("slack wrong secret", 401, lambda: c.post(spath, content=b2, headers=slack_headers(b2, secret="x")), 0)
case("slack retry header, same event_id", 200,
     lambda: c.post(spath, content=b2, headers={**slack_headers(b2), "X-Slack-Retry-Num": "1"}), 0)  # fmt: skip

# Telegram
tpath = f"/intake/telegram/{TG_BOT}"
th = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}
TGH = "X-Telegram-Bot-Api-Secret-Token"
tb = tg_update(777)
case("telegram valid", 200, lambda: c.post(tpath, content=tb, headers=th), 1)
case("telegram exact replay", 200, lambda: c.post(tpath, content=tb, headers=th), 0)
case("telegram same update_id, changed bytes", 200,
     lambda: c.post(tpath, content=tb.replace(b'"hi"', b'"hI"'), headers=th), 0)  # fmt: skip
case("telegram wrong secret", 401,
     lambda: c.post(tpath, content=tg_update(778), headers={**th, TGH: "nope"}), 0)  # fmt: skip
case("telegram secret differing in last char", 401,
     lambda: c.post(tpath, content=tg_update(778), headers={**th, TGH: TG_SECRET[:-1] + "X"}), 0)  # fmt: skip
case("telegram missing secret header", 401,
     lambda: c.post(tpath, content=tg_update(778), headers={"Content-Type": "application/json"}), 0)  # fmt: skip
case("telegram non-UTF-8 body, right secret", 200, lambda: c.post(tpath, content=b'{"update_id":\xff}', headers=th), 0)

# Twilio
wpath = f"/intake/twilio/{ACCOUNT}/sms"
public = f"{PUBLIC}{wpath}"


def tw(params: list[tuple[str, str]], url: str = public, body: bytes | None = None, **hdr: str) -> httpx.Response:
    headers = {"X-Twilio-Signature": twilio_sign(TWILIO_TOKEN, url, params), **hdr}
    if body is not None:
        headers["Content-Type"] = "application/x-www-form-urlencoded"
        return c.post(wpath, content=body, headers=headers)
    return c.post(wpath, data=dict(params), headers=headers)


p1 = sms_params("SMm1", body="hello world")
REORDERED = b"Body=hello%20world&To=%2B15550001&From=%2B15559999&MessageSid=SMm1&AccountSid=AC0001"
case("twilio valid", 200, lambda: tw(p1), 1)
case("twilio exact replay", 200, lambda: tw(p1), 0)
case("twilio re-serialized form (reordered, %20)", 200,
     lambda: tw(p1, body=REORDERED), 0)  # fmt: skip
p2 = sms_params("SMm2")
case("twilio flipped param byte", 403,
     lambda: c.post(wpath, data={**dict(p2), "Body": "hellO"},
                    headers={"X-Twilio-Signature": twilio_sign(TWILIO_TOKEN, public, p2)}), 0)  # fmt: skip
case("twilio missing signature", 403, lambda: c.post(wpath, data=dict(p2)), 0)
case("twilio wrong token", 403,
     lambda: c.post(wpath, data=dict(p2), headers={"X-Twilio-Signature": twilio_sign("x", public, p2)}), 0)  # fmt: skip
case("twilio signed for http:// (proxy scheme)", 403, lambda: tw(p2, url=public.replace("https://", "http://")), 0)
case("twilio signed for internal host", 403, lambda: tw(p2, url=public.replace("hooks.example.test", "gw.internal")), 0)
case("twilio signed for :8443 (proxy port)", 403,
     lambda: tw(p2, url=public.replace("hooks.example.test", "hooks.example.test:8443")), 0)  # fmt: skip
case("twilio Host header rewritten by a proxy", 200, lambda: tw(p2, Host="10.0.0.5:8080"), 1)
p3 = sms_params("SMm3")
case("twilio signed with explicit :443", 200,
     lambda: tw(p3, url=public.replace("hooks.example.test", "hooks.example.test:443")), 1)  # fmt: skip
case("twilio non-UTF-8 body", 403, lambda: tw(p3, body=b"Body=\xff&MessageSid=SMm4"), 0)

c.close()
gw.stop()
bad = [r for r in rows if r[1] != r[2]]
print(f"{len(rows) - len(bad)}/{len(rows)} rows as expected")
sys.exit(1 if bad else 0)
