"""Audit 4b: N slow senders at once (1 byte/s bodies and 1 byte/s heads) on a
real gateway; every one must be cut at the read deadline, real deliveries must
still be answered promptly, and the gateway's RSS must stay bounded."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from kit import clean_env, start_gateway

N = int(os.environ.get("N", "2000"))
KEY, TG_SECRET, TG_BOT = "11" * 32, "tg-secret_TOKEN-1", "7001"
root = Path(tempfile.mkdtemp(prefix="audit4b-"))
env = clean_env(AGENT_DISPATCH_DATA_DIR=str(root / "data"), TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_INTAKE_KEY=KEY,
           AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S="5")  # fmt: skip


def cli(*args: str, stdin: str | None = None) -> str:
    p = subprocess.run([sys.executable, "-m", "agentdispatch", *args], env=env, input=stdin, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


tg = cli("intake", "install", "telegram", "--tenant", "acme", "--bot-id", TG_BOT, "--credentials-stdin",
         stdin=json.dumps({"secret_token": TG_SECRET, "bot_token": f"{TG_BOT}:tok"}))  # fmt: skip
cli("intake", "agent", "add", "helper")
cli("intake", "route", "set", tg, "*", "helper")
gw, port = start_gateway(env, root / "gateway.log", "--no-auth")


def status(key: str) -> int:
    for line in Path(f"/proc/{gw.pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return -1


PATH = f"/intake/telegram/{TG_BOT}"
HEAD = f"POST {PATH} HTTP/1.1\r\nHost: x\r\nX-Telegram-Bot-Api-Secret-Token: {TG_SECRET}\r\nContent-Type: application/json\r\n"


async def slow(kind: str) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect {type(exc).__name__}", 0.0
    reader_task = asyncio.ensure_future(r.read(200))
    data = (HEAD + "Content-Length: 1000\r\n\r\n").encode() if kind == "body" else HEAD.encode()
    pre, drip = (data, b"x" * 1000) if kind == "body" else (b"", data)
    try:
        w.write(pre)
        for b in drip:
            if reader_task.done():
                break
            w.write(bytes([b]))
            await w.drain()
            await asyncio.wait([reader_task], timeout=1.0)
    except OSError:
        pass
    try:
        resp = await asyncio.wait_for(reader_task, 30)
    except (TimeoutError, OSError) as exc:
        resp = f"no answer {type(exc).__name__}".encode()
    w.close()
    first = resp.decode(errors="replace").split("\r\n")[0] or "closed"
    return first, time.monotonic() - t0


async def main() -> None:
    rss0 = status("VmRSS:")
    tasks = [asyncio.ensure_future(slow("body" if i % 2 else "head")) for i in range(N)]
    await asyncio.sleep(2)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        lat = []
        for uid in range(10):
            t0 = time.monotonic()
            body = json.dumps({"update_id": uid, "message": {"message_id": uid, "date": 1, "text": "hi",
                               "from": {"id": 9}, "chat": {"id": 42, "type": "private"}}}).encode()  # fmt: skip
            r = await c.post(PATH, content=body, headers={"X-Telegram-Bot-Api-Secret-Token": TG_SECRET})
            lat.append((r.status_code, round(time.monotonic() - t0, 3)))
        print(f"real deliveries amid {N} slow senders: {lat}")
        print(f"gateway threads {status('Threads:')}, RSS {status('VmRSS:')} kB (+{status('VmRSS:') - rss0})")
    outs = await asyncio.gather(*tasks)
    by = Counter((o[0], round(o[1])) for o in outs)
    print(f"{N} slow senders (1 byte/s, deadline 5 s):", dict(by.most_common(8)))
    print(f"peak RSS {status('VmHWM:')} kB (start {rss0}); gateway alive {gw.poll() is None}")


asyncio.run(main())
gw.terminate()
gw.wait(timeout=20)
print("--- gateway log tail:\n" + "\n".join((root / "gateway.log").read_text().splitlines()[-8:]))
