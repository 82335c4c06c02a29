"""A mock model server for ``bench_agents.py``: real HTTP/1.1 on loopback.

``POST /v1/chat`` streams ``--tokens`` tokens (chunked transfer encoding) over a
latency drawn from a log-normal distribution of mean ``--mean-s``: the first
chunk after a fifth of the latency, the last at its end, ``--chunks`` writes in
all; above ``--limit`` concurrent calls it answers 429 with ``Retry-After``.
``POST /v1/reply`` is the agent's outbound message (its second side effect):
counted once per turn. ``GET /stats`` reports calls, 429s, peak concurrency,
the handlers' start stamps and the replies, for the benchmark to read.

The mock shares the machine with the runner it measures, so every cycle it
spends is taken from the runner: it is a bare ``asyncio.Protocol`` (no web
framework; requests are small, one at a time per connection, as an HTTP/1.1
client without pipelining sends them), and a stream's writes are timer
callbacks, not a task that sleeps between tokens.

Chunks: a real model streams a token every few tens of milliseconds, but what
a turn's stream costs its handler (a wakeup and a read per chunk) is the same
under every runner, so it only lowers every runner's ceiling on a small
machine. Four chunks keep what matters for the runner: a connection held open
and read from for the whole latency, the first bytes well before the end.

    python benchmarks/mock_model.py --port 8765 --mean-s 2 --limit 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import socket
import time
from typing import Any

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"


class Model:
    """Latency, concurrency limit and counters of the mock."""

    def __init__(self, mean_s: float, sigma: float, tokens: int, limit: int, seed: int, chunks: int = 4) -> None:
        self.mean_s = mean_s
        self.sigma = sigma
        # Log-normal with the given mean: mu = ln(mean) - sigma^2 / 2.
        self.mu = math.log(mean_s) - sigma * sigma / 2 if mean_s > 0 else 0.0
        self.tokens = max(1, tokens)
        self.chunks = max(1, min(chunks, self.tokens))
        # The body of each write: the tokens, as evenly split as they go.
        words = [f"tok{i} " for i in range(self.tokens)]
        cuts = [round(i * self.tokens / self.chunks) for i in range(self.chunks + 1)]
        self.bodies = [_chunk("".join(words[a:b]).encode()) for a, b in itertools.pairwise(cuts)]
        self.limit = limit
        self.rng = random.Random(seed)
        self.reset()

    def reset(self) -> None:
        self.active = 0
        self.peak = 0
        self.calls = 0
        self.rejected = 0
        self.drawn = 0.0
        self.starts: list[tuple[str, float, float]] = []  # (job, submitted_at, started_at)
        self.replies: dict[str, float] = {}  # job -> first reply time
        self.aborts: dict[str, float] = {}  # job -> when its client dropped the stream

    def latency(self) -> float:
        if self.mean_s <= 0:
            return 0.0
        return self.rng.lognormvariate(self.mu, self.sigma) if self.sigma > 0 else self.mean_s

    def stats(self, full: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "calls": self.calls,
            "rejected": self.rejected,
            "peak": self.peak,
            "active": self.active,
            "drawn_mean_s": self.drawn / max(1, self.calls - self.rejected),
            "replies": len(self.replies),
        }
        if full:
            out["starts"] = self.starts
            out["reply_times"] = sorted(self.replies.values())
            out["aborts"] = self.aborts
        return out


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: str, body: Any, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n{extra}\r\n"
    return head.encode() + data


class Conn(asyncio.Protocol):
    """One client connection: requests in order, a streamed answer at a time."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        #: The pending write of the stream in progress (None: no stream).
        self.timer: asyncio.TimerHandle | None = None
        self.job = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        # A client that gave up mid-stream (a cancelled turn) frees its slot.
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self.model.active -= 1
            self.model.aborts.setdefault(self.job, time.time())
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.timer is None:  # the next request waits for the stream's end
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4 : end + 4 + length], self.buf[end + 4 + length :]
            method, target = lines[0].split(" ", 2)[:2]
            self.handle(method, target, body)

    def handle(self, method: str, target: str, body: bytes) -> None:
        assert self.transport is not None
        model = self.model
        path, _, query = target.partition("?")
        if method == "POST" and path == "/v1/chat":
            self.chat(json.loads(body))
        elif method == "POST" and path == "/v1/reply":
            job = str(json.loads(body)["job"])
            model.replies.setdefault(job, time.time())
            self.transport.write(_response("200 OK", {"id": f"msg-{job}"}))
        elif method == "GET" and path == "/stats":
            self.transport.write(_response("200 OK", model.stats(full="full=" in query)))
        elif method == "POST" and path == "/reset":
            model.reset()
            self.transport.write(_response("200 OK", {"ok": True}))
        else:
            self.transport.write(_response("404 Not Found", {"error": path}))

    def chat(self, body: dict[str, Any]) -> None:
        assert self.transport is not None
        model = self.model
        model.calls += 1
        if model.limit and model.active >= model.limit:
            model.rejected += 1
            self.transport.write(_response("429 Too Many Requests", {"error": "rate limited"}, "Retry-After: 1\r\n"))
            return
        if body.get("attempt_start"):
            model.starts.append((str(body["job"]), float(body["submitted_at"]), float(body["started_at"])))
        self.job = str(body.get("job", ""))
        model.active += 1
        model.peak = max(model.peak, model.active)
        total = model.latency()
        model.drawn += total
        self.transport.write(STREAM_HEAD)
        loop = asyncio.get_running_loop()
        start = loop.time()
        # The first chunk after a fifth of the latency, the rest evenly after it.
        n = len(model.bodies)
        at = [start + total * (0.2 + 0.8 * i / max(1, n - 1)) for i in range(n)] if n > 1 else [start + total]
        self.timer = loop.call_at(at[0], self._write, loop, at, 0)

    def _write(self, loop: asyncio.AbstractEventLoop, at: list[float], i: int) -> None:
        transport = self.transport
        if transport is None:
            return
        bodies = self.model.bodies
        if i + 1 < len(bodies):
            transport.write(bodies[i])
            self.timer = loop.call_at(at[i + 1], self._write, loop, at, i + 1)
            return
        transport.write(bodies[i] + b"0\r\n\r\n")
        self.timer = None
        self.model.active -= 1
        if self.buf:  # a request that came in during the stream
            self.data_received(b"")


async def serve(model: Model, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(model), "127.0.0.1", port, backlog=16384, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mean-s", type=float, default=2.0, help="mean latency of a call")
    parser.add_argument("--sigma", type=float, default=0.25, help="log-normal sigma of the latency")
    parser.add_argument("--tokens", type=int, default=16, help="tokens streamed per call")
    parser.add_argument("--chunks", type=int, default=4, help="writes a call's tokens are streamed in")
    parser.add_argument("--limit", type=int, default=0, help="429 above this many concurrent calls (0: none)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    model = Model(args.mean_s, args.sigma, args.tokens, args.limit, args.seed, args.chunks)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(model, args.port))


if __name__ == "__main__":
    main()
