"""A mock model server for ``bench_agents.py``: real HTTP on loopback.

Served by aiohttp. ``POST /v1/chat`` streams ``--tokens`` tokens over a latency drawn from a
log-normal distribution of mean ``--mean-s``; above ``--limit`` concurrent
calls it answers 429 with ``Retry-After``. ``POST /v1/reply`` is the agent's
outbound message (its second side effect): counted once per turn. ``GET
/stats`` reports calls, 429s, peak concurrency, the handlers' start stamps
and the replies, for the benchmark to read.

    python benchmarks/mock_model.py --port 8765 --mean-s 2 --limit 1000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from typing import Any

from aiohttp import web


class Model:
    """Latency, concurrency limit and counters of the mock."""

    def __init__(self, mean_s: float, sigma: float, tokens: int, limit: int, seed: int) -> None:
        self.mean_s = mean_s
        self.sigma = sigma
        # Log-normal with the given mean: mu = ln(mean) - sigma^2 / 2.
        self.mu = math.log(mean_s) - sigma * sigma / 2 if mean_s > 0 else 0.0
        self.tokens = tokens
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

    def latency(self) -> float:
        if self.mean_s <= 0:
            return 0.0
        return self.rng.lognormvariate(self.mu, self.sigma) if self.sigma > 0 else self.mean_s


def build(model: Model) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model.calls += 1
        if model.limit and model.active >= model.limit:
            model.rejected += 1
            return web.json_response({"error": "rate limited"}, status=429, headers={"Retry-After": "1"})
        if body.get("attempt_start"):
            model.starts.append((str(body["job"]), float(body["submitted_at"]), float(body["started_at"])))
        model.active += 1
        model.peak = max(model.peak, model.active)
        total = model.latency()
        model.drawn += total
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            # A first token after a fifth of the latency, the rest evenly after it.
            await asyncio.sleep(total * 0.2)
            step = total * 0.8 / max(1, model.tokens - 1)
            for i in range(model.tokens):
                if i:
                    await asyncio.sleep(step)
                await resp.write(f"tok{i} ".encode())
            await resp.write_eof()
            return resp
        finally:
            model.active -= 1

    async def reply(request: web.Request) -> web.Response:
        body = await request.json()
        model.replies.setdefault(str(body["job"]), time.time())
        return web.json_response({"id": f"msg-{body['job']}"})

    async def stats(request: web.Request) -> web.Response:
        out: dict[str, Any] = {
            "calls": model.calls,
            "rejected": model.rejected,
            "peak": model.peak,
            "active": model.active,
            "drawn_mean_s": model.drawn / max(1, model.calls - model.rejected),
            "replies": len(model.replies),
        }
        if request.query.get("full"):
            out["starts"] = model.starts
            out["reply_times"] = sorted(model.replies.values())
        return web.json_response(out)

    async def reset(request: web.Request) -> web.Response:
        model.reset()
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/chat", chat),
            web.post("/v1/reply", reply),
            web.get("/stats", stats),
            web.post("/reset", reset),
        ]
    )
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mean-s", type=float, default=2.0, help="mean latency of a call")
    parser.add_argument("--sigma", type=float, default=0.25, help="log-normal sigma of the latency")
    parser.add_argument("--tokens", type=int, default=16, help="tokens streamed per call")
    parser.add_argument("--limit", type=int, default=0, help="429 above this many concurrent calls (0: none)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    model = Model(args.mean_s, args.sigma, args.tokens, args.limit, args.seed)
    # aiohttp's server parses HTTP in C: the mock's CPU per call stays well
    # below the runners' (uvicorn without httptools parses in pure Python).
    web.run_app(
        build(model),
        host="127.0.0.1",
        port=args.port,
        backlog=16384,
        keepalive_timeout=120,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
