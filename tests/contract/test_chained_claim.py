"""Contract: a claim thread that commits a fast turn claims its next ones with
that commit, on every transport: in the same transaction where the queue shares
the store's database, straight after it elsewhere (Kafka: the deliveries stay
uncommitted in the thread's own consumer, which hands out no other turn of a
session with one in flight). A failure of that claim never costs the commit,
and a chained turn runs even when the worker is stopping."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from agentdispatch import Status, Submission
from agentdispatch.envelope import Envelope
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.handlers import Registry, builtins
from agentdispatch.lanes import Lane
from agentdispatch.transports.flow import Shared
from agentdispatch.worker import Worker

from .helpers import wait_until


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _two_turns(harness) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    d = harness.dispatcher()
    first, second = d.submit_many(
        [Submission(kind="echo", payload={"n": n}, tenant="t", session_id=f"s{n}") for n in (1, 2)]
    )
    return first.job_id, second.job_id


def _poll_until(worker: Worker, loop: asyncio.AbstractEventLoop, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        label = worker.poll("t:0", 0, loop)
        if label is not None:
            return label
    raise AssertionError("nothing was delivered")


def _held(worker: Worker, index: int = 0) -> int:
    """Turns a claim thread holds: claimed and not started, or finished and not committed."""
    lane = worker.lane(index)
    return 0 if lane is None else len(lane.claimed) + len(lane.done)


def _lane(worker: Worker, index: int) -> Lane:
    lane = worker.lane(index)
    assert lane is not None, f"claim thread {index} has claimed nothing yet"
    return lane


def _status(harness, job_id: str) -> Status:  # type: ignore[no-untyped-def]
    return harness.store.get(job_id, "t").status


def test_the_commit_claims_the_next_turn(harness, loop) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    assert _poll_until(worker, loop) == "completed"
    done = {a, b} - {j for j in (a, b) if _status(harness, j) is not Status.SUCCEEDED}
    assert len(done) == 1
    (other,) = {a, b} - done
    assert isinstance(worker.flow, Shared) is not harness.log
    # Claimed with the commit (in its transaction on a shared database):
    # running already, no queue read left.
    assert _status(harness, other) is Status.RUNNING and _held(worker) == 1
    assert _poll_until(worker, loop) == "completed"
    assert _status(harness, other) is Status.SUCCEEDED and not _held(worker)


def test_a_failing_chained_claim_never_costs_the_commit(harness, loop, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    # The queue read after a delivery fails: the flow's own read where it
    # claims in the commit's transaction, else the transport's.
    target = worker.flow.sides if isinstance(worker.flow, Shared) else harness.transport
    real = target.get
    calls: list[bool] = []

    def flaky(*args, **kw):  # type: ignore[no-untyped-def]
        if calls and calls[-1]:  # the read after a delivery: the chained one
            calls.append(False)
            raise TaskQueueUnavailable("injected: the queue read failed")
        got = real(*args, **kw)
        calls.append(bool(got))
        return got

    monkeypatch.setattr(target, "get", flaky)
    assert _poll_until(worker, loop) == "completed"
    statuses = sorted(_status(harness, j).value for j in (a, b))
    # The first turn committed on its own; the second was not claimed.
    assert statuses == ["ready", "succeeded"] and not _held(worker)
    monkeypatch.setattr(target, "get", real)
    assert _poll_until(worker, loop) == "completed"
    assert {_status(harness, j) for j in (a, b)} == {Status.SUCCEEDED}


def test_a_chained_turn_runs_when_the_worker_stops(harness, loop) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    assert _poll_until(worker, loop) == "completed"
    worker.stopping.set()
    worker._claim_loop(0)  # returns once nothing is claimed by this thread
    assert sorted(_status(harness, j).value for j in (a, b)) == ["succeeded", "succeeded"]
    assert not _held(worker)


def test_process_handles_one_delivery_and_claims_nothing_else(harness, loop) -> None:  # type: ignore[no-untyped-def]
    a, b = _two_turns(harness)
    worker = harness.worker(builtins(), threads=1)
    delivery = None
    deadline = time.monotonic() + 30
    while delivery is None and time.monotonic() < deadline:
        delivery = harness.transport.get("t:0", visibility_s=30.0, wait_s=0.2)
    assert delivery is not None
    assert worker.process(delivery, owner="t:0", index=0, loop=loop) == "completed"
    # One succeeded; the other is still queued for any claimant, not held by this worker.
    assert sorted(_status(harness, j).value for j in (a, b)) == ["ready", "succeeded"]
    assert not _held(worker)


def _fast_worker(harness, batch_max: int) -> Worker:  # type: ignore[no-untyped-def]
    """A worker that has seen fast turns, so it batches up to ``batch_max``."""
    worker = harness.worker(builtins(), threads=1, batch_max=batch_max, batch_budget_s=5.0)
    for _ in range(10):
        worker.backpressure.record(True, 0.0001)
    return worker


def _submit(harness, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    d = harness.dispatcher()
    subs = [Submission(kind="echo", payload={"n": i}, tenant="t", session_id=f"s{i}") for i in range(n)]
    return [h.job_id for h in d.submit_many(subs)]


def _census(harness, ids: list[str]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    out: dict[str, int] = {}
    for j in ids:
        out[_status(harness, j).value] = out.get(_status(harness, j).value, 0) + 1
    return out


def test_fast_turns_are_claimed_and_committed_in_batches(harness, loop) -> None:  # type: ignore[no-untyped-def]
    ids = _submit(harness, 10)
    worker = _fast_worker(harness, batch_max=4)
    assert _poll_until(worker, loop) == "completed"
    # The commit of the first turn claimed the next four: running under their leases.
    assert _held(worker) == 4 and _census(harness, ids) == {"succeeded": 1, "running": 4, "ready": 5}
    assert [worker.poll("t:0", 0, loop) for _ in range(3)] == ["pending"] * 3
    # Finished, not committed yet: nothing observable has changed.
    assert _census(harness, ids) == {"succeeded": 1, "running": 4, "ready": 5}
    assert worker.poll("t:0", 0, loop) == "completed"
    # One transaction committed the four and claimed the next (up to) four.
    assert _census(harness, ids) == {"succeeded": 5, "running": 4, "ready": 1}
    sample = worker.metrics.registry.get_sample_value
    assert sample("agent_utilities_dispatch_commit_batch_turns_count") == 2  # the first turn, then the four
    assert sample("agent_utilities_dispatch_commit_batch_turns_sum") == 5
    while _census(harness, ids) != {"succeeded": 10}:
        _poll_until(worker, loop)
    assert not _held(worker)


def _batch_claimed(harness, loop, n: int) -> tuple[list[str], Worker]:  # type: ignore[no-untyped-def]
    """``n`` turns, and a fast worker whose first commit claimed a batch of four."""
    ids = _submit(harness, n)
    worker = _fast_worker(harness, batch_max=4)
    assert _poll_until(worker, loop) == "completed"
    assert _held(worker) == 4
    return ids, worker


def test_a_fenced_turn_in_a_batch_costs_the_others_nothing(harness, loop) -> None:  # type: ignore[no-untyped-def]
    ids, worker = _batch_claimed(harness, loop, 6)
    lane = _lane(worker, 0)
    victim = Envelope.from_json(lane.claimed[1][0].raw).job_id
    harness.dispatcher().cancel(victim, "t")  # fences the claimed, not yet started turn
    labels = [worker.poll("t:0", 0, loop) for _ in range(4)]
    assert labels[-1] == "completed" and "fenced" not in labels[:3]
    assert _status(harness, victim) is Status.CANCELLED
    others = [j for j in ids if j != victim]
    # The first turn and the three other batch members committed; one left to claim.
    assert _census(harness, others).get("succeeded") == 4
    assert worker.metrics.lease_failures._value.get() == 1


def test_a_slow_handler_is_never_batched(harness, loop) -> None:  # type: ignore[no-untyped-def]
    ids = _submit(harness, 3)
    worker = harness.worker(builtins(), threads=1, batch_max=16, batch_budget_s=0.01)
    for _ in range(10):
        worker.backpressure.record(True, 0.5)  # turns of half a second: one per commit
    assert _poll_until(worker, loop) == "completed"
    assert _held(worker) == 1
    while _census(harness, ids) != {"succeeded": 3}:
        _poll_until(worker, loop)


def test_turns_held_up_behind_a_stalled_turn_are_taken_by_another_thread(harness, loop) -> None:  # type: ignore[no-untyped-def]
    ids, worker = _batch_claimed(harness, loop, 6)
    lane = _lane(worker, 0)
    assert len(lane.claimed) == 4
    # Thread 0 is running a turn that has taken a minute so far: its claimed
    # turns are not started. Thread 1 has nothing of its own: it takes one.
    lane.running, lane.mark = True, time.monotonic() - 60.0
    last = Envelope.from_json(lane.claimed[-1][0].raw).job_id
    assert worker.poll("t:1", 1, loop) == "completed"
    assert _status(harness, last) is Status.SUCCEEDED and len(lane.claimed) == 3
    # A turn that is merely running (within the budget) keeps its batch.
    lane.mark = time.monotonic()
    while _held(worker, 1):
        worker.poll("t:1", 1, loop)
    assert len(lane.claimed) == 3
    lane.running = False
    while _census(harness, ids) != {"succeeded": 6}:
        worker.poll("t:0", 0, loop)


def test_a_hung_turn_does_not_hold_its_batch_back(harness) -> None:  # type: ignore[no-untyped-def]
    """End to end with real threads: one turn of a batch blocks; the others
    still run promptly (taken over by the worker's other thread)."""
    gate = threading.Event()
    done: list[int] = []

    def step(turn, guard):  # type: ignore[no-untyped-def]
        if turn.payload["hang"]:
            gate.wait(300)
        done.append(turn.payload["n"])
        return turn.payload["n"]

    reg = Registry()
    reg.add("step", step)
    d = harness.dispatcher()
    first = d.submit_many([Submission(kind="step", payload={"n": -1, "hang": False}, tenant="t")])[0]
    worker = harness.worker(reg, threads=2, batch_max=16, batch_budget_s=0.05)
    for _ in range(10):
        worker.backpressure.record(True, 0.0001)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while _status(harness, first.job_id) is not Status.SUCCEEDED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The hung turn is claimed inside a batch (the thread that gets turn 0
        # alone claims the next ones with its commit), with turns behind it.
        subs = [Submission(kind="step", payload={"n": i, "hang": i == 3}, tenant="t") for i in range(20)]
        d.submit_many(subs)
        # A safety bound, not a speed claim: on a loaded machine the takeover
        # can take a while, and what matters is that it happens while the
        # hung turn still holds its thread.
        deadline = time.monotonic() + 180
        while len(done) < 20:  # every turn but the hung one (and the first)
            assert time.monotonic() < deadline, f"only {sorted(done)} ran while one turn hung"
            time.sleep(0.01)
        assert 3 not in done
    finally:
        gate.set()
        worker.stop(grace_s=10)
    assert sorted(done) == list(range(-1, 20))  # the hung turn finished once let go


def test_a_claimed_turn_whose_lease_lapsed_while_it_waited_never_starts(make_harness, loop) -> None:  # type: ignore[no-untyped-def]
    h = make_harness(claim_ttl_s=1.0, renew_interval_s=0.25)
    started: list[tuple[str, int]] = []
    reg = Registry()

    @reg.register("step")
    def step(turn, guard):  # type: ignore[no-untyped-def]
        started.append((turn.job_id, turn.attempt))
        return turn.payload["n"]

    d = h.dispatcher()
    subs = [Submission(kind="step", payload={"n": i}, tenant="t", session_id=f"s{i}") for i in range(3)]
    ids = [x.job_id for x in d.submit_many(subs)]
    worker = h.worker(reg, threads=1, batch_max=4, batch_budget_s=5.0)
    for _ in range(10):
        worker.backpressure.record(True, 0.0001)
    assert _poll_until(worker, loop) == "completed"
    lane = _lane(worker, 0)
    waiting = [Envelope.from_json(delivery.raw).job_id for delivery, _ in lane.claimed]
    assert len(waiting) == 2

    # The batch waits behind a turn slower than the TTL: the waiting leases
    # lapse and the reconciler gives both turns back to the queue.
    def given_back() -> bool:
        h.store.sweep(redeliver_after_s=h.transport.redeliver_after_s)
        return all(_status(h, j) is Status.READY for j in waiting)

    wait_until(given_back)
    assert [worker.poll("t:0", 0, loop) for _ in waiting] == ["fenced", "fenced"]
    assert [s for s in started if s[0] in waiting] == []  # no handler started on a lost lease
    while _census(h, ids) != {"succeeded": 3}:
        _poll_until(worker, loop)
    assert sorted(attempt for job, attempt in started if job in waiting) == [2, 2]


def test_a_batch_holds_one_turn_per_session_and_runs_sessions_in_order(harness, loop) -> None:  # type: ignore[no-untyped-def]
    """Batching keeps the session rule: a lane never holds two turns of one
    session, every turn runs once, and a session's turns run in submission order."""
    ran: list[tuple[str, int]] = []
    reg = Registry()

    @reg.register("step")
    def step(turn, guard):  # type: ignore[no-untyped-def]
        ran.append((turn.session_id, turn.payload["n"]))
        return turn.payload["n"]

    d = harness.dispatcher()
    subs = [Submission(kind="step", payload={"n": i}, tenant="t", session_id=f"s{i % 3}") for i in range(12)]
    ids = [h.job_id for h in d.submit_many(subs)]
    worker = harness.worker(reg, threads=1, batch_max=8, batch_budget_s=5.0)
    for _ in range(10):
        worker.backpressure.record(True, 0.0001)
    biggest = 0
    deadline = time.monotonic() + 60
    while _census(harness, ids) != {"succeeded": 12}:
        assert time.monotonic() < deadline, f"stuck at {_census(harness, ids)}"
        worker.poll("t:0", 0, loop)
        lane = worker.lane(0)
        held = [Envelope.from_json(delivery.raw).session_id for delivery, _ in (lane.claimed if lane else [])]
        assert len(held) == len(set(held)), f"one lane holds two turns of a session: {held}"
        biggest = max(biggest, len(held))
    assert biggest >= 2, "nothing was batched: the test proves nothing"
    assert sorted(n for _, n in ran) == list(range(12))  # each turn ran once
    for session in ("s0", "s1", "s2"):
        mine = [n for s, n in ran if s == session]
        assert mine == sorted(mine), f"session {session} ran out of order: {mine}"
