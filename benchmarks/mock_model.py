"""A mock model server for ``bench_agents.py``: real HTTP on loopback.

``POST /v1/chat`` streams ``--tokens`` tokens over a latency drawn from a
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
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


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


def build(model: Model) -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.json()
        model.calls += 1
        if model.limit and model.active >= model.limit:
            model.rejected += 1
            return JSONResponse({"error": "rate limited"}, status_code=429, headers={"Retry-After": "1"})
        if body.get("attempt_start"):
            model.starts.append((str(body["job"]), float(body["submitted_at"]), float(body["started_at"])))
        model.active += 1
        model.peak = max(model.peak, model.active)
        total = model.latency()
        model.drawn += total

        async def stream() -> AsyncIterator[bytes]:
            try:
                # A first token after a fifth of the latency, the rest evenly after it.
                await asyncio.sleep(total * 0.2)
                step = total * 0.8 / max(1, model.tokens - 1)
                for i in range(model.tokens):
                    if i:
                        await asyncio.sleep(step)
                    yield f"tok{i} ".encode()
            finally:
                model.active -= 1

        return StreamingResponse(stream(), media_type="text/plain")

    async def reply(request: Request) -> Response:
        body = await request.json()
        model.replies.setdefault(str(body["job"]), time.time())
        return JSONResponse({"id": f"msg-{body['job']}"})

    async def stats(request: Request) -> Response:
        out: dict[str, Any] = {
            "calls": model.calls,
            "rejected": model.rejected,
            "peak": model.peak,
            "active": model.active,
            "drawn_mean_s": model.drawn / max(1, model.calls - model.rejected),
            "replies": len(model.replies),
        }
        if request.query_params.get("full"):
            out["starts"] = model.starts
            out["reply_times"] = sorted(model.replies.values())
        return JSONResponse(out)

    async def reset(request: Request) -> Response:
        model.reset()
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/chat", chat, methods=["POST"]),
            Route("/v1/reply", reply, methods=["POST"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/reset", reset, methods=["POST"]),
        ]
    )


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
    uvicorn.run(
        build(model),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        backlog=16384,
        timeout_keep_alive=120,
    )


if __name__ == "__main__":
    main()
