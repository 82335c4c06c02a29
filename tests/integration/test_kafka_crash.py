"""Crash tests on Kafka with real worker processes (store: a shared SQLite file).

* Worker processes are SIGKILLed mid-turn and respawned: 0 lost turns, 0
  duplicate side effects, 0 overlapping turns of one session.
* The broker is SIGKILLed and restarted mid-run; its memory storage loses the
  log, so every non-terminal item must be re-published by the reconciler.
* Turns of one session run in submission order.

Run as ``python test_kafka_crash.py worker ...`` this file is the worker process.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from agentdispatch import NOT_HAPPENED, Status, Submission
from agentdispatch.backends.kafka.transport import KafkaTransport
from agentdispatch.backends.sqlite.store import SqliteStore
from agentdispatch.dispatch import Dispatcher
from agentdispatch.handlers import Registry
from agentdispatch.lease import NotHappened
from agentdispatch.settings import Settings, load_settings
from agentdispatch.worker import Worker, WorkerOptions

sys.path.insert(0, str(Path(__file__).parents[1]))
import itertools

from kafka_broker import Broker

FAST = {"max_poll_interval_ms": 10_000, "session_timeout_ms": 6_000, "timeout_s": 3.0}


def _settings(data_dir: str, bootstrap: str) -> Settings:
    return load_settings(
        task_queue_backend="kafka",
        kafka_bootstrap_servers=bootstrap,
        data_dir=Path(data_dir),
        claim_ttl_s=3,
        renew_interval_s=1,
        max_attempts=20,
    )


def _append(sink: str, line: str) -> None:
    with open(sink, "a") as f:  # O_APPEND: one short line is one atomic write
        f.write(line + "\n")


def _effect_seen(sink: str, job_id: str) -> NotHappened | None:
    """None (the effect's result) if ``job_id``'s effect is in the sink."""
    with open(sink) as f:
        return None if any(line.startswith(f"effect {job_id} ") for line in f) else NOT_HAPPENED


def worker_main(data_dir: str, bootstrap: str, sink: str, threads: int) -> None:
    """A worker process whose handler logs start/effect/end lines to ``sink``."""
    faulthandler.enable()  # a crash in the Kafka client leaves its traceback in the log
    settings = _settings(data_dir, bootstrap)
    store = SqliteStore(settings.sqlite_path, extra_attempts=settings.max_attempts)
    transport = KafkaTransport(settings, **FAST)  # type: ignore[arg-type]
    pid = os.getpid()

    def handler(turn: Any, guard: Any) -> str:
        _append(sink, f"start {turn.job_id} {turn.session_id} {pid} {time.time()}")
        try:
            time.sleep(float(turn.payload["sleep"]))
            # A SIGKILL between the ledger's "intended" and "committed" leaves
            # the effect unknown: the sink says whether it happened.
            guard.side_effect(
                f"fx:{turn.job_id}",
                lambda: _append(sink, f"effect {turn.job_id} {turn.session_id} {pid}"),
                verify=lambda: _effect_seen(sink, turn.job_id),
            )
            return "ok"
        finally:
            _append(sink, f"end {turn.job_id} {turn.session_id} {pid} {time.time()}")

    reg = Registry()
    reg.add("crash", handler)
    worker = Worker(settings, store, transport, reg, options=WorkerOptions(threads=threads, get_wait_s=0.05))
    signal.signal(signal.SIGTERM, lambda *_: worker.stopping.set())
    worker.run_forever()


class Fleet:
    """Worker processes over one store and one broker, with the evidence."""

    def __init__(self, tmp: Path, broker: Broker) -> None:
        self.tmp, self.broker = tmp, broker
        self.data_dir = str(tmp / "data")
        self.sink = str(tmp / "sink.log")
        self.settings = _settings(self.data_dir, broker.bootstrap)
        self.store = SqliteStore(self.settings.sqlite_path, extra_attempts=self.settings.max_attempts)
        self.store.migrate()
        self.transport = KafkaTransport(self.settings, **FAST)  # type: ignore[arg-type]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed_at: dict[int, float] = {}
        # Workers that crashed on their own (librdkafka 2.16.0 can segfault in
        # rd_kafka_metadata_cache_find while a broker restarts): when, and how.
        self.crashed: dict[int, int] = {}
        self._threads: dict[int, int] = {}

    def submit(self, n: int, sessions: int, sleep: float | None = None) -> list[str]:
        d = Dispatcher(self.store, self.transport, self.settings)
        subs = [
            Submission(
                kind="crash",
                tenant="t",
                session_id=f"s{i % sessions}",
                payload={"sleep": 0.05 + (i % 4) * 0.1 if sleep is None else sleep},
            )
            for i in range(n)
        ]
        return [h.job_id for h in d.submit_many(subs)]

    def succeeded(self, jobs: list[str]) -> int:
        return sum(self.store.get(j, None).status is Status.SUCCEEDED for j in jobs)

    def spawn(self, threads: int = 2) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"worker-{len(self.procs)}.log", "wb") as log:
            p = subprocess.Popen(
                [sys.executable, __file__, "worker", self.data_dir, self.broker.bootstrap, self.sink, str(threads)],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.procs.append(p)
        self._threads[p.pid] = threads
        return p

    def reap(self) -> None:
        """What a supervisor does: a worker that died on its own is noted
        (its open turn ends at its death) and replaced."""
        for p in list(self.procs):
            if p.poll() is None or p.pid in self.killed_at:
                continue
            self.killed_at[p.pid] = time.time()
            self.crashed[p.pid] = p.returncode
            self.spawn(self._threads[p.pid])

    def busy_victim(self, live: list[subprocess.Popen[bytes]], rng: random.Random) -> subprocess.Popen[bytes] | None:
        """A live worker that is inside a turn right now (polls up to 2 s)."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            open_runs: Counter[int] = Counter()
            if Path(self.sink).exists():
                for ln in Path(self.sink).read_text().splitlines():
                    kind, _job, _session, pid = ln.split()[:4]
                    if kind in ("start", "end"):
                        open_runs[int(pid)] += 1 if kind == "start" else -1
            busy = [p for p in live if open_runs[p.pid] > 0]
            if busy:
                return rng.choice(busy)
            time.sleep(0.01)
        return None

    def sigkill(self, p: subprocess.Popen[bytes]) -> None:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        self.killed_at[p.pid] = time.time()

    def done(self, jobs: list[str]) -> bool:
        return self.finished(jobs) == len(jobs)

    def finished(self, jobs: list[str]) -> int:
        return sum(1 for j in jobs if self.store.get(j, None).status.terminal)

    def wait(self, jobs: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done(jobs) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.2)

    def progress(self) -> int:
        """How much the handlers have logged: grows with every turn started or ended."""
        try:
            return os.stat(self.sink).st_size
        except FileNotFoundError:
            return 0

    def wait_or_restart(self, jobs: list[str], workers: int, stall_s: float = 20.0, timeout: float = 300.0) -> int:
        """Wait for ``jobs``; whenever the workers start or end no turn for
        ``stall_s`` while some are left (Tansu wedged the group), restart the
        workers. Returns how many workers were restarted.

        Tansu defects, seen in librdkafka's group debug log: after it lost its
        group state the generation id stays 0 across rebalances, so a SyncGroup
        can hand every member a previous round's empty assignment; and a
        partition can stay with a member that was SIGKILLed. The group then
        heartbeats in that state for good (Apache Kafka bumps the generation
        and expires the session). The items are not lost: the reconciler keeps
        re-publishing them, and a clean restart of the workers (SIGTERM, one
        after the other, so every member has left before anyone joins) picks
        them up. ``stall_s`` is well past what a healthy group needs after a
        SIGKILL (a session timeout, then a re-publish after about a TTL), and
        a restart loses nothing, so watching for progress replaces waiting
        out fixed windows."""
        restarted = 0
        deadline = time.monotonic() + timeout
        seen, since = self.progress(), time.monotonic()
        while not self.done(jobs):
            assert time.monotonic() < deadline, f"turns left after {timeout:g} s: {self.evidence(jobs)}"
            self.reap()
            time.sleep(0.2)
            if (now := self.progress()) != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > stall_s:
                # A restarted group can wedge again the same way (seen in CI,
                # once three times in a row on a loaded run): each stall restarts.
                for p in [p for p in self.procs if p.poll() is None]:
                    p.send_signal(signal.SIGTERM)
                    p.wait(30)
                    self.killed_at[p.pid] = time.time()  # stopped by us, not crashed
                    restarted += 1
                for _ in range(workers):
                    self.spawn()
                seen, since = self.progress(), time.monotonic()
        return restarted

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.transport.close()
        self.store.close()

    def evidence(self, jobs: list[str]) -> dict[str, Any]:
        """Lost, duplicate effects, session overlaps and order violations."""
        lines = [ln.split() for ln in Path(self.sink).read_text().splitlines()] if Path(self.sink).exists() else []
        effects = Counter(ln[1] for ln in lines if ln[0] == "effect")
        runs: dict[tuple[str, int], dict[str, Any]] = {}
        order: dict[str, list[str]] = defaultdict(list)
        for ln in lines:
            if ln[0] == "start":
                runs[(ln[1], int(ln[3]))] = {"session": ln[2], "start": float(ln[4]), "end": None, "pid": int(ln[3])}
            elif ln[0] == "end":
                runs[(ln[1], int(ln[3]))]["end"] = float(ln[4])
            elif ln[0] == "effect":
                order[ln[2]].append(ln[1])
        by_session: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
        for (job, _pid), r in runs.items():
            end = r["end"] if r["end"] is not None else self.killed_at.get(r["pid"], time.time())
            by_session[r["session"]].append((r["start"], end, job))
        overlaps = takeovers = 0
        for spans in by_session.values():
            spans.sort()
            for (_, e0, job0), (s1, _, job1) in itertools.pairwise(spans):
                # A turn re-run while its first run still sat in a stalled or
                # dying process is the lease doing its job (fence and ledger
                # keep the effect single); two turns of a session at once is a bug.
                if s1 < e0:
                    takeovers += job0 == job1
                    overlaps += job0 != job1
        status = Counter(self.store.get(j, None).status for j in jobs)
        rank = {j: i for i, j in enumerate(jobs)}
        out_of_order = sum(1 for seq in order.values() for a, b in itertools.pairwise(seq) if rank[a] > rank[b])
        return {
            "jobs": len(jobs),
            "succeeded": status[Status.SUCCEEDED],
            "lost": sum(n for s, n in status.items() if s is not Status.SUCCEEDED and s is not Status.DEAD_LETTER),
            "dead_letter": status[Status.DEAD_LETTER],
            "runs": len(runs),
            "duplicate_effects": sum(n - 1 for n in effects.values() if n > 1),
            "missing_effects": len(set(jobs) - set(effects)),
            "session_overlaps": overlaps,
            "takeovers": takeovers,
            "out_of_order": out_of_order,
        }


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    broker = Broker(tmp_path / "broker").start()
    f = Fleet(tmp_path, broker)
    yield f
    f.close()
    broker.kill()


@pytest.mark.slow
def test_sigkilled_workers_lose_nothing_and_duplicate_no_effect(fleet: Fleet) -> None:
    jobs = fleet.submit(120, sessions=12)
    live = [fleet.spawn() for _ in range(3)]
    rng = random.Random(7)
    kills = 0
    deadline = time.monotonic() + 150
    while kills < 5 and not fleet.done(jobs) and time.monotonic() < deadline:
        # At even steps of progress, not of time: a peer reaps a killed
        # worker within about a second, so a run can end before timed kills.
        time.sleep(0.2)
        if fleet.finished(jobs) < len(jobs) * (kills + 1) // 7:
            continue
        victim = fleet.busy_victim(live, rng)
        if victim is None:
            continue
        live.remove(victim)
        fleet.sigkill(victim)  # mid-turn: it has a started, unfinished turn
        kills += 1
        live.append(fleet.spawn())
    restarted = fleet.wait_or_restart(jobs, workers=3)
    ev = fleet.evidence(jobs)
    print(f"\nkafka crash test: {kills} SIGKILLs, {restarted} workers restarted after a stall, {ev}")
    assert kills == 5
    assert ev["succeeded"] == ev["jobs"] and ev["lost"] == 0 and ev["dead_letter"] == 0
    assert ev["duplicate_effects"] == 0 and ev["missing_effects"] == 0
    assert ev["session_overlaps"] == 0 and ev["out_of_order"] == 0
    assert ev["runs"] > ev["jobs"], "no turn was interrupted: the test did not crash anything mid-turn"


@pytest.mark.slow
def test_broker_restart_loses_the_log_and_the_reconciler_republishes(fleet: Fleet) -> None:
    jobs = fleet.submit(90, sessions=9)
    for _ in range(2):
        fleet.spawn()
    deadline = time.monotonic() + 60
    while sum(fleet.store.get(j, None).status is Status.SUCCEEDED for j in jobs) < 20:
        assert time.monotonic() < deadline, "workers made no progress"
        time.sleep(0.2)
    pending = [j for j in jobs if not fleet.store.get(j, None).status.terminal]
    fleet.broker.restart()  # memory storage: topic, log and offsets are gone
    restarted = fleet.wait_or_restart(jobs, workers=2)
    ev = fleet.evidence(jobs)
    republished = sum(
        1 for j in pending if any(e["event"] == "redelivered" for e in fleet.store.history(j, None)["events"])
    )
    print(
        f"\nkafka broker restart: {len(pending)} non-terminal at restart, {republished} re-published, "
        f"{restarted} workers restarted after a stall, {ev}"
    )
    assert pending and ev["succeeded"] == ev["jobs"] and ev["lost"] == 0
    assert ev["duplicate_effects"] == 0 and ev["session_overlaps"] == 0 and ev["out_of_order"] == 0
    assert republished > 0


@pytest.mark.slow
def test_a_broker_restart_re_publishes_each_stranded_item_about_once(fleet: Fleet) -> None:
    """A restarted broker loses its log: every ready item it held is stranded
    and must go out again -- once, not once per TTL while the group works
    through the re-published backlog (that only lengthens the log with
    duplicates the workers must read past). The workers take several TTLs to
    drain it; every item still finishes."""
    jobs = fleet.submit(180, sessions=180, sleep=0.12)
    fleet.spawn(threads=2)
    deadline = time.monotonic() + 60
    while fleet.succeeded(jobs) < 20:  # the group consumes: its pace is known
        assert time.monotonic() < deadline, "workers made no progress"
        fleet.reap()
        time.sleep(0.05)
    fleet.broker.kill()
    stranded = [j for j in jobs if not fleet.store.get(j, None).status.terminal]
    fleet.broker.start()  # memory storage: topic, log and offsets are gone
    restarted = fleet.wait_or_restart(jobs, workers=1)
    ev = fleet.evidence(jobs)
    redelivered = sum(1 for j in jobs for e in fleet.store.history(j, None)["events"] if e["event"] == "redelivered")
    print(f"\nkafka restart: {len(stranded)} stranded, {redelivered} re-published, {restarted} restarted, {ev}")
    assert ev["succeeded"] == ev["jobs"] and ev["lost"] == 0, ev
    assert ev["duplicate_effects"] == 0 and ev["session_overlaps"] == 0, ev
    # Once per TTL while the group drains came to about 3 a stranded item; a
    # loaded machine drains slowly, so the bound leaves room above once.
    assert redelivered <= 2.5 * len(stranded), f"{redelivered} re-publications for {len(stranded)} stranded items"


def test_workers_rejoin_after_broker_restarts_without_being_restarted(fleet: Fleet) -> None:
    """Tansu is SIGKILLed and restarted (empty log, no group) twice while worker
    processes run; the workers must find their group again on their own."""
    ev = _restart_run(fleet, turns=240, sessions=24, procs=3, restarts=2, sleep=None)
    print(f"\nkafka broker restarts, workers never restarted: {ev}")
    assert not ev["unexpected_exits"], "a worker process died"
    assert ev["lost"] == 0 and ev["succeeded"] == ev["jobs"], ev
    assert ev["duplicate_effects"] == 0 and ev["session_overlaps"] == 0 and ev["out_of_order"] == 0, ev


@pytest.mark.slow
@pytest.mark.soak
def test_soak_repeated_broker_restarts_over_5000_turns(fleet: Fleet) -> None:
    """The figure for the notes: >= 5 kill -9 restarts of Tansu (1-3 s down)
    over 5,000 turns on 4 worker processes; prints how long the backlog took to
    drain after the last restart, against the claim TTL."""
    ev = _restart_run(fleet, turns=5000, sessions=500, procs=4, restarts=6, sleep=0.002, threads=4)
    print(f"\nkafka restart soak: {ev}")
    assert ev["lost"] == 0 and ev["succeeded"] == ev["jobs"], ev
    assert ev["duplicate_effects"] == 0 and ev["session_overlaps"] == 0 and ev["out_of_order"] == 0, ev


def _restart_run(
    fleet: Fleet, *, turns: int, sessions: int, procs: int, restarts: int, sleep: float | None, threads: int = 2
) -> dict[str, Any]:
    """Run ``procs`` workers and SIGKILL + restart the broker ``restarts``
    times; the turns come in waves, one before the first restart and one after
    each (so some turns exist only in a log the workers must find again), and
    each restart comes while half of the turns so far are still to run. The
    workers are never restarted; one that crashes is replaced, as a supervisor
    would (:meth:`Fleet.reap`), and reported."""
    wave = turns // (restarts + 1)
    jobs = fleet.submit(wave, sessions=sessions, sleep=sleep)
    for _ in range(procs):
        fleet.spawn(threads)
    rng = random.Random(11)
    last_start = first_done = time.monotonic()
    steady = 0.0  # turns/s before the first restart: the no-fault pace
    kills: list[float] = []
    starts: list[float] = []
    for r in range(restarts):
        deadline = time.monotonic() + 120
        while (done := fleet.succeeded(jobs)) < len(jobs) // 2:
            assert time.monotonic() < deadline, "workers made no progress"
            if not done:
                first_done = time.monotonic()
            fleet.reap()
            time.sleep(0.05)
        if r == 0:
            steady = done / max(time.monotonic() - first_done, 1e-3)
        fleet.broker.kill()
        kills.append(time.time())
        time.sleep(rng.uniform(1.0, 3.0))  # the outage an operator's restart takes
        fleet.broker.start()
        starts.append(time.time())
        last_start = time.monotonic()
        jobs += fleet.submit(wave, sessions=sessions, sleep=sleep)
    left_at_last = len(jobs) - fleet.succeeded(jobs)
    fleet.wait(jobs, timeout=90)
    drained_s = time.monotonic() - last_start
    ev = fleet.evidence(jobs)
    ev.update(
        restarts=restarts,
        left_at_last_restart=left_at_last,
        drained_after_last_restart_s=round(drained_s, 1),
        # What the drain took beyond the no-fault pace: the restart's own cost.
        excess_over_steady_s=round(drained_s - left_at_last / max(steady, 1e-3), 1),
        # Per restart, the longest time no turn finished once the broker was
        # back (until the next kill): how long the fleet took to recover.
        stalls_s=_stalls(fleet.sink, starts, [*kills[1:], float("inf")]),
        ttl_s=fleet.settings.claim_ttl_s,
        crashes=sorted(fleet.crashed.values()),
        # Only the known client segfault is tolerated (and survived); any other
        # exit of a worker is a bug of ours.
        unexpected_exits=[c for c in fleet.crashed.values() if c != -signal.SIGSEGV],
    )
    return ev


def _stalls(sink: str, starts: list[float], until: list[float]) -> list[float]:
    ends = sorted(float(ln.split()[4]) for ln in Path(sink).read_text().splitlines() if ln.startswith("end "))
    out = []
    for t0, t1 in zip(starts, until, strict=True):
        marks = [t0, *(t for t in ends if t0 < t < t1)]
        out.append(round(max((b - a for a, b in itertools.pairwise(marks)), default=t1 - t0), 1))
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
