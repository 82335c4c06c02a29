"""Audit 4: webhook intake on a real `agentdispatch gateway` process: oversized
bodies (with Content-Length and chunked), a 1 byte/s sender, slow headers,
many slow senders at once, and duplicate deliveries (sequential and concurrent)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import hmac
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from kit import clean_env, start_gateway

KEY = "11" * 32
TG_SECRET, TG_BOT = "tg-secret_TOKEN-1", "7001"
SLACK_SECRET, APP, TEAM = "slack-signing-secret", "A0APP", "T0TEAM"
BODY_TIMEOUT = float(os.environ.get("BODY_TIMEOUT", "3"))
root = Path(tempfile.mkdtemp(prefix="audit4-"))
data = root / "data"
env = clean_env(AGENT_DISPATCH_DATA_DIR=str(data), TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_INTAKE_KEY=KEY,
           AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S=str(BODY_TIMEOUT))  # fmt: skip


def cli(*args: str, stdin: str | None = None) -> str:
    p = subprocess.run([sys.executable, "-m", "agentdispatch", *args], env=env, input=stdin, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


tg = cli("intake", "install", "telegram", "--tenant", "acme", "--bot-id", TG_BOT, "--bot-user-id", "helperbot",
         "--credentials-stdin", stdin=json.dumps({"secret_token": TG_SECRET, "bot_token": f"{TG_BOT}:tok"}))  # fmt: skip
sl = cli("intake", "install", "slack", "--tenant", "acme", "--app-id", APP, "--team-id", TEAM, "--bot-user-id", "U0BOT",
         "--credentials-stdin", stdin=json.dumps({"signing_secret": SLACK_SECRET, "bot_token": "xoxb-1"}))  # fmt: skip
cli("intake", "agent", "add", "helper")
for inst in (tg, sl):
    cli("intake", "route", "set", inst, "*", "helper")
gw, port = start_gateway(env, root / "gateway.log", "--no-auth")
base = f"http://127.0.0.1:{port}"


def rss_kb() -> int:
    for line in Path(f"/proc/{gw.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def hwm_kb() -> int:
    for line in Path(f"/proc/{gw.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


def tg_update(uid: int) -> bytes:
    msg = {"message_id": uid * 10, "date": 1700000000, "text": "hi", "from": {"id": 9},
           "chat": {"id": 42, "type": "private"}}  # fmt: skip
    return json.dumps({"update_id": uid, "message": msg}).encode()


TG_PATH = f"/intake/telegram/{TG_BOT}"
TG_HEAD = f"X-Telegram-Bot-Api-Secret-Token: {TG_SECRET}\r\nContent-Type: application/json\r\n"


def raw(head: str, body_iter, *, read_timeout: float = 60) -> tuple[str, float, int]:
    """Send a request by hand while a reader thread waits for the answer;
    returns (status line and body start, seconds until the answer, bytes of body sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(read_timeout)
    t0 = time.monotonic()
    got: dict[str, object] = {}

    def reader() -> None:
        try:
            data = s.recv(65536)
            got["t"] = time.monotonic() - t0
            got["resp"] = data.decode(errors="replace")
        except OSError as exc:
            got["t"] = time.monotonic() - t0
            got["resp"] = f"recv {type(exc).__name__}"

    th = threading.Thread(target=reader)
    th.start()
    sent = 0
    try:
        s.sendall(head.encode())
        for chunk in body_iter:
            if "t" in got:
                break
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    th.join(read_timeout)
    s.close()
    resp = str(got.get("resp", "")) or "closed without answer"
    status = resp.splitlines()[0] + " body=" + resp.split("\r\n\r\n", 1)[-1][:100] if "HTTP/" in resp else resp
    return status, float(got.get("t", -1.0)), sent


def big_chunks(total: int, size: int = 1 << 16):
    for _ in range(total // size):
        yield b"x" * size


def chunked(total: int, size: int = 1 << 16):
    for _ in range(total // size):
        yield f"{size:x}\r\n".encode() + b"x" * size + b"\r\n"
    yield b"0\r\n\r\n"


def slow(n: int, per_s: float = 1.0):
    for _ in range(n):
        yield b"x"
        time.sleep(1 / per_s)


results = {}
print("gateway RSS at start", rss_kb(), "kB, peak", hwm_kb())
r0 = rss_kb()
st = raw(f"POST {TG_PATH} HTTP/1.1\r\nHost: x\r\n{TG_HEAD}Content-Length: {50 << 20}\r\n\r\n", big_chunks(50 << 20))
print(
    f"50 MB with Content-Length: {st[0]!r} after {st[1]:.2f}s, sent {st[2] >> 20} MiB; RSS {rss_kb()} kB (+{rss_kb() - r0}), peak {hwm_kb()}"
)
r0 = rss_kb()
st = raw(f"POST {TG_PATH} HTTP/1.1\r\nHost: x\r\n{TG_HEAD}Transfer-Encoding: chunked\r\n\r\n", chunked(50 << 20))
print(
    f"50 MB chunked, no length: {st[0]!r} after {st[1]:.2f}s, sent {st[2] >> 20} MiB; RSS {rss_kb()} kB (+{rss_kb() - r0}), peak {hwm_kb()}"
)
# A lying Content-Length (small) with a huge body.
st = raw(f"POST {TG_PATH} HTTP/1.1\r\nHost: x\r\n{TG_HEAD}Content-Length: 100\r\n\r\n", big_chunks(4 << 20))
print(f"Content-Length 100 but 4 MB sent: {st[0]!r} after {st[1]:.2f}s")
# Slack, to be sure the size check runs before the HMAC on another connector.
st = raw(f"POST /intake/slack/{APP} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
         chunked(8 << 20))  # fmt: skip
print(f"Slack 8 MB chunked unsigned: {st[0]!r} after {st[1]:.2f}s")
st = raw(f"POST {TG_PATH} HTTP/1.1\r\nHost: x\r\n{TG_HEAD}Content-Length: 100\r\n\r\n", slow(30))
print(f"1 byte/s body (deadline {BODY_TIMEOUT}s): {st[0]!r} after {st[1]:.2f}s, sent {st[2]} bytes")
st = raw("", (bytes([c]) for c in f"POST {TG_PATH} HTTP/1.1\r\nHost: x\r\n{TG_HEAD}".encode() if not time.sleep(1)))
print(f"1 byte/s headers: {st[0]!r} after {st[1]:.2f}s, sent {st[2]} bytes")
# 200 slow senders at once: each cut at the deadline, and a real delivery still answered quickly meanwhile.
r0 = rss_kb()
with cf.ThreadPoolExecutor(200) as pool:
    futs = [pool.submit(raw, f"POST {TG_PATH} HTTP/1.1\r\nHost: x\r\n{TG_HEAD}Content-Length: 1000\r\n\r\n", slow(60))
            for _ in range(200)]  # fmt: skip
    time.sleep(1)
    t0 = time.monotonic()
    ok = httpx.post(base + TG_PATH, content=tg_update(999), headers={"X-Telegram-Bot-Api-Secret-Token": TG_SECRET},
                    timeout=10)  # fmt: skip
    print(f"a real delivery amid 200 slow senders: {ok.status_code} in {time.monotonic() - t0:.3f}s")
    outs = [f.result() for f in futs]
from collections import Counter  # noqa: E402

print("200 slow senders:", Counter(o[0][:40] for o in outs), f"max {max(o[1] for o in outs):.1f}s",
      f"RSS +{rss_kb() - r0} kB, peak {hwm_kb()}")  # fmt: skip
# Duplicates: sequential, then 20 concurrent copies of one update.
c = httpx.Client(base_url=base, timeout=10)
h = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}
a = c.post(TG_PATH, content=tg_update(1), headers=h)
b = c.post(TG_PATH, content=tg_update(1), headers=h)
print("duplicate sequential:", a.status_code, repr(a.text), b.status_code, repr(b.text))
with cf.ThreadPoolExecutor(20) as pool:
    codes = list(pool.map(lambda _: httpx.post(base + TG_PATH, content=tg_update(2), headers=h, timeout=10).status_code,
                          range(20)))  # fmt: skip
print("20 concurrent copies:", Counter(codes))
ts = str(int(time.time()))
body = json.dumps({"type": "event_callback", "api_app_id": APP, "team_id": TEAM, "event_id": "Ev1", "event_time": 1,
                   "event": {"type": "app_mention", "channel": "C1", "user": "U1", "text": "<@U0BOT> hi",
                             "ts": "1.1"}}).encode()  # fmt: skip
sig = "v0=" + hmac.new(SLACK_SECRET.encode(), f"v0:{ts}:".encode() + body, hashlib.sha256).hexdigest()
sh = {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig, "Content-Type": "application/json"}
sc = [c.post(f"/intake/slack/{APP}", content=body, headers={**sh, **({"X-Slack-Retry-Num": "1"} if i else {})})
      for i in range(3)]  # fmt: skip
print("slack delivery + 2 retries:", [(r.status_code, r.text[:40]) for r in sc])
time.sleep(1)
db = sqlite3.connect(data / "agent_dispatch_queue.db")
tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
rcpt = next((t for t in tables if "receipt" in t), None)
print("tables:", [t for t in tables if "intake" in t or "receipt" in t or t == "work_items"])
if rcpt:
    print("receipts:", db.execute(f"SELECT count(*) FROM {rcpt}").fetchone()[0])
print("work_items:", db.execute("SELECT count(*) FROM work_items").fetchone()[0])
print("queue items:", db.execute("SELECT count(*) FROM agent_dispatch_queue").fetchone()[0])
print("gateway peak RSS (VmHWM)", hwm_kb(), "kB; alive", gw.poll() is None)
gw.terminate()
gw.wait(timeout=20)
print("--- gateway log tail:\n" + "\n".join((root / "gateway.log").read_text().splitlines()[-15:]))
print("root", root)
