"""Contract: the lifecycle on every store/transport (SPEC sections 3-4)."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable

import pytest

from agentdispatch import (
    InvalidInput,
    JobNotFound,
    LeaseLost,
    OutcomeConflict,
    QueueFull,
    Status,
    Submission,
)
from agentdispatch.envelope import Envelope
from agentdispatch.stores.base import ClaimKind
from agentdispatch.workitem import Outcome

from .helpers import get_delivery, get_for, wait_until


def test_submit_returns_handle_and_delivers_envelope(harness):
    handle = harness.dispatcher().submit(Submission(kind="echo", payload={"secret_body": 1}, tenant="acme"))
    assert handle.job_id.startswith("dispatch-") and len(handle.job_id) == len("dispatch-") + 32
    assert handle.session_id == handle.job_id
    assert handle.status_request == {"action": "status", "job_id": handle.job_id}
    d = get_for(harness.transport, handle.job_id)
    env = Envelope.from_json(d.raw)
    assert (env.tenant, env.kind, env.payload_ref) == ("acme", "echo", handle.job_id)
    assert "secret_body" not in d.raw  # references only, never the body
    assert harness.dispatcher().status(handle.job_id, "acme")["status"] == "ready"


def test_claim_renew_commit_fencing(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    c = harness.store.claim(job.job_id, "t", owner="w:1", ttl_s=30)
    assert c.kind is ClaimKind.CLAIMED and c.lease is not None and c.item is not None
    assert (c.lease.epoch, c.item.attempt, c.item.status) == (1, 1, Status.RUNNING)
    renewed = harness.store.renew(c.lease, 30)
    assert renewed.expires_at >= c.lease.expires_at
    forged = type(c.lease)(**{**c.lease.__dict__, "token": "0" * 32})
    with pytest.raises(LeaseLost):
        harness.store.renew(forged, 30)
    with pytest.raises(LeaseLost):
        harness.store.commit(forged, Outcome(ok=True, result=1))
    done = harness.store.commit(renewed, Outcome(ok=True, result={"r": 1}))
    assert done.status is Status.SUCCEEDED and done.result == {"r": 1}
    # Same outcome again: a no-op. A different one: rejected.
    assert harness.store.commit(renewed, Outcome(ok=True, result={"r": 1})).status is Status.SUCCEEDED
    with pytest.raises(OutcomeConflict):
        harness.store.commit(renewed, Outcome(ok=True, result={"r": 2}))
    # Terminal items are skipped on redelivery.
    assert harness.store.claim(job.job_id, "t", owner="w:2", ttl_s=30).kind is ClaimKind.SKIPPED
    assert harness.store.get(job.job_id, "t").result == {"r": 1}


def test_stale_epoch_after_expiry_cannot_commit_or_renew(make_harness):
    h = make_harness(claim_ttl_s=1, renew_interval_s=0.3)
    job = h.dispatcher().submit(Submission(kind="echo", tenant="t"))
    first = h.store.claim(job.job_id, "t", owner="w:1", ttl_s=0.3)
    assert first.lease is not None
    time.sleep(0.5)
    report = h.store.sweep(redeliver_after_s=h.transport.redeliver_after_s)
    assert report.reclaimed == 1
    assert h.store.get(job.job_id, "t").status is Status.READY
    second = h.store.claim(job.job_id, "t", owner="w:2", ttl_s=30)
    assert second.kind is ClaimKind.CLAIMED and second.lease is not None
    assert second.lease.epoch == first.lease.epoch + 1
    with pytest.raises(LeaseLost):
        h.store.renew(first.lease, 30)
    with pytest.raises(LeaseLost):
        h.store.commit(first.lease, Outcome(ok=True, result="zombie"))
    assert h.store.commit(second.lease, Outcome(ok=True, result="live")).result == "live"


def test_cancel_from_every_non_terminal_state_fences_worker(harness):
    d = harness.dispatcher()
    ready = d.submit(Submission(kind="echo", tenant="t"))
    assert d.cancel(ready.job_id, "t")["status"] == "cancelled"
    parent = d.submit(Submission(kind="echo", tenant="t"))
    waiting = d.submit(Submission(kind="echo", tenant="t", dependencies=(parent.job_id,)))
    assert d.status(waiting.job_id, "t")["status"] == "submitted"
    assert d.cancel(waiting.job_id, "t")["status"] == "cancelled"
    c = harness.store.claim(parent.job_id, "t", owner="w:1", ttl_s=30)
    assert c.lease is not None
    assert d.cancel(parent.job_id, "t")["status"] == "cancelled"
    with pytest.raises(LeaseLost):
        harness.store.renew(c.lease, 30)
    with pytest.raises(LeaseLost):
        harness.store.effect_begin(c.lease, "k", 30)
    with pytest.raises(LeaseLost):
        harness.store.commit(c.lease, Outcome(ok=True))
    assert harness.store.get(parent.job_id, "t").status is Status.CANCELLED
    # Terminal: cancel again changes nothing.
    assert d.cancel(parent.job_id, "t")["status"] == "cancelled"


def test_deadline_expiry_cancels_with_reason_expired(harness):
    d = harness.dispatcher()
    job = d.submit(Submission(kind="echo", tenant="t", deadline_unix=time.time() + 0.2))
    time.sleep(0.4)
    c = harness.store.claim(job.job_id, "t", owner="w:1", ttl_s=30)
    assert c.kind is ClaimKind.EXPIRED
    view = d.status(job.job_id, "t")
    assert (view["status"], view["reason"]) == ("cancelled", "expired")
    # The reconciler expires them too, without a delivery.
    other = d.submit(Submission(kind="echo", tenant="t", deadline_unix=time.time() + 0.2))
    time.sleep(0.4)
    assert harness.store.sweep(redeliver_after_s=harness.transport.redeliver_after_s).expired == 1
    assert d.status(other.job_id, "t")["reason"] == "expired"


def test_expired_items_are_delivered_first(harness):
    d = harness.dispatcher()
    for _ in range(5):
        d.submit(Submission(kind="echo", tenant="t", priority=5))
    late = d.submit(Submission(kind="echo", tenant="t", deadline_unix=time.time() + 0.2))
    time.sleep(0.4)
    if harness.log:
        # A log cannot be reordered: the reconciler expires it promptly instead.
        assert harness.store.sweep(redeliver_after_s=harness.transport.redeliver_after_s).expired == 1
        assert d.status(late.job_id, "t")["reason"] == "expired"
        return
    first = get_delivery(harness.transport)
    assert Envelope.from_json(first.raw).job_id == late.job_id


def test_dependencies_release_and_cancel(harness):
    d = harness.dispatcher()
    a = d.submit(Submission(kind="echo", tenant="t"))
    b = d.submit(Submission(kind="echo", tenant="t", dependencies=(a.job_id,)))
    c = d.submit(Submission(kind="echo", tenant="t", dependencies=(b.job_id,)))
    assert d.status(b.job_id, "t")["status"] == "submitted"
    ca = harness.store.claim(a.job_id, "t", owner="w", ttl_s=30)
    assert ca.lease is not None
    harness.store.commit(ca.lease, Outcome(ok=True))
    assert d.status(b.job_id, "t")["status"] == "ready"  # released atomically with the commit
    get_for(harness.transport, b.job_id)
    cb = harness.store.claim(b.job_id, "t", owner="w", ttl_s=30)
    assert cb.lease is not None
    harness.store.commit(cb.lease, Outcome(ok=False, error="boom", retryable=False))
    view = d.status(c.job_id, "t")
    assert view["status"] == "cancelled" and view["reason"].startswith("dependency_failed")
    with pytest.raises(InvalidInput):
        d.submit(Submission(kind="echo", tenant="t", dependencies=("dispatch-" + "0" * 32,)))


def test_a_chain_longer_than_the_recursion_limit_cancels_to_its_end(harness):
    # Each job depends on the one before it; cancelling the first (the gateway's
    # cancel) or failing it (a worker's commit) must reach the last, however long.
    n = sys.getrecursionlimit() + 100
    d = harness.dispatcher()

    def chain(prefix: str) -> list[str]:
        ids = [f"{prefix}{i}" for i in range(n)]
        subs = [Submission(kind="echo", tenant="t", job_id=ids[0])]
        subs += [Submission(kind="echo", tenant="t", job_id=j, dependencies=(p,)) for p, j in itertools.pairwise(ids)]
        d.submit_many(subs)
        return ids

    cancelled = chain("cancelled-")
    assert d.cancel(cancelled[0], "t")["status"] == "cancelled"
    failed = chain("failed-")
    claim = harness.store.claim(failed[0], "t", owner="w", ttl_s=30)
    assert claim.lease is not None
    harness.store.commit(claim.lease, Outcome(ok=False, error="boom", retryable=False))
    for ids in (cancelled, failed):
        last = d.status(ids[-1], "t")
        assert last["status"] == "cancelled" and last["reason"] == f"dependency_failed:{ids[-2]}"
    assert harness.store.counts("t").get("submitted", 0) == 0


def test_a_big_batch_is_all_or_nothing_and_answers_each_job(harness):
    """A bulk submit may be written in chunks while it is planned (PostgreSQL
    streams them): every job still gets its own answer, in order, and a job
    that fails late in the batch leaves nothing of the batch behind."""
    d = harness.dispatcher()
    old = d.submit(Submission(kind="echo", tenant="t", job_id="bulk-old"))
    subs = [Submission(kind="echo", tenant=f"t{i % 7}", payload={"i": i}) for i in range(1000)]
    subs[450] = Submission(kind="echo", tenant="t", job_id="bulk-old")  # exists: answered, not written
    subs[451] = Submission(kind="echo", tenant="t", job_id="bulk-parent")
    subs[852] = Submission(kind="echo", tenant="t", job_id="bulk-child", dependencies=("bulk-parent",))
    subs[853] = Submission(kind="echo", tenant="t", job_id="bulk-parent")  # repeated: the first answers

    def ready() -> int:
        return len(d.jobs(None, Status.READY, limit=10_000))

    before = ready()
    handles = d.submit_many(subs)
    assert len(handles) == 1000 and len({h.job_id for h in handles}) == 999
    assert handles[450].job_id == "bulk-old"
    assert handles[853].job_id == handles[451].job_id == "bulk-parent"
    assert d.status("bulk-child", "t")["status"] == "submitted"
    assert d.status(old.job_id, "t")["status"] == "ready"
    assert harness.store.get(handles[999].job_id, "t5").payload == {"i": 999}
    assert ready() == before + 997  # bulk-old was there; the child waits for its parent
    # A bad dependency late in the batch: refused, and none of it was written.
    late = [Submission(kind="echo", tenant="u", payload={"i": i}) for i in range(900)]
    late[880] = Submission(kind="echo", tenant="u", dependencies=("bulk-no-such-parent",))
    with pytest.raises(InvalidInput):
        d.submit_many(late)
    assert ready() == before + 997
    assert d.jobs("u") == []


def test_one_batch_mixes_new_existing_and_dependent_jobs(harness):
    """A bulk submit writes in few statements: what each job becomes (and the
    order a reader sees) must be that of one submission after another."""
    d = harness.dispatcher()
    done = d.submit(Submission(kind="echo", tenant="t"))
    c = harness.store.claim(done.job_id, "t", owner="w", ttl_s=30)
    assert c.lease is not None
    harness.store.commit(c.lease, Outcome(ok=True))
    failed = d.submit(Submission(kind="echo", tenant="t"))
    d.cancel(failed.job_id, "t")
    old = d.submit(Submission(kind="echo", tenant="t", job_id="old-job"))
    handles = d.submit_many(
        [
            Submission(kind="echo", tenant="t", job_id="parent"),
            Submission(kind="echo", tenant="t", job_id="waits", dependencies=("parent",)),
            Submission(kind="echo", tenant="t", job_id="released", dependencies=(done.job_id,)),
            Submission(kind="echo", tenant="t", job_id="doomed", dependencies=(failed.job_id,)),
            Submission(kind="echo", tenant="t", job_id="old-job"),
            Submission(kind="echo", tenant="t", job_id="parent"),
        ]
    )
    assert [h.job_id for h in handles] == ["parent", "waits", "released", "doomed", "old-job", "parent"]
    status = {j: d.status(j, "t") for j in ("parent", "waits", "released", "doomed", "old-job")}
    assert {j: v["status"] for j, v in status.items()} == {
        "parent": "ready",
        "waits": "submitted",
        "released": "ready",
        "doomed": "cancelled",
        "old-job": "ready",
    }
    assert status["doomed"]["reason"].startswith("dependency_failed")
    seqs = [harness.store.get(j, "t").seq for j in ("parent", "waits", "released", "doomed")]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4 and seqs[0] > harness.store.get(old.job_id, "t").seq
    assert [e["event"] for e in d.history("released", "t")["events"]] == ["submitted", "released"]
    assert [e["event"] for e in d.history("doomed", "t")["events"]] == ["submitted", "cancelled"]
    # The ready ones are delivered; the waiting and the cancelled are not.
    want, delivered = {old.job_id, "parent", "released"}, set()
    deadline = time.monotonic() + 30
    quiet_until = None
    while time.monotonic() < (quiet_until or deadline):
        got = harness.transport.get("w", visibility_s=30, wait_s=0.2)
        if got is not None:
            delivered.add(Envelope.from_json(got.raw).job_id)
            harness.transport.ack(got)
        if quiet_until is None and want <= delivered:
            quiet_until = time.monotonic() + 1.0  # anything else would arrive by now
    assert want <= delivered and not delivered & {"waits", "doomed"}


def test_retry_backoff_then_dead_letter_then_replay(make_harness):
    h = make_harness(max_attempts=2)
    d = h.dispatcher()
    job = d.submit(Submission(kind="echo", tenant="t"))
    c1 = h.store.claim(job.job_id, "t", owner="w", ttl_s=30)
    assert c1.lease is not None
    item = h.store.commit(c1.lease, Outcome(ok=False, error="flaky"))
    assert item.status is Status.READY and item.ready_at > item.updated_at - 0.001
    wait_until(lambda: h.store.claim(job.job_id, "t", owner="w", ttl_s=30).kind is ClaimKind.CLAIMED, timeout=10)
    c2 = h.store.get(job.job_id, "t")
    assert c2.attempt == 2
    lease = type(c1.lease)(job.job_id, "t", c2.lease_owner or "", c2.lease_epoch, c2.lease_token or "", 0)
    dead = h.store.commit(lease, Outcome(ok=False, error="flaky again"))
    assert (dead.status, dead.reason) == (Status.DEAD_LETTER, "max_attempts")
    assert [i.id for i in d.jobs("t", Status.DEAD_LETTER)] == [job.job_id]
    view = d.replay(job.job_id, "t")
    assert view["status"] == "ready" and view["attempt"] == 2 and view["max_attempts"] > 2
    events = [e["event"] for e in d.history(job.job_id, "t")["events"]]
    assert events[0] == "submitted" and "replayed" in events
    with pytest.raises(Exception):  # noqa: B017 - only dead_letter can be replayed
        d.replay(job.job_id, "t")


def test_admission_bound_under_concurrent_submitters(make_harness):
    import threading

    h = make_harness(max_depth=40)
    accepted: list[str] = []
    rejected: list[str] = []
    lock = threading.Lock()

    def submitter(n: int) -> None:
        d = h.dispatcher()
        for i in range(15):
            try:
                handle = d.submit(Submission(kind="echo", tenant=f"t{n}", job_id=f"adm-{n}-{i}"))
                with lock:
                    accepted.append(handle.job_id)
            except QueueFull as exc:
                assert "AGENT_DISPATCH_MAX_DEPTH" in str(exc)
                with lock:
                    rejected.append(f"{n}-{i}")

    threads = [threading.Thread(target=submitter, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) == 40 and len(rejected) == 120 - 40
    active = sum(v for k, v in h.store.counts(None).items() if k in ("submitted", "ready", "leased", "running"))
    assert active == 40


def test_idempotent_resubmission_and_tenant_isolation(harness):
    d = harness.dispatcher()
    a = d.submit(Submission(kind="echo", tenant="acme", idempotency_key="order-17"))
    b = d.submit(Submission(kind="echo", tenant="acme", idempotency_key="order-17"))
    assert a.job_id == b.job_id
    assert len(d.jobs("acme")) == 1
    with pytest.raises(JobNotFound, match=f"Job {a.job_id} not found"):
        d.status(a.job_id, "other")
    with pytest.raises(JobNotFound):
        d.cancel(a.job_id, "other")
    assert d.status(a.job_id, "acme")["status"] == "ready"


def _submit_together(d, key: str, n: int) -> tuple[list[str], list[BaseException]]:
    """``n`` threads submit one idempotency key at the same moment."""
    import threading

    barrier = threading.Barrier(n)
    handles: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def submit() -> None:
        barrier.wait()
        try:
            handle = d.submit(Submission(kind="echo", tenant="acme", idempotency_key=key))
        except BaseException as exc:
            with lock:
                errors.append(exc)
        else:
            with lock:
                handles.append(handle.job_id)

    threads = [threading.Thread(target=submit) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return handles, errors


def test_concurrent_resubmissions_of_one_key_share_one_job(harness):
    # A client retrying while its first request is still in flight: every
    # request answers with the one job, none fails, exactly one delivery.
    d = harness.dispatcher()
    for round_ in range(5):
        handles, errors = _submit_together(d, f"retry-{round_}", 8)
        assert errors == [] and len(handles) == 8 and len(set(handles)) == 1, errors[:2]
    assert len(d.jobs("acme")) == 5
    assert harness.store.counts("acme") == {"ready": 5}


def test_session_exclusion_and_order(harness):
    d = harness.dispatcher()
    first = d.submit(Submission(kind="echo", tenant="t", session_id="s1"))
    second = d.submit(Submission(kind="echo", tenant="t", session_id="s1"))
    assert harness.store.claim(second.job_id, "t", owner="w:2", ttl_s=30).kind is ClaimKind.BUSY
    c1 = harness.store.claim(first.job_id, "t", owner="w:1", ttl_s=30)
    assert c1.lease is not None
    assert harness.store.claim(second.job_id, "t", owner="w:2", ttl_s=30).kind is ClaimKind.BUSY
    harness.store.commit(c1.lease, Outcome(ok=True))
    assert harness.store.claim(second.job_id, "t", owner="w:2", ttl_s=30).kind is ClaimKind.CLAIMED


def test_poison_recorded_once_and_tenant_mismatch_never_runs(harness):
    from dataclasses import replace

    from agentdispatch.handlers import builtins

    ran: list[str] = []
    reg = builtins()
    reg.add("echo", lambda turn, guard: ran.append(turn.job_id))
    worker = harness.worker(reg, threads=1)
    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="echo", tenant="t")) for _ in range(3)]
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        for _ in range(2):
            delivery = get_delivery(harness.transport)
            assert (
                worker.process(replace(delivery, raw='{"not": "an envelope"'), owner="t:0", index=0, loop=loop)
                == "poison"
            )
        assert len(harness.store.poison(limit=10)) == 1  # once, however often redelivered
        delivery = get_delivery(harness.transport)
        env = Envelope.from_json(delivery.raw)
        forged = env.model_copy(update={"tenant": "mallory"}).to_json()
        assert worker.process(replace(delivery, raw=forged), owner="t:0", index=0, loop=loop) == "poison"
        assert env.job_id not in ran
        assert harness.store.get(env.job_id, "t").status is Status.READY
    finally:
        loop.close()
    assert len(harness.store.poison(limit=10)) == 2
    assert {j.job_id for j in jobs}


def test_stale_receipt_ack_deletes_nothing(harness):
    harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    first = get_delivery(harness.transport, owner="a:0", visibility_s=0.2)
    # Past the visibility and past the moment every transport notices it (the
    # Kafka keepalive hands the partitions off within a second). A consumer
    # joining while another leaves can wedge Tansu's group for good (it elects
    # the departed member leader); Apache Kafka completes that rebalance.
    time.sleep(1.5)
    second = get_delivery(harness.transport, owner="b:0", visibility_s=30)
    assert first.raw == second.raw
    assert harness.transport.ack(first) is False
    assert harness.transport.ack(second) is True


def test_side_effect_runs_once_across_redelivery(harness):
    from agentdispatch.lease import LeaseGuard

    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    calls: list[int] = []
    c1 = harness.store.claim(job.job_id, "t", owner="w:1", ttl_s=30)
    assert c1.lease is not None
    g1 = LeaseGuard(harness.store, c1.lease, ttl_s=30, renew_interval_s=10)
    assert g1.side_effect("email:1", lambda: calls.append(1) or "msg-1") == "msg-1"
    harness.store.commit(g1.lease, Outcome(ok=False, error="crashed after the email"))
    wait_until(lambda: harness.store.claim(job.job_id, "t", owner="w:2", ttl_s=30).kind is ClaimKind.CLAIMED)
    item = harness.store.get(job.job_id, "t")
    lease2 = type(c1.lease)(job.job_id, "t", "w:2", item.lease_epoch, item.lease_token or "", 0)
    g2 = LeaseGuard(harness.store, lease2, ttl_s=30, renew_interval_s=10)
    assert g2.side_effect("email:1", lambda: calls.append(2) or "msg-2") == "msg-1"
    assert calls == [1]
    ledger = harness.store.history(job.job_id, "t")["side_effects"]
    assert [(e["key"], e["state"]) for e in ledger] == [("email:1", "committed")]


def test_workers_drain_sessions_serially(harness):
    import threading

    from agentdispatch.handlers import Registry

    intervals: dict[str, list[tuple[float, float, int]]] = {}
    lock = threading.Lock()

    def handler(turn, guard):
        start = time.monotonic()
        time.sleep(0.01)
        with lock:
            # A session is scoped by its tenant: key by both.
            key = f"{turn.tenant}/{turn.session_id}"
            intervals.setdefault(key, []).append((start, time.monotonic(), turn.payload["i"]))

    reg = Registry()
    reg.add("work", handler)
    d = harness.dispatcher()
    handles = d.submit_many(
        [Submission(kind="work", tenant=f"t{i % 2}", session_id=f"s{i % 5}", payload={"i": i}) for i in range(60)]
    )
    worker = harness.worker(reg, threads=4)
    worker.start()
    try:
        wait_until(lambda: all(harness.store.get(h.job_id, None).status.terminal for h in handles), timeout=60)
    finally:
        worker.stop(grace_s=5)
    assert {harness.store.get(h.job_id, None).status for h in handles} == {Status.SUCCEEDED}
    for spans in intervals.values():
        spans.sort()
        for (_s0, e0, i0), (s1, _e1, i1) in itertools.pairwise(spans):
            assert s1 >= e0, "two turns of one session overlapped"
            assert i1 > i0, "turns of one session ran out of order"


def test_unknown_kind_fails_with_clear_reason(harness):
    from agentdispatch.handlers import builtins

    d = harness.dispatcher()
    job = d.submit(Submission(kind="no_such_kind", tenant="t"))
    worker = harness.worker(builtins(), threads=1)
    worker.start()
    try:
        wait_until(lambda: harness.store.get(job.job_id, "t").status.terminal)
    finally:
        worker.stop(grace_s=5)
    view = d.status(job.job_id, "t")
    assert view["status"] == "failed" and "unknown kind 'no_such_kind'" in view["error"]


def test_heartbeat_rows(harness):
    from agentdispatch.handlers import builtins

    worker = harness.worker(builtins(), threads=3)
    worker.start()
    try:
        wait_until(lambda: any(w.worker_id == worker.worker_id for w in harness.store.workers()))
        row = next(w for w in harness.store.workers() if w.worker_id == worker.worker_id)
        assert row.capacity == 3 and row.host.startswith("host-") and row.queue_backend == harness.transport.name
    finally:
        worker.stop(grace_s=5)
    assert all(w.worker_id != worker.worker_id for w in harness.store.workers())


Pending = Callable[[], None]


def test_async_handlers_and_side_effects_run_on_the_worker_loop(harness):
    import asyncio

    from agentdispatch.handlers import Registry

    reg = Registry()

    @reg.register("async_turn")
    async def async_turn(turn, guard):
        await asyncio.sleep(0.01)
        sent = guard.side_effect(f"send:{turn.job_id}", lambda: {"sent": turn.payload["n"]})
        return {"n": turn.payload["n"], "sent": sent}

    d = harness.dispatcher()
    jobs = [d.submit(Submission(kind="async_turn", tenant="t", payload={"n": i})) for i in range(5)]
    worker = harness.worker(reg, threads=2)
    worker.start()
    try:
        wait_until(lambda: all(harness.store.get(j.job_id, "t").status.terminal for j in jobs))
    finally:
        worker.stop(grace_s=5)
    for i, j in enumerate(jobs):
        view = d.status(j.job_id, "t")
        assert view["status"] == "succeeded" and view["result"] == {"n": i, "sent": {"sent": i}}
        assert harness.store.history(j.job_id, "t")["side_effects"][0]["state"] == "committed"


def test_reconciler_heals_a_missed_dependency_release(harness):
    from dataclasses import replace

    d = harness.dispatcher()
    parent = d.submit(Submission(kind="echo", tenant="t"))
    child = d.submit(Submission(kind="echo", tenant="t", dependencies=(parent.job_id,)))
    c = harness.store.claim(parent.job_id, "t", owner="w", ttl_s=30)
    assert c.lease is not None
    harness.store.commit(c.lease, Outcome(ok=True))
    # Force the state a lost release would leave: child still waiting.
    with harness.store.transaction(durable=True) as tx:
        item = tx.load(child.job_id)
        tx.save(replace(item, status=Status.SUBMITTED))
    assert d.status(child.job_id, "t")["status"] == "submitted"
    from agentdispatch.reconciler import reconcile_once

    reconcile_once(harness.store, harness.transport)  # repairs, then relays (Kafka)
    assert d.status(child.job_id, "t")["status"] == "ready"
    get_for(harness.transport, child.job_id, timeout=40)
