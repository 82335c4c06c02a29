"""Gateway submission over HTTP against in-process ``Dispatcher.submit``, on
the same SQLite store, in one run on one machine.

a) throughput: ``--clients`` keep-alive HTTP clients posting ``/v1/jobs`` to a
   real ``agentdispatch gateway`` subprocess (bearer auth on), against the same
   number of threads calling ``Dispatcher.submit`` in this process; prints
   ``ratio = http / in-process`` (target >= 0.3);
b) latency: an open-loop schedule of ``--rate`` requests/s for ``--seconds``,
   latency measured from each request's *scheduled* start (no coordinated
   omission); prints p50 / p99 / max (target p99 < 50 ms on SQLite).

No assertion on time: the figures are the output.

    python benchmarks/bench_gateway.py --requests 3000 --clients 8 --rate 200 --seconds 10
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from agentdispatch import Dispatcher, Submission, load_settings, open_backends
from agentdispatch.gateway.auth import mint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parallel(n_threads: int, total: int, one: Callable[[int, int], None]) -> float:
    """Run ``total`` calls of ``one(thread, i)`` over ``n_threads``; seconds taken."""
    per = [total // n_threads + (1 if t < total % n_threads else 0) for t in range(n_threads)]
    start = threading.Barrier(n_threads + 1)

    def run(t: int) -> None:
        start.wait()
        for i in range(per[t]):
            one(t, i)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def _start_gateway(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentdispatch", "gateway", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("gateway did not start")


def _post(conn: http.client.HTTPConnection, headers: dict[str, str], body: dict[str, object]) -> None:
    conn.request("POST", "/v1/jobs", body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    data = r.read()
    assert r.status == 202, data


def _latency(port: int, headers: dict[str, str], rate: float, seconds: float, clients: int) -> list[float]:
    """Open loop: request k is due at t0 + k / rate; latency counts from then."""
    total = int(rate * seconds)
    lat: list[float] = []
    lock = threading.Lock()
    t0 = time.perf_counter() + 0.2

    def run(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for k in range(c, total, clients):
            due = t0 + k / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            _post(conn, headers, {"kind": "echo", "payload": {"k": k}})
            done = time.perf_counter()
            with lock:
                lat.append(done - due)
        conn.close()

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(lat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="submissions per throughput run")
    ap.add_argument("--clients", type=int, default=8, help="concurrent keep-alive clients / threads")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second for the latency run")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-gw-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_DISPATCH_", "TASK_QUEUE", "STATE_DB"))}
        env.update(
            AGENT_DISPATCH_DATA_DIR=str(Path(tmp) / "data"),
            TASK_QUEUE_BACKEND="sqlite",
            AGENT_DISPATCH_MAX_DEPTH="10000000",
        )
        settings = load_settings(
            AGENT_DISPATCH_DATA_DIR=env["AGENT_DISPATCH_DATA_DIR"],
            TASK_QUEUE_BACKEND="sqlite",
            AGENT_DISPATCH_MAX_DEPTH=10_000_000,
        )
        store, transport = open_backends(settings)
        dispatcher = Dispatcher(store, transport, settings)
        _, token = mint(store, "bench")
        port = _free_port()
        proc = _start_gateway(env, port)
        headers = {"Authorization": f"Bearer {token}"}
        try:
            n, c = args.requests, args.clients
            inproc = _parallel(c, n, lambda t, i: dispatcher.submit(Submission(kind="echo", payload={"i": i})))
            single = _parallel(1, n // 4, lambda t, i: dispatcher.submit(Submission(kind="echo", payload={"i": i})))

            # http.client: a thin keep-alive client, so the figure is the gateway's, not the client's.
            clients = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(c)]
            send = {**headers, "Content-Type": "application/json"}

            def post(t: int, i: int) -> None:
                _post(clients[t], send, {"kind": "echo", "payload": {"i": i}})

            _parallel(c, min(200, n), post)  # warm-up: thread pool, connections, caches
            http_s = _parallel(c, n, post)
            for cl in clients:
                cl.close()
            lat = _latency(port, send, args.rate, args.seconds, c)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            transport.close()
            store.close()

    in_rate, one_rate, http_rate = n / inproc, (n // 4) / single, n / http_s
    print(f"submissions: {n} with {c} threads/clients on SQLite (durable commit per submit)")
    print(f"  in-process Dispatcher.submit, {c} threads: {in_rate:8.0f} /s")
    print(f"  in-process Dispatcher.submit, 1 thread:   {one_rate:8.0f} /s")
    print(f"  HTTP POST /v1/jobs, {c} keep-alive clients: {http_rate:8.0f} /s")
    print(f"  ratio http / in-process ({c} threads) = {http_rate / in_rate:.2f}   (target >= 0.3)")
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000  # noqa: E731
    print(f"latency at {args.rate:.0f} req/s for {args.seconds:.0f} s ({len(lat)} requests, open loop):")
    print(
        f"  p50 {p(0.50):.1f} ms  p90 {p(0.90):.1f} ms  p99 {p(0.99):.1f} ms  max {lat[-1] * 1000:.1f} ms"
        f"  mean {statistics.fmean(lat) * 1000:.1f} ms   (target p99 < 50 ms)"
    )


if __name__ == "__main__":
    main()
