"""Contract: what callers of a job system expect (issue 20), on every backend."""

from __future__ import annotations

import time

import pytest

from agentdispatch import IdempotencyConflict, InvalidInput, JobNotFound, QueueFull, Registry, Status, Submission, Turn
from agentdispatch.handlers import builtins
from agentdispatch.stores.base import ClaimKind, JobFilter
from agentdispatch.workitem import Outcome

from .helpers import wait_until


def test_a_reused_key_with_another_body_is_a_conflict(harness):
    d = harness.dispatcher()
    first = d.submit(Submission(kind="echo", tenant="acme", payload={"n": 1}, idempotency_key="order-1"))
    # The same body (keys in another order) is the same job.
    again = d.submit(Submission(kind="echo", tenant="acme", payload={"n": 1}, idempotency_key="order-1"))
    assert again.job_id == first.job_id
    before = harness.store.counts("acme")
    with pytest.raises(IdempotencyConflict) as err:
        d.submit(Submission(kind="echo", tenant="acme", payload={"n": 2}, idempotency_key="order-1"))
    assert err.value.job_id == first.job_id and err.value.fields == ("payload",)
    assert isinstance(err.value, InvalidInput)
    with pytest.raises(IdempotencyConflict) as err:
        d.submit(Submission(kind="other", tenant="acme", payload={"n": 1}, idempotency_key="order-1", priority=3))
    assert err.value.fields == ("kind", "priority")
    # A caller-chosen job id is held to the same rule, also inside one batch,
    # and a refused batch writes nothing.
    with pytest.raises(IdempotencyConflict):
        d.submit_many(
            [
                Submission(kind="echo", tenant="acme", job_id="mine-1", payload=1),
                Submission(kind="echo", tenant="acme", job_id="mine-1", payload=2),
            ]
        )
    assert harness.store.counts("acme") == before
    assert harness.store.get(first.job_id, "acme").payload == {"n": 1}


def _recording_registry(log: list[tuple[str, str, float]]) -> Registry:
    reg = Registry()

    def record(turn: Turn, guard: object) -> object:
        log.append(("start", turn.job_id, time.time()))
        log.append(("end", turn.job_id, time.time()))
        return turn.payload

    reg.add("rec", record)
    return reg


def test_a_delayed_turn_waits_keeps_its_session_order_and_counts(make_harness):
    harness = make_harness(max_depth=3)
    d = harness.dispatcher()
    late = d.submit(Submission(kind="rec", tenant="t", session_id="s", payload="late", delay_s=1.5))
    after = d.submit(Submission(kind="rec", tenant="t", session_id="s", payload="after"))
    at = d.submit(Submission(kind="rec", tenant="t", payload="at", not_before=time.time() + 1.0))
    view = d.status(late.job_id, "t")
    # Accepted now, scheduled for later: its start time is in the view.
    assert view["status"] == "ready" and view["ready_at"] >= view["created_at"] + 1.5
    assert d.status(at.job_id, "t")["ready_at"] > d.status(at.job_id, "t")["created_at"]
    # A delayed turn counts against admission.
    with pytest.raises(QueueFull):
        d.submit(Submission(kind="rec", tenant="t", payload="over"))
    log: list[tuple[str, str, float]] = []
    worker = harness.worker(_recording_registry(log), threads=2)
    worker.start()
    try:
        for job in (late, after, at):
            wait_until(lambda job=job: harness.store.get(job.job_id, "t").status is Status.SUCCEEDED, timeout=30)
    finally:
        worker.stop()
    starts = {job: when for kind, job, when in log if kind == "start"}
    ends = {job: when for kind, job, when in log if kind == "end"}
    # Never before its time (database clock and this process's clock: one host).
    for job in (late, at):
        assert starts[job.job_id] >= harness.store.get(job.job_id, "t").ready_at - 0.01
    # The later turn of the session did not overtake the delayed one.
    assert starts[after.job_id] >= ends[late.job_id]


def test_a_delayed_child_keeps_its_delay_when_released(harness):
    d = harness.dispatcher()
    parent = d.submit(Submission(kind="echo", tenant="t"))
    child = d.submit(Submission(kind="echo", tenant="t", dependencies=(parent.job_id,), delay_s=3600))
    start = harness.store.get(child.job_id, "t").ready_at
    claim = harness.store.claim(parent.job_id, "t", owner="w:1", ttl_s=30)
    assert claim.lease is not None
    harness.store.commit(claim.lease, Outcome(ok=True))
    released = harness.store.get(child.job_id, "t")
    assert released.status is Status.READY and released.ready_at == start
    assert harness.store.claim(child.job_id, "t", owner="w:1", ttl_s=30).kind is ClaimKind.BUSY


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"delay_s": -1}, "delay_s"),
        ({"delay_s": float("nan")}, "delay_s"),
        ({"delay_s": 10**9}, "delay_s"),
        ({"not_before": 0}, "not_before"),
        ({"not_before": True}, "not_before"),
        ({"not_before": 1.0, "delay_s": 1.0}, "not both"),
    ],
)
def test_bad_timing_is_refused_and_changes_nothing(harness, fields, message):
    before = harness.store.counts("t")
    with pytest.raises(InvalidInput, match=message):
        harness.dispatcher().submit(Submission(kind="echo", tenant="t", **fields))
    assert harness.store.counts("t") == before


