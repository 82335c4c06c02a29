"""Audit: the non-intake API routes of a real gateway (bearer auth on): a 50 MB
chunked body and a 1 byte/s body from a caller with no token."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path

from kit import clean_env, start_gateway

root = Path(tempfile.mkdtemp(prefix="audit7-"))
env = clean_env(AGENT_DISPATCH_DATA_DIR=str(root / "data"), TASK_QUEUE_BACKEND="sqlite",
           AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S="3")  # fmt: skip
gw, port = start_gateway(env, root / "gateway.log")


def rss() -> int:
    return int(
        next(x for x in Path(f"/proc/{gw.pid}/status").read_text().splitlines() if x.startswith("VmRSS")).split()[1]
    )


def raw(head: bytes, body, limit_s: float = 40) -> tuple[str, float, int]:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(limit_s)
    t0 = time.monotonic()
    got: dict[str, object] = {}

    def reader() -> None:
        try:
            got["r"] = s.recv(4096).decode(errors="replace")
        except OSError as exc:
            got["r"] = f"recv {type(exc).__name__}"
        got["t"] = time.monotonic() - t0

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    sent = 0
    try:
        s.sendall(head)
        for chunk in body:
            if "t" in got or time.monotonic() - t0 > limit_s:
                break
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    th.join(limit_s)
    s.close()
    r = str(got.get("r", "no answer within the limit"))
    return (
        (r.split("\r\n")[0] + " " + r.split("\r\n\r\n", 1)[-1][:120]) if r else "closed",
        float(got.get("t", -1)),
        sent,
    )


def chunked(total: int, size: int = 1 << 16):
    for _ in range(total // size):
        yield f"{size:x}\r\n".encode() + b"x" * size + b"\r\n"
    yield b"0\r\n\r\n"


def slow(n: int):
    for _ in range(n):
        yield b"x"
        time.sleep(1)


r0 = rss()
print("no token, 50 MB chunked to /v1/jobs:", raw(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Transfer-Encoding: chunked\r\n\r\n", chunked(50 << 20)), f"RSS +{rss() - r0} kB")  # fmt: skip
print("no token, 1 byte/s body to /v1/jobs:", raw(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Content-Length: 100\r\n\r\n", slow(100), limit_s=25))  # fmt: skip
print("no token, 1 byte/s body to /api/graph/jobs:", raw(b"POST /api/graph/jobs HTTP/1.1\r\nHost: x\r\n"
      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n", slow(100), limit_s=25))  # fmt: skip
gw.terminate()
gw.wait(timeout=20)
