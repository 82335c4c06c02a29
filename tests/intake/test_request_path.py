"""The request path against a real gateway subprocess on a real SQLite store."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from e2e.gatewayproc import Gateway
from intake.kit import (
    ACCOUNT,
    APP,
    NUMBER,
    PUBLIC,
    TG_BOT,
    TWILIO_TOKEN,
    count,
    db,
    gateway,
    install_all,
    post_slack,
    post_tg,
    post_twilio,
    slack_event,
    slack_headers,
    sms_params,
    tg_update,
    twilio_sign,
)


@dataclass
class Live:
    gw: Gateway
    data: Path
    c: httpx.Client


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data = tmp_path_factory.mktemp("intake") / "data"
    install_all(data)
    gw = gateway(data, AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S="2", AGENT_DISPATCH_INTAKE_COMMIT_TIMEOUT_S="1")
    with gw.client() as c:
        yield Live(gw, data, c)
    gw.stop()


def receipts(live: Live, source: str) -> int:
    return count(live.data, "SELECT count(*) FROM intake_receipts WHERE source_id = ?", source)


def items_of(live: Live, source: str) -> int:
    sql = "SELECT count(*) FROM work_items w JOIN intake_receipts r ON r.job_id = w.id WHERE r.source_id = ?"
    return count(live.data, sql, source)


def test_slack_accept_duplicate_and_mismatch(live: Live) -> None:
    body = slack_event("EvA1")
    first = post_slack(live.c, body)
    assert first.status_code == 200
    assert receipts(live, f"{APP}:T0TEAM:EvA1") == 1 and items_of(live, f"{APP}:T0TEAM:EvA1") == 1
    again = post_slack(live.c, body, **{"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"})
    assert (again.status_code, again.text) == (first.status_code, first.text)
    changed = slack_event("EvA1", text="<@U0BOT> other bytes")
    assert post_slack(live.c, changed).status_code == 200
    with db(live.data) as conn:
        row = conn.execute("SELECT * FROM intake_receipts WHERE source_id = ?", (f"{APP}:T0TEAM:EvA1",)).fetchone()
    assert row["mismatches"] == 1 and row["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert items_of(live, f"{APP}:T0TEAM:EvA1") == 1


def test_slack_retry_only_delivery_is_processed(live: Live) -> None:
    body = slack_event("EvRetryOnly")
    r = post_slack(live.c, body, **{"X-Slack-Retry-Num": "3", "X-Slack-Retry-Reason": "http_timeout"})
    assert r.status_code == 200
    with db(live.data) as conn:
        row = conn.execute("SELECT state, retry_num, retry_reason FROM intake_receipts WHERE source_id LIKE ?",
                           ("%:EvRetryOnly",)).fetchone()  # fmt: skip
    assert tuple(row) == ("accepted", 3, "http_timeout")


def test_slack_auth_failures_store_nothing(live: Live) -> None:
    before = count(live.data, "SELECT count(*) FROM intake_receipts")
    body = slack_event("EvBad")
    for headers in (
        slack_headers(body, secret="wrong"),
        # Well outside the 300 s window: a loaded machine can take seconds to
        # deliver the request (the exact boundary is test_signatures' unit test).
        slack_headers(body, at=time.time() - 330),
        slack_headers(body, at=time.time() + 330),
        {**slack_headers(body), "X-Slack-Signature": ""},
    ):
        assert live.c.post(f"/intake/slack/{APP}", content=body, headers=headers).status_code == 401
    flipped = body.replace(b"hello", b"hellO")
    assert live.c.post(f"/intake/slack/{APP}", content=flipped, headers=slack_headers(body)).status_code == 401
    assert count(live.data, "SELECT count(*) FROM intake_receipts") == before


def test_slack_headers_and_bodies_no_sender_could_sign_are_401(live: Live) -> None:
    # Anyone can send these without a secret: each must be refused, not fail
    # the request.
    before = count(live.data, "SELECT count(*) FROM intake_receipts")
    body = slack_event("EvOdd")
    now = str(int(time.time()))
    sent: list[tuple[bytes, list[tuple[str, str | bytes]]]] = [
        (body, [("X-Slack-Request-Timestamp", "soon"), ("X-Slack-Signature", "v0=00")]),
        (body, [("X-Slack-Request-Timestamp", "1.5"), ("X-Slack-Signature", "v0=00")]),
        (body, [("X-Slack-Request-Timestamp", now), ("X-Slack-Signature", b"v0=\xe9\xe9")]),
        (
            b'{"type":"event_callback","text":"\xff\xfe"}',
            [("X-Slack-Request-Timestamp", now), ("X-Slack-Signature", "v0=00")],
        ),
    ]
    for content, headers in sent:
        with httpx.Client(base_url=live.gw.url, timeout=10) as c:  # a 500 would close the shared client's connection
            r = c.post(f"/intake/slack/{APP}", content=content, headers=headers)
        assert (r.status_code, r.json()["error"]) == (401, "unauthorized")
    assert count(live.data, "SELECT count(*) FROM intake_receipts") == before


def test_url_verification_only_when_signed(live: Live) -> None:
    body = json.dumps({"type": "url_verification", "challenge": "ch-123", "token": "x"}).encode()
    before = count(live.data, "SELECT count(*) FROM work_items")
    ok = live.c.post(f"/intake/slack/{APP}", content=body, headers=slack_headers(body))
    assert ok.status_code == 200 and ok.json() == {"challenge": "ch-123"}
    bad = live.c.post(f"/intake/slack/{APP}", content=body, headers=slack_headers(body, secret="nope"))
    assert bad.status_code == 401 and "ch-123" not in bad.text
    assert bad.headers["content-type"] == "application/json" and bad.json()["error"] == "unauthorized"
    assert count(live.data, "SELECT count(*) FROM work_items") == before


def test_never_acceptable_input_is_a_rejected_receipt_and_200(live: Live) -> None:
    malformed = b"{not json"
    r = post_slack(live.c, malformed)
    assert r.status_code == 200 and r.headers["X-Slack-No-Retry"] == "1"
    unsupported = json.dumps({"type": "event_callback", "api_app_id": APP, "team_id": "T0TEAM",
                              "event_id": "EvReact", "event": {"type": "reaction_added"}}).encode()  # fmt: skip
    assert post_slack(live.c, unsupported).status_code == 200
    assert post_tg(live.c, json.dumps({"update_id": 5555, "poll": {}}).encode()).status_code == 200
    with db(live.data) as conn:
        rows = conn.execute(
            "SELECT source_id, state, reason, job_id FROM intake_receipts WHERE state = 'rejected'"
        ).fetchall()
    got = {r["reason"] for r in rows if r["job_id"] is None}
    assert {"malformed", "unsupported_type"} <= got
    assert receipts(live, f"{TG_BOT}:5555") == 1 and items_of(live, f"{TG_BOT}:5555") == 0


def test_signed_fields_the_connectors_cannot_read_are_answered_not_500(live: Live) -> None:
    # Authenticated input that a 500 would have the provider resend forever.
    def post(send: Callable[[httpx.Client], httpx.Response]) -> httpx.Response:
        with httpx.Client(base_url=live.gw.url, timeout=10) as c:  # a 500 would close the shared client's connection
            return send(c)

    nested = b"[" * 100_000 + b"]" * 100_000
    assert post(lambda c: post_tg(c, nested)).status_code == 200
    digest = hashlib.sha256(nested).hexdigest()[:32]
    assert receipts(live, f"{TG_BOT}:malformed:{digest}") == 1
    retried = slack_event("EvOddRetry")
    assert post(lambda c: post_slack(c, retried, **{"X-Slack-Retry-Num": "two"})).status_code == 200
    assert items_of(live, f"{APP}:T0TEAM:EvOddRetry") == 1
    media = [*sms_params("SMmedia"), ("NumMedia", "many")]
    assert post(lambda c: post_twilio(c, "sms", media)).status_code == 200
    assert items_of(live, f"{ACCOUNT}:SMmedia") == 1
    call = [("AccountSid", ACCOUNT), ("CallSid", "CAodd"), ("From", "+1"), ("To", NUMBER)]
    assert post(lambda c: post_twilio(c, "voice", call, query="step=first")).status_code == 200
    assert post(lambda c: post_twilio(c, "voice/status", call, query="step=1&poll=x&call=CAodd")).status_code == 200


def test_concurrent_delivery_and_retry(live: Live) -> None:
    body = slack_event("EvRace")
    results: list[int] = []
    barrier = threading.Barrier(2)

    def send(retry: str | None) -> None:
        extra = {"X-Slack-Retry-Num": retry} if retry else {}
        with httpx.Client(base_url=live.gw.url, timeout=10) as c:
            barrier.wait()
            results.append(post_slack(c, body, **extra).status_code)

    threads = [threading.Thread(target=send, args=(r,)) for r in (None, "1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200]
    assert receipts(live, f"{APP}:T0TEAM:EvRace") == 1 and items_of(live, f"{APP}:T0TEAM:EvRace") == 1


def test_telegram_secret_and_exact_update_ids(live: Live) -> None:
    refused = post_tg(live.c, tg_update(900), secret="wrong")
    assert refused.status_code == 401 and refused.headers["content-type"] == "application/json"
    assert refused.json()["error"] == "unauthorized"
    assert live.c.post(f"/intake/telegram/{TG_BOT}", content=tg_update(900)).status_code == 401
    assert receipts(live, f"{TG_BOT}:900") == 0
    assert post_tg(live.c, tg_update(900)).status_code == 200
    assert post_tg(live.c, tg_update(900)).status_code == 200
    assert post_tg(live.c, tg_update(17)).status_code == 200  # a lower (random after a gap) id is new
    assert receipts(live, f"{TG_BOT}:900") == 1 and items_of(live, f"{TG_BOT}:900") == 1
    assert items_of(live, f"{TG_BOT}:17") == 1


def test_twilio_sms_signature_host_and_json(live: Live) -> None:
    assert post_twilio(live.c, "sms", sms_params("SMq1"), query="x=1").status_code == 200
    # The Host header is not part of what we check: a proxy rewriting it changes nothing.
    assert post_twilio(live.c, "sms", sms_params("SMh1"), host="internal.proxy:9000").status_code == 200
    forbidden = post_twilio(live.c, "sms", sms_params("SMbad"), token="wrong")
    assert forbidden.status_code == 403 and forbidden.headers["content-type"] == "application/json"
    assert forbidden.json() == {"status": "error", "error": "forbidden", "message": "invalid Twilio signature"}
    # Signed for another public URL (wrong scheme) than the configured one: refused.
    params = sms_params("SMscheme")
    sig = twilio_sign(TWILIO_TOKEN, PUBLIC.replace("https", "http") + f"/intake/twilio/{ACCOUNT}/sms", params)
    r = live.c.post(f"/intake/twilio/{ACCOUNT}/sms", data=dict(params), headers={"X-Twilio-Signature": sig})
    assert r.status_code == 403
    assert post_twilio(live.c, "sms", sms_params("SMq1"), query="x=1").status_code == 200
    assert receipts(live, f"{ACCOUNT}:SMq1") == 1 and items_of(live, f"{ACCOUNT}:SMq1") == 1
    assert receipts(live, f"{ACCOUNT}:SMbad") == 0
    body = json.dumps({"AccountSid": ACCOUNT, "MessageSid": "SMjson", "From": "+1555", "To": NUMBER,
                       "Body": "json"}).encode()  # fmt: skip
    query = f"bodySHA256={hashlib.sha256(body).hexdigest()}"
    url = f"{PUBLIC}/intake/twilio/{ACCOUNT}/sms?{query}"
    headers = {"X-Twilio-Signature": twilio_sign(TWILIO_TOKEN, url), "Content-Type": "application/json"}
    assert live.c.post(f"/intake/twilio/{ACCOUNT}/sms?{query}", content=body, headers=headers).status_code == 200
    assert items_of(live, f"{ACCOUNT}:SMjson") == 1


def test_twilio_voice_replayed_step_gets_the_same_twiml(live: Live) -> None:
    params = [("AccountSid", ACCOUNT), ("CallSid", "CAv1"), ("From", "+1"), ("To", NUMBER), ("SpeechResult", "hi")]
    first = post_twilio(live.c, "voice", params, query="step=1")
    again = post_twilio(live.c, "voice", params, query="step=1")
    assert first.status_code == 200 and "<Redirect" in first.text and again.text == first.text
    assert items_of(live, f"{ACCOUNT}:CAv1:1") == 1


def _raw(live: Live, head: bytes, body_chunks: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", live.gw.port), timeout=15) as s:
        s.sendall(head)
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except OSError:
            pass  # the server cut us off: what we want
        s.settimeout(15)
        out = b""
        while b"\r\n\r\n" not in out:
            part = s.recv(65536)
            if not part:
                break
            out += part
        return out


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_50mb_body_and_slow_sender_are_cut_off(live: Live) -> None:
    before = count(live.data, "SELECT count(*) FROM intake_receipts")
    rss = _rss_kb(live.gw.proc.pid)
    path = f"/intake/telegram/{TG_BOT}".encode()
    head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n"
    chunk = b"x" * (1 << 20)
    out = _raw(live, head, [chunk] * 50)
    assert out.startswith(b"HTTP/1.1 413")
    chunked = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    assert _raw(live, chunked, [piece] * 50).startswith(b"HTTP/1.1 413")
    assert _rss_kb(live.gw.proc.pid) - rss < 2 * 1024 * 2  # growth under twice the 1 MiB cap (KiB)
    # A sender that stalls after one byte of its 100: only the gateway's body
    # timeout can end the request, so an answer at all proves the cut-off.
    stalled = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    assert _raw(live, stalled, [b"{"]).startswith(b"HTTP/1.1 408")
    assert count(live.data, "SELECT count(*) FROM intake_receipts") == before


def test_a_webhook_declared_past_the_gateways_limit_gets_its_own_refusal(live: Live) -> None:
    # Past 2 MiB the gateway refuses before the route reads anything: still
    # intake's answer, and Slack is told not to retry a body it will resend.
    head = f"POST /intake/slack/{APP} HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n".encode()
    out = _raw(live, head, [])
    assert out.startswith(b"HTTP/1.1 413"), out
    assert b"x-slack-no-retry: 1" in out.lower()
    with socket.create_connection(("127.0.0.1", live.gw.port), timeout=15) as s:
        path = f"/intake/telegram/{TG_BOT}"
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"x-slack-no-retry" not in answer.lower()
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"] == "too_large"


def test_a_refused_body_closes_the_connection(live: Live) -> None:
    # The rest of a refused body is never read: one more byte of it after the
    # answer (which cancels the keep-alive timer) used to hold the connection.
    cases = [(f"/intake/telegram/{TG_BOT}", b"52428800", b"413"), ("/v1/jobs", b"52428800", b"413"),
             (f"/intake/telegram/{TG_BOT}", b"100", b"408")]  # fmt: skip
    for path, declared, status in cases:
        with socket.create_connection(("127.0.0.1", live.gw.port), timeout=8) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: ".encode() + declared + b"\r\n\r\n{")
            got = b""
            while b"\r\n\r\n" not in got and (chunk := s.recv(65536)):
                got += chunk
            assert got.startswith(b"HTTP/1.1 " + status)
            with contextlib.suppress(ConnectionError):  # closed before the byte or the read: as wanted
                s.sendall(b"x")
                while s.recv(65536):  # b"" once the gateway closes; a timeout if it never does
                    pass


@dataclass
class Refused:
    answer: bytes = b""  # all the gateway sent up to its end of stream
    lost: OSError | None = None  # the connection was reset before the answer could be read
    cut_after_s: float | None = None  # how long after the answer sending more failed


def _refused_sender(port: int, path: str, chunked: bool, start: threading.Barrier) -> Refused:
    # Like an HTTP client uploading a 50 MB body in parts, which looks for an
    # early answer between parts (not during one). A small send buffer keeps
    # the kernel from taking a 3 MiB part unread: it goes through only if the
    # gateway reads it, and a reset while it is being sent loses the answer.
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: 50000000"
    head = b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n"
    piece = b"x" * 65536
    if chunked:
        piece = b"10000\r\n" + piece + b"\r\n"
    part = piece * 48  # 3 MiB: past the 1 MiB a webhook reads, under the 4 MiB the gateway drops after
    out = Refused()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        s.settimeout(30)
        s.connect(("127.0.0.1", port))
        start.wait(30)
        s.sendall(head)
        try:
            s.sendall(part)
            while not select.select([s], [], [], 10)[0]:  # an answer has arrived (or send more)
                s.sendall(part)
        except OSError as exc:
            out.lost = exc
            return out
        while chunk := s.recv(65536):  # the answer, then the gateway's end of stream
            out.answer += chunk
        # A client that goes on sending regardless is cut off once the gateway stops lingering.
        answered = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(50_000_000 // len(piece)):
                s.sendall(piece)
            return out
        out.cut_after_s = time.monotonic() - answered
    return out


def _sockets_of(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


def test_many_refused_senders_at_once_all_read_their_answer(live: Live) -> None:
    # Refused before their bodies are read while still sending them: the
    # gateway used to close with the body unread, the kernel sent a reset, and
    # senders lost their 413 (Slack its X-Slack-No-Retry). It now shuts its
    # side, reads and drops the rest for 2 s (4 MiB at most), then closes.
    baseline = _sockets_of(live.gw.proc.pid)
    tg, slack = f"/intake/telegram/{TG_BOT}", f"/intake/slack/{APP}"
    cases = [(tg, False), (tg, True), (slack, False), ("/v1/jobs", False)] * 10
    start = threading.Barrier(len(cases))
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(_refused_sender, live.gw.port, path, ch, start) for path, ch in cases]
        results = [f.result() for f in futures]
    lost = [(path, r.lost) for (path, _), r in zip(cases, results, strict=True) if r.lost is not None]
    assert not lost, f"{len(lost)} of {len(cases)} senders lost their answer to a reset: {lost[:3]}"
    for (path, _), r in zip(cases, results, strict=True):
        head, _, body = r.answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413 "), r
        assert json.loads(body)["error"] == ("body_too_large" if path == "/v1/jobs" else "too_large"), r
        assert (b"x-slack-no-retry: 1" in head.lower()) == path.startswith("/intake/slack/"), head
        # Cut off within the 2 s linger, not read to the end; generous for a busy machine.
        assert r.cut_after_s is not None and r.cut_after_s < 15, (path, r.cut_after_s)
    assert _sockets_of(live.gw.proc.pid) <= baseline
    assert live.c.get("/healthz").status_code == 200


def test_a_request_head_not_received_in_time_closes_the_connection(live: Live) -> None:
    # Nothing, part of a head, or part of the head of the next request on a
    # kept-alive connection: the body deadline never starts for any of them,
    # so only a deadline on the head ends them (the fixture sets 2 s).
    first = b"POST /intake/telegram/" + TG_BOT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    cases = [([], 0), ([b"POST / HTTP/1.1\r\nHost: x\r\nX-Slow: a"], 0), ([first, b"GET / HTTP/1.1\r\nX-"], 1)]
    for sent, answers in cases:
        with socket.create_connection(("127.0.0.1", live.gw.port), timeout=15) as s:
            started = time.monotonic()
            for part in sent:
                s.sendall(part)
            got = b""
            while chunk := s.recv(65536):  # returns b"" once the gateway closes; raises if it never does
                got += chunk
            assert got.count(b"HTTP/1.1 ") == answers and time.monotonic() - started < 10


def test_store_too_slow_is_503_then_the_retry_is_admitted(live: Live) -> None:
    body = tg_update(4242)
    blocker = sqlite3.connect(live.data / "agent_dispatch_queue.db", timeout=30, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the database past the commit timeout
    try:
        r = post_tg(live.c, body)
        assert r.status_code == 503 and r.headers["Retry-After"].isdigit()
        time.sleep(0.3)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    time.sleep(0.5)  # the abandoned transaction rolls back instead of committing late
    assert receipts(live, f"{TG_BOT}:4242") == 0 and items_of(live, f"{TG_BOT}:4242") == 0
    assert post_tg(live.c, body).status_code == 200
    assert receipts(live, f"{TG_BOT}:4242") == 1 and items_of(live, f"{TG_BOT}:4242") == 1


def test_backlog_bound_per_agent(tmp_path: Path) -> None:
    data = tmp_path / "data"
    install_all(data)
    with db(data) as conn:  # 255 non-terminal turns of the agent already queued
        now = time.time()
        conn.executemany(
            "INSERT INTO work_items (id, tenant, session_id, session_ref, kind, agent_name, payload, status,"
            " max_attempts, created_at, ready_at, updated_at) VALUES (?, 'acme', ?, ?, 'intake_turn', 'helper',"
            " '{}', 'ready', 5, ?, ?, ?)",
            [(f"fill-{i}", f"s{i}", f"r{i}", now, now, now) for i in range(255)],
        )
    gw = gateway(data)
    try:
        with gw.client() as c:
            assert post_tg(c, tg_update(1)).status_code == 200  # the 256th
            full = post_tg(c, tg_update(2))  # a retryable failure, recorded as a rejected receipt
            assert full.status_code == 503 and full.headers["Retry-After"].isdigit()
            refused = "SELECT count(*) FROM intake_receipts WHERE source_id = ? AND state = 'rejected'"
            assert count(data, refused + " AND reason = 'backlog_full' AND job_id IS NULL", f"{TG_BOT}:2") == 1
            with db(data) as conn:
                conn.execute("UPDATE work_items SET status = 'succeeded' WHERE id = 'fill-0'")
            assert post_tg(c, tg_update(1)).status_code == 200  # the duplicate still answers 200
            assert post_tg(c, tg_update(2)).status_code == 200  # room again: the retry is accepted
            assert count(data, "SELECT count(*) FROM intake_receipts WHERE state = 'accepted'") == 2
            assert count(data, refused, f"{TG_BOT}:2") == 0
    finally:
        gw.stop()
