"""Contract: the side-effect ledger on every store/transport (SPEC section 7).

A long effect keeps its lease; an effect whose outcome the worker did not see
is never recorded as committed; a stale attempt cannot change the ledger; an
unknown effect is settled by ``verify`` or an idempotent downstream."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from agentdispatch import NOT_HAPPENED, EffectInFlight, EffectUnknown, InvalidInput, LeaseLost, Status, Submission
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.handlers import Registry
from agentdispatch.lease import LeaseGuard
from agentdispatch.stores.base import ClaimKind
from agentdispatch.workitem import Lease, Outcome

from .helpers import wait_until

TTL = {"claim_ttl_s": 1.0, "renew_interval_s": 0.25}


def _claim(h, job_id: str, owner: str, ttl_s: float = 30.0) -> Lease:
    got = []

    def once() -> bool:
        got.append(h.store.claim(job_id, "t", owner=owner, ttl_s=ttl_s))
        return got[-1].kind is ClaimKind.CLAIMED

    wait_until(once)
    assert got[-1].lease is not None
    return got[-1].lease


def _die_during_effect(h, job_id: str, key: str) -> Lease:
    """Attempt 1 marks ``key`` intended and dies: its lease lapses and the
    reconciler's sweep gives the turn back. Returns that stale lease."""
    lease = _claim(h, job_id, "w:1", ttl_s=0.3)
    assert h.store.effect_begin(lease, key, 0.3) is None
    wait_until(lambda: h.store.sweep(redeliver_after_s=h.transport.redeliver_after_s).reclaimed >= 1)
    return lease


def _ledger(h, job_id: str) -> list[tuple[str, str, int]]:
    return [(e["key"], e["state"], e["epoch"]) for e in h.store.history(job_id, "t")["side_effects"]]


def _events(h, job_id: str) -> list[str]:
    return [e["event"] for e in h.store.history(job_id, "t")["events"]]


def _run_one(h, registry: Registry, job_id: str) -> None:
    worker = h.worker(registry, threads=1)
    worker.start()
    try:
        wait_until(lambda: h.store.get(job_id, "t").status.terminal, timeout=60)
    finally:
        worker.stop(grace_s=5)


def test_an_effect_three_ttls_long_keeps_its_lease_and_commits_once(make_harness):
    h = make_harness(**TTL)
    calls: list[int] = []
    reg = Registry()

    @reg.register("long_effect")
    def long_effect(turn, guard):
        def send() -> str:
            calls.append(turn.attempt)
            time.sleep(3 * h.settings.claim_ttl_s)  # a model or tool call slower than the TTL
            return "sent"

        return guard.side_effect(f"reply:{turn.job_id}", send)

    job = h.dispatcher().submit(Submission(kind="long_effect", tenant="t"))
    _run_one(h, reg, job.job_id)
    item = h.store.get(job.job_id, "t")
    assert (item.status, item.attempt, item.result) == (Status.SUCCEEDED, 1, "sent")
    assert calls == [1]
    assert "lease_expired" not in _events(h, job.job_id)
    assert _ledger(h, job.job_id) == [(f"reply:{job.job_id}", "committed", 1)]