def test_search_filters_apply_in_the_store(harness):
    d = harness.dispatcher()
    old = [d.submit(Submission(kind="report", tenant="t", session_id="s-a", agent_name="bob")) for _ in range(3)]
    cut = harness.store.get(old[-1].job_id, "t").created_at
    time.sleep(0.01)  # created_at strictly after the cut on every clock
    d.submit_many([Submission(kind="echo", tenant="t", session_id="s-b") for _ in range(30)])
    d.submit(Submission(kind="report", tenant="other", session_id="s-a"))
    mine = d.submit(Submission(kind="echo", tenant="t", job_id="needle-42"))

    def ids(limit: int = 10, **kw: object) -> list[str]:
        return [i.id for i in d.jobs("t", limit=limit, filters=JobFilter(**kw))]  # type: ignore[arg-type]

    newest_first = [h.job_id for h in reversed(old)]
    # Matches from beyond the first unfiltered page, newest first, this tenant only.
    assert ids(kind="report") == newest_first
    assert ids(session_id="s-a") == newest_first
    assert ids(agent_name="bob", limit=2) == newest_first[:2]
    assert ids(created_to=cut + 0.001, limit=50) == newest_first
    assert old[0].job_id not in ids(created_from=cut + 0.001, limit=50)
    assert ids(id_contains="needle") == [mine.job_id]
    assert ids(id_contains="%") == [] and ids(id_contains="_") == []  # no pattern characters
    assert ids(kind="report", session_id="s-b") == []
    assert [i.id for i in d.jobs("t", Status.READY, limit=5, offset=1, filters=JobFilter(kind="report"))] == (
        newest_first[1:]
    )
    with pytest.raises(InvalidInput):
        d.jobs("t", filters=JobFilter(kind="x" * 300))


def test_a_child_turn_sees_its_parents_results(harness):
    reg = Registry()
    reg.add("make", lambda turn, guard: {"from": turn.payload})
    reg.add("gather", lambda turn, guard: {"parents": turn.parent_results, "payload": turn.payload})
    d = harness.dispatcher()
    a = d.submit(Submission(kind="make", tenant="t", payload="a"))
    b = d.submit(Submission(kind="make", tenant="t", payload="b"))
    child = d.submit(Submission(kind="gather", tenant="t", dependencies=(a.job_id, b.job_id), payload=1))
    lone = d.submit(Submission(kind="gather", tenant="t", payload=2))
    worker = harness.worker(reg, threads=2)
    worker.start()
    try:
        for job in (child, lone):
            wait_until(lambda job=job: harness.store.get(job.job_id, "t").status is Status.SUCCEEDED, timeout=30)
    finally:
        worker.stop()
    got = harness.store.get(child.job_id, "t").result
    assert got == {"parents": {a.job_id: {"from": "a"}, b.job_id: {"from": "b"}}, "payload": 1}
    assert harness.store.get(lone.job_id, "t").result == {"parents": {}, "payload": 2}


def test_an_early_delivery_is_not_polled_in_a_loop(harness):
    """A delayed turn is tried a handful of times before it is due, not in a
    loop: the SQL queues hide it until then; a Kafka worker that meets it
    early releases it until its start time."""
    d = harness.dispatcher()
    worker = harness.worker(builtins(), threads=2)
    worker.start()
    try:
        # The worker is consuming (a Kafka consumer has joined its group)...
        warm = d.submit(Submission(kind="echo", tenant="t"))
        wait_until(lambda: harness.store.get(warm.job_id, "t").status is Status.SUCCEEDED, timeout=60)
        # ...before the delayed turn arrives, seconds early.
        late = d.submit(Submission(kind="echo", tenant="t", delay_s=3.0))
        wait_until(lambda: harness.store.get(late.job_id, "t").status is Status.SUCCEEDED, timeout=30)
    finally:
        worker.stop()
    # Every claim attempt before its start time is given back as busy.
    busy = worker.metrics.registry.get_sample_value("agent_utilities_dispatch_turns_total", {"outcome": "busy"})
    assert (busy or 0) <= 2, busy


def test_an_absolute_start_time_is_kept_exactly(harness):
    when = 4_000_000_000.25
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t", not_before=when))
    assert harness.store.get(job.job_id, "t").ready_at == when


def test_a_nul_in_a_lookup_or_filter_is_refused_as_bad_input_not_an_outage(harness):
    # PostgreSQL cannot hold or compare a NUL in text: asked for one, the
    # store failed as if it were down (HTTP 503, which clients retry).
    d = harness.dispatcher()
    job = d.submit(Submission(kind="echo", tenant="t", agent_name="bot")).job_id
    before = harness.store.counts("t")
    bad = job + "\x00"
    for call in (d.status, d.cancel, d.replay, d.history):
        with pytest.raises(JobNotFound):
            call(bad, "t")
    for name in ("kind", "session_id", "agent_name", "id_contains"):
        with pytest.raises(InvalidInput, match=name):
            d.jobs("t", filters=JobFilter(**{name: "a\x00"}))
    with pytest.raises(InvalidInput, match="agent_name"):
        d.submit(Submission(kind="echo", tenant="t", agent_name="bot\x00"))
    with pytest.raises(InvalidInput, match="reason"):
        d.cancel(job, "t", "asked\x00")
    assert harness.store.counts("t") == before
    assert d.status(job, "t")["status"] == Status.READY.value
