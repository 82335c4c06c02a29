"""Agent turns in flight: agentdispatch against Celery and Procrastinate, one run.

Every system runs the same ``async def`` handler (``agents_app.agent_turn``): a
streamed call (aiohttp; ``BENCH_CLIENT=httpx`` for httpx) to a mock model server on
loopback (aiohttp; real HTTP; latency drawn from a log-normal distribution, tokens
streamed, 429 above ``--model-limit`` concurrent calls), then two side effects
through its guard (record the transcript; POST the reply to the mock). Systems,
each with one worker process at the same concurrency, against the same mock server:

* ``bare``: the handler as plain asyncio tasks, no queue (``agents_bare.py``): the
  floor of one process on this machine, measured in the same run;

* ``sqlite`` / ``postgres``: ``agentdispatch worker`` started through its CLI
  (``--concurrency N`` when the CLI has it, else ``--workers N``: threads, at most
  256; ``--cli`` picks), on a fresh SQLite file / a fresh PostgreSQL database;
* ``celery``: a Celery worker, threads pool of N, Redis broker (``--redis``);
* ``procrastinate``: a Procrastinate async worker, concurrency N, on a fresh
  PostgreSQL database.

Per system it measures:

* **goodput**: a backlog of ``--in-flight`` x ``--rounds`` turns is submitted at
  once; goodput is the replies per second in the steady state (from one mean
  latency after the submission ended to the last start, when the backlog is empty),
  against the ideal in-flight / mean latency (the mean the mock actually drew).
  **drain** is the ideal time of the whole backlog over its measured time (ramp
  and the log-normal tail included, so below 1 even for a perfect runner);
* **submit-to-start** p50/p99: for the first wave of the backlog (how fast N
  turns get going) and at light load (``--probes`` turns, one every
  1/``--probe-rate`` s);
* **RSS per in-flight turn**: the worker's peak RSS during the backlog minus its
  RSS when idle, and its whole peak RSS, over the turns in flight at the model's
  peak (a thread pool's stacks exist at idle already); **CPU per turn**: the worker process's user+system time
  over the backlog, per turn (the database's counted apart, the broker's not);
* **transactions per turn** on PostgreSQL (``pg_stat_database.xact_commit``), and
  the **database's CPU per turn**: the user+system time of the PostgreSQL backends
  serving the worker process (the server shares the machine's cores);
* **overload** (``--model-limit``): the ideal capped at the model's limit; the
  model's concurrency, the worker's concurrency limit and the 429s' share in the
  steady state;
* agentdispatch only: **lease renewals** during the backlog (batches, per second,
  worst lateness, from the worker's metrics) and **cancel** latency: ``--cancels``
  running turns cancelled once the first wave has run a mean latency, timed from
  the cancel call to the mock seeing the turn's stream dropped.

No assertion: the figures are the output, with ratios against the ideal and
against agentdispatch in the same run.

    python benchmarks/bench_agents.py                                   # 500 in flight x 2 s
    python benchmarks/bench_agents.py --in-flight 2000 --turn-s 5       # the 2,000 x 5 s target
    python benchmarks/bench_agents.py --in-flight 10000 --turn-s 30 --rounds 2 --systems sqlite,postgres
    python benchmarks/bench_agents.py --model-limit 500                 # the overload case
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PG_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"


# -- process and measurement helpers ---------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_s(pid: int) -> float:
    """User + system seconds of a process (its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def http_json(url: str, method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def child_env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Mock:
    """The mock model server, a process of its own."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, str(HERE / "mock_model.py"), "--port", str(self.port), "--mean-s", str(args.turn_s),
            "--sigma", str(args.sigma), "--tokens", str(args.tokens), "--chunks", str(args.chunks),
            "--limit", str(args.model_limit),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=child_env({}))
        deadline = time.monotonic() + 30
        while True:
            try:
                self.stats()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the mock model server did not start") from None
                time.sleep(0.1)

    def stats(self, full: bool = False) -> dict[str, Any]:
        return dict(http_json(f"{self.url}/stats" + ("?full=1" if full else "")))

    def reset(self) -> None:
        http_json(f"{self.url}/reset", method="POST")

    def close(self) -> None:
        stop(self.proc, 5)


# -- systems -----------------------------------------------------------------------
@dataclass
class System:
    """How to prepare, start and feed one system."""

    name: str
    env: dict[str, str]
    start: Callable[[], subprocess.Popen[bytes]]
    submit: Callable[[list[tuple[str, dict[str, Any]]]], None]
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    pg_db: str | None = None
    note: str = ""
    #: Turns it can run at once (below ``--in-flight`` where a runner caps it).
    concurrency: int = 0
    #: Cancel a job (agentdispatch only: the others cannot stop a running turn).
    cancel: Callable[[str], None] | None = None
    #: The worker's Prometheus endpoint (agentdispatch only).
    metrics_url: str | None = None


def fresh_database(base: str, cleanup: list[Callable[[], None]]) -> tuple[str, str]:
    import psycopg

    name = "bench_" + uuid.uuid4().hex[:10]
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    cleanup.append(drop)
    return base.rsplit("/", 1)[0] + "/" + name, name


def worker_cli_flag(args: argparse.Namespace) -> tuple[list[str], str, int]:
    """``--concurrency N`` when the CLI offers it (or ``--cli concurrency``), else threads."""
    mode = args.cli
    if mode == "auto":
        out = subprocess.run(
            [sys.executable, "-m", "agentdispatch", "worker", "--help"],
            capture_output=True,
            text=True,
            env=child_env({}),
            check=False,
        ).stdout
        mode = "concurrency" if "--concurrency" in out else "workers"
    if mode == "concurrency":
        return ["--concurrency", str(args.in_flight)], f"--concurrency {args.in_flight}", args.in_flight
    threads = min(args.in_flight, 256)
    how = "threads" if args.cli == "workers" else "threads; the CLI has no --concurrency"
    return ["--workers", str(threads)], f"--workers {threads} ({how})", threads


def agentdispatch_system(name: str, args: argparse.Namespace, tmp: Path) -> System:
    from agentdispatch import Dispatcher, Submission, load_settings, open_backends

    cleanup: list[Callable[[], None]] = []
    env = {
        "AGENT_DISPATCH_APP": "agents_app:registry",
        "AGENT_DISPATCH_MAX_DEPTH": "10000000",
        "AGENT_DISPATCH_LOG_LEVEL": "WARNING",
    }
    pg_db = None
    if name == "postgres":
        uri, pg_db = fresh_database(args.pg, cleanup)
        env.update(TASK_QUEUE_BACKEND="postgres", STATE_DB_URI=uri)
    else:
        env.update(TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_DATA_DIR=str(tmp / "sqlite"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = load_settings()
        store, transport = open_backends(settings, migrate=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    dispatcher = Dispatcher(store, transport, settings)

    def close() -> None:
        transport.close()
        store.close()

    cleanup.insert(0, close)
    flag, note, concurrency = worker_cli_flag(args)
    metrics_port = free_port()

    def start() -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "agentdispatch", "worker", *flag, "--grace", "5"]
        cmd += ["--metrics-port", str(metrics_port)]
        return subprocess.Popen(cmd, env=child_env(env))

    def cancel(job_id: str) -> None:
        dispatcher.cancel(job_id, "bench", "cancel probe")

    def submit(turns: list[tuple[str, dict[str, Any]]]) -> None:
        subs = [Submission(kind="agent", tenant="bench", job_id=j, payload=p) for j, p in turns]
        for i in range(0, len(subs), 1000):
            dispatcher.submit_many(subs[i : i + 1000])

    return System(
        f"agentdispatch-{name}", env, start, submit, cleanup, pg_db, note, concurrency, cancel,
        f"http://127.0.0.1:{metrics_port}/metrics",
    )  # fmt: skip


def celery_system(args: argparse.Namespace) -> System:
    import redis

    broker = args.redis
    redis.Redis.from_url(broker).flushdb()
    env = {"BENCH_CELERY_BROKER": broker}
    os.environ["BENCH_CELERY_BROKER"] = broker
    sys.path.insert(0, str(HERE))
    import agents_celery

    def start() -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "celery", "-A", "agents_celery", "worker", "--pool", "threads",
            "--concurrency", str(args.in_flight), "--loglevel", "WARNING", "--without-gossip",
            "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        return subprocess.Popen(cmd, env=child_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def submit(turns: list[tuple[str, dict[str, Any]]]) -> None:
        with agents_celery.app.producer_or_acquire() as producer:
            for j, p in turns:
                agents_celery.agent.apply_async((j, p), producer=producer)

    note = f"threads pool x {args.in_flight}, Redis broker"
    return System("celery-threads", env, start, submit, note=note, concurrency=args.in_flight)


def bare_system(args: argparse.Namespace) -> System:
    """The handler as plain asyncio tasks fed over a pipe: the floor."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        cmd = [sys.executable, str(HERE / "agents_bare.py"), "--in-flight", str(args.in_flight)]
        proc = subprocess.Popen(cmd, env=child_env({}), stdin=subprocess.PIPE)
        procs.append(proc)
        return proc

    def submit(turns: list[tuple[str, dict[str, Any]]]) -> None:
        stdin = procs[-1].stdin
        assert stdin is not None
        stdin.write(b"".join(json.dumps([j, p]).encode() + b"\n" for j, p in turns))
        stdin.flush()

    note = f"asyncio tasks, at most {args.in_flight} at once; no queue, lease or ledger"
    return System("bare-asyncio", {}, start, submit, note=note, concurrency=args.in_flight)


def procrastinate_system(args: argparse.Namespace) -> System:
    cleanup: list[Callable[[], None]] = []
    uri, db = fresh_database(args.pg, cleanup)
    env = {"BENCH_PROCRASTINATE_DSN": uri}
    os.environ["BENCH_PROCRASTINATE_DSN"] = uri
    sys.path.insert(0, str(HERE))
    import agents_procrastinate

    async def schema() -> None:
        async with agents_procrastinate.app.open_async():
            await agents_procrastinate.app.schema_manager.apply_schema_async()

    asyncio.run(schema())

    def start() -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "procrastinate", "--app", "agents_procrastinate.app", "--log-level", "warning",
            "worker", "--concurrency", str(args.in_flight),
        ]  # fmt: skip
        return subprocess.Popen(cmd, env=child_env(env), stdout=subprocess.DEVNULL)

    def submit(turns: list[tuple[str, dict[str, Any]]]) -> None:
        async def go() -> None:
            async with agents_procrastinate.app.open_async():
                for i in range(0, len(turns), 1000):
                    chunk = turns[i : i + 1000]
                    await agents_procrastinate.agent.batch_defer_async(*[{"job_id": j, "payload": p} for j, p in chunk])

        asyncio.run(go())

    note = f"async worker, concurrency {args.in_flight}"
    return System("procrastinate", env, start, submit, cleanup, db, note, args.in_flight)


# -- one system's run --------------------------------------------------------------------
def xact_commits(base: str, db: str | None) -> int:
    if db is None:
        return 0
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (db,)).fetchone()
    return int(row[0]) if row else 0


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of a process's sockets (from /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def backend_cpu(base: str, db: str | None, client_pid: int) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving ``client_pid`` on ``db``
    (the server runs on this machine: its share of the cores is the worker's
    cost too; the submitting process's backends are not counted)."""
    if db is None:
        return {}
    import psycopg

    ports = local_ports(client_pid)
    with psycopg.connect(base, autocommit=True) as conn:
        rows = conn.execute("SELECT pid, client_port FROM pg_stat_activity WHERE datname = %s", (db,)).fetchall()
    return {int(pid): cpu_s(int(pid)) for pid, port in rows if port in ports}


def wait_replies(
    mock: Mock,
    want: int | Callable[[], int],
    timeout_s: float,
    pid: int,
    peak: list[int],
    *,
    cut: bool = False,
    on_poll: Callable[[dict[str, Any]], None] | None = None,
) -> bool:
    """Until ``want`` replies came (True); past ``timeout_s`` False with ``cut``,
    else TimeoutError. ``on_poll`` sees the mock's stats at each poll."""
    deadline = time.monotonic() + timeout_s
    while True:
        peak[0] = max(peak[0], rss_kib(pid))
        stats = mock.stats()
        if on_poll is not None:
            on_poll(stats)
        if stats["replies"] >= (want() if callable(want) else want):
            return True
        if time.monotonic() > deadline:
            if cut:
                return False
            raise TimeoutError(f"{mock.stats()['replies']} of {want} replies after {timeout_s:.0f} s")
        time.sleep(0.2)


METRIC = "agent_utilities_dispatch_"


def scrape(url: str | None) -> dict[str, float]:
    """The worker's Prometheus samples by name (labels included in the name)."""
    if url is None:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


class Sampler:
    """What the backlog looks like while it runs: the model's concurrency at each
    poll, the worker's concurrency limit (once a second), and the cancel probe:
    once the first wave has run a mean latency, ``--cancels`` turns that started
    most recently (within half a mean latency) are cancelled, and the mock tells
    when each one's stream was dropped."""

    def __init__(self, sysm: System, mock: Mock, args: argparse.Namespace, t1: float) -> None:
        self.sysm, self.mock, self.args = sysm, mock, args
        self.active: list[tuple[float, int]] = []
        self.calls: list[tuple[float, int, int]] = []  # (when, calls, 429s so far)
        self.limits: list[tuple[float, float]] = []
        self.cancelled: dict[str, float] = {}  # job -> when its cancel was asked for
        self.cancel_at = t1 + args.turn_s + 1.0 if sysm.cancel is not None and args.cancels else float("inf")
        self.next_scrape = 0.0

    def __call__(self, stats: dict[str, Any]) -> None:
        now = time.time()
        self.active.append((now, int(stats["active"])))
        self.calls.append((now, int(stats["calls"]), int(stats["rejected"])))
        if self.sysm.metrics_url is not None and now >= self.next_scrape:
            self.next_scrape = now + 1.0
            limit = scrape(self.sysm.metrics_url).get(METRIC + "concurrency_limit")
            if limit is not None:
                self.limits.append((now, limit))
        if now >= self.cancel_at and self.sysm.cancel is not None:
            self.cancel_at = float("inf")
            # The latest starts the mock has seen, within half a mean latency
            # (still running, most of them): on a loaded machine a start reaches
            # the mock a while after the handler stamped it.
            starts = self.mock.stats(full=True)["starts"]
            recent = sorted(((started, job) for job, _, started in starts if job.startswith("b-")), reverse=True)
            horizon = now - max(1.0, self.args.turn_s / 2)
            for _, job in [x for x in recent if x[0] >= horizon][: self.args.cancels]:
                self.cancelled[job] = time.time()
                self.sysm.cancel(job)

    def cancel_latencies(self, aborts: dict[str, float]) -> list[float]:
        return [aborts[j] - t for j, t in self.cancelled.items() if j in aborts]


def turns_of(prefix: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    now = time.time()
    return [(f"{prefix}-{i}", {"submitted_at": now, "i": i}) for i in range(n)]


def run_system(sysm: System, mock: Mock, args: argparse.Namespace) -> dict[str, Any]:
    proc = sysm.start()
    try:
        # Warm up: the worker is up and the handler's clients exist.
        mock.reset()
        sysm.submit(turns_of("warm", 4))
        wait_replies(mock, 4, 120, proc.pid, [0])
        time.sleep(0.5)
        idle_rss = rss_kib(proc.pid)
        mock.reset()
        total = args.in_flight * args.rounds
        m0 = scrape(sysm.metrics_url)
        cpu0, tx0 = cpu_s(proc.pid), xact_commits(args.pg, sysm.pg_db)
        mock_cpu0 = cpu_s(mock.proc.pid)
        pg_cpu0 = backend_cpu(args.pg, sysm.pg_db, proc.pid)
        t0 = time.time()
        backlog = [(f"b-{i}", {"submitted_at": 0.0, "i": i}) for i in range(total)]
        for _, p in backlog:
            p["submitted_at"] = t0
        sysm.submit(backlog)
        t1 = time.time()
        submit_s = t1 - t0
        peak = [idle_rss]
        sampler = Sampler(sysm, mock, args, t1)
        want = lambda: total - len(sampler.cancelled)  # noqa: E731
        drained = wait_replies(mock, want, args.budget_s, proc.pid, peak, cut=True, on_poll=sampler)
        cpu1, mock_cpu1 = cpu_s(proc.pid), cpu_s(mock.proc.pid)
        # Backends opened during the backlog count from zero.
        pg_cpu1 = backend_cpu(args.pg, sysm.pg_db, proc.pid)
        pg_cpu = sum(c - pg_cpu0.get(pid, 0.0) for pid, c in pg_cpu1.items())
        t2 = time.time()
        m1 = scrape(sysm.metrics_url)
        full = mock.stats(full=True)
        done = len(full["reply_times"])
        wall = max(full["reply_times"]) - t0 if drained else float("nan")
        time.sleep(0.6)  # pg_stat_database is flushed about every 500 ms
        tx1 = xact_commits(args.pg, sysm.pg_db)
        first_start: dict[str, float] = {}
        for job, submitted, started in full["starts"]:
            first_start.setdefault(job, started - submitted)
        waits = sorted(first_start.values())
        wave = waits[: args.in_flight]
        # Steady state: from one mean latency after the submission ended (the
        # first wave finishing) to the last start (the backlog empty; or the
        # budget's end): N in flight throughout for a system that keeps up.
        # A turn or two stuck past the budget (a connect retried after a
        # dropped SYN) must not stretch the window: every turn started is enough.
        a = t1 + full["drawn_mean_s"]
        b = t0 + waits[-1] if drained or len(waits) >= total - len(sampler.cancelled) else t1 + args.budget_s
        replies = full["reply_times"]
        if b - a > 0.5 * args.turn_s:
            steady = sum(1 for t in replies if a <= t <= b) / (b - a)
        else:
            steady = done / (max(replies) - t0)
        light: dict[str, float] = {}
        if drained:  # else the probes would queue behind the rest of the backlog
            # Light load: one turn every 1/probe_rate s.
            mock.reset()
            for i in range(args.probes):
                sysm.submit(turns_of(f"p{i}", 1))
                time.sleep(1.0 / args.probe_rate)
            wait_replies(mock, args.probes, 120 + 4 * args.turn_s, proc.pid, [0])
            for job, submitted, started in mock.stats(full=True)["starts"]:
                light.setdefault(job, started - submitted)
        # A model that takes fewer calls at once than the runner runs caps the ideal too.
        ideal = min(args.in_flight, args.model_limit or args.in_flight) / full["drawn_mean_s"]
        own = min(sysm.concurrency, args.model_limit or sysm.concurrency)
        steady_active = [n for t, n in sampler.active if a <= t <= b]
        steady_limits = [n for t, n in sampler.limits if a <= t <= b]
        steady_calls = [(c, r) for t, c, r in sampler.calls if a <= t <= b]
        if len(steady_calls) >= 2:
            (c0, r0), (c1, r1) = steady_calls[0], steady_calls[-1]
            steady_429 = (r1 - r0) / max(1, c1 - c0)
        else:
            steady_429 = float("nan")
        renewals = m1.get(METRIC + "renew_lateness_seconds_count", 0.0) - m0.get(
            METRIC + "renew_lateness_seconds_count", 0.0
        )
        cancel_lat = sampler.cancel_latencies(full["aborts"])
        return {
            "name": sysm.name,
            "goodput": steady,
            "ideal": ideal,
            "ratio": steady / ideal,
            "own_ratio": steady / (own / full["drawn_mean_s"]),
            "drain_ratio": (total * full["drawn_mean_s"] / (ideal * full["drawn_mean_s"])) / wall,
            "wall": wall,
            "done": done,
            "total": total,
            "submit_s": submit_s,
            "wave_p50": pct(wave, 0.5),
            "wave_p99": pct(wave, 0.99),
            "light_p50": pct(list(light.values()), 0.5),
            "light_p99": pct(list(light.values()), 0.99),
            # Per turn actually in flight (the model's peak concurrency): above
            # idle, and the whole process (a thread pool's stacks exist at idle).
            "rss_per_turn_kib": (peak[0] - idle_rss) / max(1, full["peak"]),
            "rss_total_per_turn_kib": peak[0] / max(1, full["peak"]),
            "idle_rss_mib": idle_rss / 1024,
            "cpu_ms_per_turn": 1000 * (cpu1 - cpu0) / total,
            "mock_cpu_ms_per_turn": 1000 * (mock_cpu1 - mock_cpu0) / total,
            "pg_cpu_ms_per_turn": 1000 * pg_cpu / total if sysm.pg_db else None,
            "tx_per_turn": (tx1 - tx0) / total if sysm.pg_db else None,
            "calls": full["calls"],
            "rejected": full["rejected"],
            "peak_model": full["peak"],
            "active_p50": pct([float(n) for n in steady_active], 0.5),
            # The mock is polled at an even pace: the samples' mean is a time average.
            "active_mean": sum(steady_active) / len(steady_active) if steady_active else float("nan"),
            "limit_p50": pct(steady_limits, 0.5),
            "steady_429": steady_429,
            "renewals_per_s": renewals / max(1e-9, t2 - t0) if sysm.metrics_url else None,
            "renewal_batches": renewals,
            "renew_late_max_s": m1.get(METRIC + "renew_lateness_max_seconds"),
            "cancels": len(sampler.cancelled),
            "cancel_p50": pct(cancel_lat, 0.5),
            "cancel_p99": pct(cancel_lat, 0.99),
            "cancel_stopped": len(cancel_lat),
            "note": sysm.note,
        }
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, default=500, help="worker concurrency (turns in flight)")
    parser.add_argument("--turn-s", type=float, default=2.0, help="mean model latency per turn")
    parser.add_argument("--rounds", type=int, default=3, help="backlog = in-flight x rounds turns")
    parser.add_argument("--sigma", type=float, default=0.25, help="log-normal sigma of the latency")
    parser.add_argument("--tokens", type=int, default=16, help="tokens streamed per call")
    parser.add_argument("--chunks", type=int, default=4, help="writes a call's tokens are streamed in")
    parser.add_argument("--model-limit", type=int, default=0, help="mock answers 429 above this concurrency (0: none)")
    parser.add_argument(
        "--systems", default="bare,sqlite,postgres,celery,procrastinate", help="bare: the handler with no queue"
    )
    parser.add_argument("--cli", choices=("auto", "concurrency", "workers"), default="auto")
    parser.add_argument("--probes", type=int, default=40, help="light-load turns for submit-to-start")
    parser.add_argument("--cancels", type=int, default=20, help="running turns cancelled during the backlog")
    parser.add_argument("--probe-rate", type=float, default=20.0, help="light-load turns per second")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop waiting for a system's backlog after this; goodput so far (default: max(45, 3 x rounds x turn-s))",
    )
    parser.add_argument("--pg", default=os.environ.get("AGENTDISPATCH_BENCH_PG", PG_DEFAULT))
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15", help="Celery broker (its db is flushed)")
    args = parser.parse_args()
    if args.budget_s is None:
        args.budget_s = max(45.0, 3 * args.rounds * args.turn_s)

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit: sockets per turn
    mock = Mock(args)
    os.environ["BENCH_MODEL_URL"] = mock.url
    print(
        f"bench_agents: {args.in_flight} in flight, turns of {args.turn_s:g} s mean (log-normal sigma {args.sigma:g}, "
        f"{args.tokens} tokens streamed in {args.chunks} chunks), backlog {args.in_flight * args.rounds}, model limit "
        f"{args.model_limit or 'none'}, python {sys.version.split()[0]}, {os.cpu_count()} cores"
    )
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in [s.strip() for s in args.systems.split(",") if s.strip()]:
                if name in ("sqlite", "postgres"):
                    sysm = agentdispatch_system(name, args, Path(tmp))
                elif name == "celery":
                    sysm = celery_system(args)
                elif name == "procrastinate":
                    sysm = procrastinate_system(args)
                elif name == "bare":
                    sysm = bare_system(args)
                else:
                    raise SystemExit(f"unknown system {name!r}")
                try:
                    print(f"  running {sysm.name} ({sysm.note}) ...", flush=True)
                    results.append(run_system(sysm, mock, args))
                except (TimeoutError, RuntimeError) as exc:
                    print(f"  {sysm.name}: FAILED: {exc}", flush=True)
                finally:
                    for fn in sysm.cleanup:
                        fn()
    finally:
        mock.close()
    report(results, args)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    head = (
        f"{'system':<22} {'goodput/s':>9} {'ideal/s':>8} {'x ideal':>7} {'drain':>5} {'wave p50/p99 s':>15} "
        f"{'light p50/p99 ms':>17} {'KiB/turn':>13} {'CPU ms/turn':>11} {'DB ms':>5} {'tx/turn':>7} {'429s':>6}"
    )
    print(head)
    for r in results:
        tx = "-" if r["tx_per_turn"] is None else f"{r['tx_per_turn']:.1f}"
        db = "-" if r["pg_cpu_ms_per_turn"] is None else f"{r['pg_cpu_ms_per_turn']:.2f}"
        print(
            f"{r['name']:<22} {r['goodput']:9.1f} {r['ideal']:8.1f} {r['ratio']:7.2f} {r['drain_ratio']:5.2f} "
            f"{r['wave_p50']:7.2f}/{r['wave_p99']:<7.2f} "
            f"{1000 * r['light_p50']:8.0f}/{1000 * r['light_p99']:<8.0f} "
            f"{r['rss_per_turn_kib']:6.0f}/{r['rss_total_per_turn_kib']:<6.0f} {r['cpu_ms_per_turn']:11.2f} "
            f"{db:>5} {tx:>7} "
            f"{100 * r['rejected'] / max(1, r['calls']):5.1f}%"
        )
    for r in results:
        print(
            f"  {r['name']}: {r['note']}; x ideal at its own concurrency {r['own_ratio']:.2f}; "
            f"idle RSS {r['idle_rss_mib']:.0f} MiB, backlog submitted in "
            f"{r['submit_s']:.2f} s, {r['done']} of {r['total']} done in {r['wall']:.2f} s (nan: cut at --budget-s), "
            f"peak model concurrency {r['peak_model']}, mock CPU {r['mock_cpu_ms_per_turn']:.2f} ms/turn; "
            f"steady state: model concurrency p50 {r['active_p50']:.0f} mean {r['active_mean']:.0f}, "
            f"worker limit p50 {r['limit_p50']:.0f}, "
            f"429s {100 * r['steady_429']:.1f}% of calls"
        )
        if r["renewals_per_s"] is not None:
            late = r["renew_late_max_s"]
            print(
                f"    renewals: {r['renewal_batches']:.0f} batches, {r['renewals_per_s']:.3f}/s over the backlog, "
                f"worst lateness {'-' if late is None else f'{late:.3f} s'}; cancel probe: "
                f"{r['cancel_stopped']} of {r['cancels']} running turns stopped, "
                f"p50/p99 {r['cancel_p50']:.2f}/{r['cancel_p99']:.2f} s from the cancel call"
            )
    ours = [r for r in results if r["name"].startswith("agentdispatch")]
    others = [r for r in results if not r["name"].startswith("agentdispatch")]
    for o in ours:
        for t in others:
            print(f"ratio goodput {o['name']} / {t['name']} = {o['goodput'] / t['goodput']:.2f}")
    print("(KiB/turn: peak RSS above idle / whole peak RSS, per turn in flight at the model's peak)")
    print("(CPU ms/turn: the worker process; DB ms: the PostgreSQL backends serving it, on this machine too)")
    print("(issue 19 targets: goodput >= 0.9 x ideal at 2,000 x 5 s, >= 0.85 and <= 100 KB per turn at 10,000 x 30 s)")


if __name__ == "__main__":
    main()