@contextmanager
def _dropping_provider(hold_s: float) -> Iterator[tuple[int, list[bytes]]]:
    """A loopback provider that reads each request, holds it ``hold_s``, then
    drops the connection without answering."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                seen.append(conn.recv(65536))
                stop.wait(hold_s)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], seen
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


@pytest.mark.parametrize("verified", [False, True], ids=["plain", "verify"])
def test_an_effect_cut_by_a_lost_connection_is_never_recorded_committed(make_harness, verified):
    h = make_harness(**TTL)
    reg = Registry()
    with _dropping_provider(hold_s=2 * h.settings.claim_ttl_s) as (port, seen):

        @reg.register("send")
        def send_turn(turn, guard):
            key = f"reply:{turn.job_id}"

            def send() -> int:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    conn.request("POST", "/send", body=key, headers={"Idempotency-Key": key})
                    return conn.getresponse().status
                finally:
                    conn.close()

            try:
                if verified:
                    return guard.side_effect(key, send, verify=lambda: NOT_HAPPENED)
                return guard.side_effect(key, send)
            except ConnectionError as exc:
                return {"delivered": False, "error": type(exc).__name__}

        job = h.dispatcher().submit(Submission(kind="send", tenant="t"))
        _run_one(h, reg, job.job_id)
    item = h.store.get(job.job_id, "t")
    # The lease held through the cut effect: the turn finished in its attempt.
    assert (item.status, item.attempt) == (Status.SUCCEEDED, 1)
    assert item.result["delivered"] is False  # reset or closed: either way no answer came
    assert len(seen) == 1 and f"reply:{job.job_id}".encode() in seen[0]
    assert "lease_expired" not in _events(h, job.job_id)
    assert _ledger(h, job.job_id) == [(f"reply:{job.job_id}", "unknown" if verified else "failed", 1)]


def test_a_stale_attempt_cannot_change_the_ledger(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    key = f"email:{job.job_id}"
    stale = _die_during_effect(harness, job.job_id, key)
    live = _claim(harness, job.job_id, "w:2")
    guard = LeaseGuard(harness.store, live, ttl_s=30, renew_interval_s=10)
    with pytest.raises(EffectUnknown):
        guard.side_effect(key, lambda: "sent twice")
    dead = harness.store.commit(
        live, Outcome(ok=False, error="unknown effect", retryable=False, dead_letter_reason="effect_unknown")
    )
    assert (dead.status, dead.reason) == (Status.DEAD_LETTER, "effect_unknown")
    # The stale attempt's late answer does not contradict the dead-letter queue.
    assert harness.store.effect_end(stale, key, state="committed", result={"late": True}) is False
    assert _ledger(harness, job.job_id) == [(key, "unknown", 1)]
    harness.store.replay(job.job_id, "t")
    assert harness.store.effect_end(stale, key, state="committed", result={"late": True}) is False
    assert _ledger(harness, job.job_id) == [(key, "released", 1)]


class _AfterBegin:
    """The store, calling ``after()`` once each effect begin has landed."""

    def __init__(self, store: object, after: Callable[[], None]) -> None:
        self.store, self.after = store, after

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def effect_begin(self, *args: object, **kwargs: object) -> object:
        got = self.store.effect_begin(*args, **kwargs)  # type: ignore[attr-defined]
        self.after()
        return got


def test_no_effect_starts_when_the_guard_is_revoked_during_its_begin(harness):
    # A sync handler's thread cannot be interrupted: its turn timed out (or
    # its lease went unconfirmed) while the begin was in flight. The mark
    # lands, but the effect must not start.
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    lease = _claim(harness, job.job_id, "w:1")

    guard = LeaseGuard(
        _AfterBegin(harness.store, lambda: guard.revoke("timed out")),  # type: ignore[arg-type]
        lease,
        ttl_s=30,
        renew_interval_s=10,
    )
    ran: list[int] = []
    with pytest.raises(LeaseLost):
        guard.side_effect("send", lambda: ran.append(1))
    assert ran == []
    assert _ledger(harness, job.job_id) == [("send", "failed", lease.epoch)]


def test_a_begin_whose_commit_answer_was_lost_leaves_no_doubt(harness):
    # A database restart cut the answer to the begin's COMMIT, which landed:
    # fn never ran, so the next attempt must run it, not dead-letter the turn.
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    lease = _claim(harness, job.job_id, "w:1")

    def cut() -> None:
        raise TaskQueueUnavailable("PostgreSQL connection lost during COMMIT; the outcome is unknown")

    guard = LeaseGuard(_AfterBegin(harness.store, cut), lease, ttl_s=30, renew_interval_s=10)  # type: ignore[arg-type]
    ran: list[int] = []
    with pytest.raises(TaskQueueUnavailable):
        guard.side_effect("send", lambda: ran.append(1))
    assert ran == [] and _ledger(harness, job.job_id) == [("send", "failed", lease.epoch)]
    harness.store.renew_many([lease], 0)  # the attempt gave up: its lease runs out
    second = LeaseGuard(harness.store, _claim(harness, job.job_id, "w:2"), ttl_s=30, renew_interval_s=10)
    second.side_effect("send", lambda: ran.append(2))
    assert ran == [2]


def test_the_attempt_that_marked_an_effect_settles_it_once(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    lease = _claim(harness, job.job_id, "w:1")
    assert harness.store.effect_begin(lease, "k", 30) is None
    assert harness.store.effect_end(lease, "k", state="committed", result=1) is True
    assert harness.store.effect_end(lease, "k", state="committed", result=1) is True  # a retried COMMIT
    assert harness.store.effect_end(lease, "k", state="failed", result=None) is False
    assert _ledger(harness, job.job_id) == [("k", "committed", 1)]


@pytest.mark.parametrize("mode", ["happened", "not_happened", "idempotent", "undeclared"])
def test_verify_or_an_idempotent_downstream_settles_an_unknown_effect(harness, mode):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    key = f"email:{job.job_id}"
    _die_during_effect(harness, job.job_id, key)
    guard = LeaseGuard(harness.store, _claim(harness, job.job_id, "w:2"), ttl_s=30, renew_interval_s=10)
    calls: list[str] = []

    def send() -> str:
        calls.append("send")
        return "msg-2"

    if mode == "undeclared":
        with pytest.raises(EffectUnknown):
            guard.side_effect(key, send)
        assert (calls, _ledger(harness, job.job_id)) == ([], [(key, "unknown", 1)])
        return
    if mode == "happened":
        got = guard.side_effect(key, send, verify=lambda: "msg-1")
    elif mode == "not_happened":
        got = guard.side_effect(key, send, verify=lambda: NOT_HAPPENED)
    else:
        got = guard.side_effect(key, send, idempotent=True)
    want = "msg-1" if mode == "happened" else "msg-2"
    assert got == want
    assert calls == ([] if mode == "happened" else ["send"])
    assert _ledger(harness, job.job_id) == [(key, "committed", 2)]
    assert harness.store.history(job.job_id, "t")["side_effects"][0]["result"] == want
    # A later attempt gets the settled record back without asking again.
    assert guard.side_effect(key, send, verify=lambda: NOT_HAPPENED) == want


def test_a_key_in_flight_in_another_job_is_not_doubted(harness):
    # Keys are tenant-wide: two jobs may share one (a reply both would send).
    d = harness.dispatcher()
    first, second = (d.submit(Submission(kind="echo", tenant="t")).job_id for _ in range(2))
    a = _claim(harness, first, "w:1")
    b = _claim(harness, second, "w:2")
    assert a.epoch == b.epoch == 1
    assert harness.store.effect_begin(a, "reply:42", 30) is None
    # Not "this attempt's" (same epoch, other job), and not unknown: a is alive.
    with pytest.raises(EffectInFlight):
        harness.store.effect_begin(b, "reply:42", 30)
    assert harness.store.effect_end(a, "reply:42", state="committed", result="m-1") is True
    done = harness.store.effect_begin(b, "reply:42", 30)
    assert done is not None and (done.state, done.result) == ("committed", "m-1")


def test_a_key_a_dead_job_left_is_taken_over_by_the_job_that_verifies_it(harness):
    d = harness.dispatcher()
    gone, live = (d.submit(Submission(kind="echo", tenant="t")).job_id for _ in range(2))
    _die_during_effect(harness, gone, "reply:7")
    lease = _claim(harness, live, "w:2")
    doubted = harness.store.effect_begin(lease, "reply:7", 30)
    assert doubted is not None and doubted.state == "unknown"
    # The downstream says it never happened: this job runs it and owns the record.
    assert harness.store.effect_begin(lease, "reply:7", 30, retry_unknown=True) is None
    assert harness.store.effect_end(lease, "reply:7", state="committed", result="m-7") is True
    assert _ledger(harness, live) == [("reply:7", "committed", lease.epoch)]
    assert _ledger(harness, gone) == []


def test_a_key_no_store_can_hold_is_refused_before_anything_runs(harness):
    # A NUL made the ledger write fail on PostgreSQL, reported as a database
    # outage ("check STATE_DB_URI"); SQLite took it.
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    guard = LeaseGuard(harness.store, _claim(harness, job.job_id, "w:1"), ttl_s=30, renew_interval_s=10)
    ran: list[int] = []
    for key in ("reply\x00", "reply\ud800", 7):
        with pytest.raises(InvalidInput, match="key"):
            guard.side_effect(key, lambda: ran.append(1))  # type: ignore[arg-type]
    assert ran == [] and _ledger(harness, job.job_id) == []
    assert guard.side_effect("reply", lambda: "sent") == "sent"
