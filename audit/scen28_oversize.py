"""Scenario 28 (oversize bodies), the parts audit/check4*.py leave out: the
size check runs before the signature check (an unsigned oversize body is 413,
not 401/403), and M senders at once each stream a 50 MB body (half with a
Content-Length, half chunked) as fast as loopback takes it: every one gets
413, how many bytes the gateway took from each before cutting it off, and the
gateway's peak RSS growth against M x the 1 MiB limit.

    M=100 python audit/scen28_oversize.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from intake.kit import ACCOUNT, APP, TG_BOT, gateway, install_all, slack_headers

M = int(os.environ.get("M", "100"))
MIB = 1 << 20
data = Path(tempfile.mkdtemp(prefix="scen28-")) / "data"
install_all(data)
gw = gateway(data, AGENT_DISPATCH_INTAKE_BODY_TIMEOUT_S="5")
port = gw.port


def status(key: str) -> int:
    for line in Path(f"/proc/{gw.proc.pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return -1


failures: list[str] = []

# A. Size before signature: 1.5 MiB bodies (under the gateway's 2 MiB API cap,
# over intake's 1 MiB) with no or a wrong signature.
big = b'{"pad":"' + b"x" * (MIB + MIB // 2) + b'"}'


def chunked(body: bytes):
    for i in range(0, len(body), 64 * 1024):
        yield body[i : i + 64 * 1024]


with httpx.Client(base_url=gw.url, timeout=20) as c:
    cases = {
        "slack wrong signature, Content-Length": lambda: c.post(
            f"/intake/slack/{APP}", content=big, headers=slack_headers(b"other")
        ),
        "slack wrong signature, chunked": lambda: c.post(
            f"/intake/slack/{APP}", content=chunked(big), headers=slack_headers(b"other")
        ),
        "telegram no secret, chunked": lambda: c.post(f"/intake/telegram/{TG_BOT}", content=chunked(big)),
        "twilio no signature, Content-Length": lambda: c.post(f"/intake/twilio/{ACCOUNT}/sms", content=big),
    }
    for name, send in cases.items():
        try:
            code = send().status_code
        except httpx.HTTPError as exc:  # cut off while still sending: no answer read
            code = type(exc).__name__  # type: ignore[assignment]
        print(f"{'ok ' if code == 413 else 'BAD'} size before auth: {name}: {code}")
        if code != 413:
            failures.append(name)


# B. M oversize senders at once, full speed.
async def sender(i: int) -> tuple[str, int]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    path = f"/intake/telegram/{TG_BOT}"
    if i % 2:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        piece = b"%x\r\n" % (64 * 1024) + b"x" * (64 * 1024) + b"\r\n"
    else:
        # Declared 1 MiB (passes the declared-size check) but 50 MB follow:
        # the excess is read as the next request, so use an honest 50 MB head
        # for half and the chunked form for the other half.
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {50 * 1000 * 1000}\r\n\r\n".encode()
        piece = b"x" * (64 * 1024)
    reader = asyncio.ensure_future(r.read(300))
    sent = 0
    w.write(head)
    try:
        while sent < 50 * 1000 * 1000 and not reader.done():
            w.write(piece)
            await w.drain()
            sent += len(piece)
    except OSError:
        pass
    try:
        resp = await asyncio.wait_for(reader, 30)
    except (TimeoutError, OSError) as exc:
        resp = f"none {type(exc).__name__}".encode()
    w.close()
    kind = "chunked" if i % 2 else "declared 50 MB"
    return f"{kind}: " + resp.split(b"\r\n")[0].decode(errors="replace"), sent


async def storm() -> None:
    rss0, hwm0 = status("VmRSS:"), status("VmHWM:")
    peak = [rss0]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], status("VmRSS:"))
            await asyncio.sleep(0.05)

    sampler = asyncio.ensure_future(sample())
    t0 = time.monotonic()
    outs = await asyncio.gather(*(sender(i) for i in range(M)))
    took = time.monotonic() - t0
    sampler.cancel()
    codes = Counter(o[0] for o in outs)
    sent = sorted(o[1] for o in outs)
    print(f"{M} x 50 MB senders at once: answers {dict(codes)} in {took:.1f} s")
    print(f"bytes each sender got out before the cut: median {sent[len(sent) // 2] / MIB:.2f} MiB, "
          f"max {sent[-1] / MIB:.2f} MiB (includes socket buffers of both sides)")  # fmt: skip
    growth = peak[0] - rss0
    print(f"gateway RSS {rss0} kB -> sampled peak {peak[0]} kB (+{growth} kB = {growth / 1024 / M:.2f} MiB per sender;"
          f" VmHWM {hwm0} -> {status('VmHWM:')} kB); after: {status('VmRSS:')} kB")  # fmt: skip
    if any("413" not in k for k in codes):
        failures.append("storm answers")


asyncio.run(storm())
with httpx.Client(base_url=gw.url, timeout=10) as c:
    alive = c.get("/healthz").status_code
print(f"gateway still answers: {alive}")
gw.stop()
print("FAIL " + ", ".join(failures) if failures else "PASS")
sys.exit(1 if failures else 0)
