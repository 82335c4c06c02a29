"""Off the request path: engagement, loop guard, coalescing, steering,
staleness, route rejections, capacity, scrub, one reply per turn."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentdispatch.intake import admin
from agentdispatch.intake import processor as proc
from agentdispatch.intake.admit import Incoming, admit
from agentdispatch.intake.answers import ok
from agentdispatch.intake.processor import Context
from agentdispatch.workitem import Status
from backends import sqlite_harness
from intake.turnkit import Rig, make_rig, recording_server, registry


@pytest.fixture()
def rig(tmp_path: Path) -> Iterator[Rig]:
    h = sqlite_harness(tmp_path, claim_ttl_s=10, renew_interval_s=2)
    with recording_server() as rec:
        yield make_rig(h, rec, tmp_path)
    h.close()


def run(rig: Rig, *jobs: str, threads: int = 2, respond: proc.Respond | None = None) -> None:
    w = rig.h.worker(registry(rig.h, respond), threads=threads, reconcile=False)
    w.start()
    try:
        rig.wait(*jobs)
    finally:
        w.stop(grace_s=5)


def test_reply_once_with_idempotency_key_and_loop_guard(rig: Rig) -> None:
    job = rig.dm("hello")
    mine = rig.dm("my own words", sender="U0BOT", self_authored=True)
    channel = rig.dm("chatter in a channel", conversation="C9", is_dm=False)
    run(rig, job, mine, channel)
    calls = rig.replies()
    assert len(calls) == 1
    path, key, body = calls[0]
    assert path == "/chat.postMessage" and key == f"intake-reply:{job}:0" and body["text"] == "re: hello"
    assert (rig.receipt(mine)["state"], rig.receipt(mine)["reason"]) == ("ignored", "self_authored")
    assert rig.receipt(channel)["reason"] == "not_engaged"
    roles = rig.ist.history(rig.inst["id"], "D1", 10)
    assert {r["role"] for r in roles} == {"user", "self", "agent"}


def test_mention_and_message_pair_is_one_turn(rig: Rig) -> None:
    a = rig.dm("<@U0BOT> hi", conversation="C1", is_dm=False, mentions_bot=True, message_key="C1:1.0")
    b = rig.dm("<@U0BOT> hi", conversation="C1", is_dm=False, mentions_bot=True, message_key="C1:1.0")
    run(rig, a, b)
    assert len(rig.replies()) == 1
    assert sorted([rig.receipt(a)["state"], rig.receipt(b)["state"]]) == ["collapsed", "replied"]


def test_ready_triggers_coalesce_to_the_newest(rig: Rig) -> None:
    jobs = [rig.dm(f"m{i}", sender=f"U{i}") for i in range(3)]
    run(rig, *jobs)
    states = [rig.receipt(j)["state"] for j in jobs]
    assert states == ["coalesced", "coalesced", "replied"]
    assert rig.receipt(jobs[0])["reason"] == f"coalesced_into:{jobs[2]}"
    assert len(rig.replies()) == 1


def test_follow_up_of_the_same_requester_is_steered_into_the_run(rig: Rig) -> None:
    started, go = threading.Event(), threading.Event()
    seen: list[list[str]] = []

    def slow(ctx: Context) -> str:
        seen.append(ctx.texts)
        started.set()
        go.wait(10)
        return "re: " + " + ".join(ctx.texts)

    first = rig.dm("first")
    w = rig.h.worker(registry(rig.h, slow), threads=2, reconcile=False)
    w.start()
    try:
        assert started.wait(10)
        follow = rig.dm("and also this")
        other = rig.dm("someone else", sender="U2")
        time.sleep(0.2)
        go.set()
        rig.wait(first, follow, other)
    finally:
        w.stop(grace_s=5)
    assert rig.receipt(follow)["state"] == "steered" and rig.receipt(follow)["steered_into"] == first
    assert ["first", "and also this"] in seen
    texts = [b["text"] for _, _, b in rig.replies()]
    assert texts == ["re: first + and also this", "re: someone else"]


def test_stale_trigger_is_retired_not_deleted(rig: Rig) -> None:
    job = rig.dm("old news")
    with rig.sql() as c:
        c.execute("UPDATE intake_receipts SET received_at = received_at - 301 WHERE id = ?", (job,))
    run(rig, job)
    assert (rig.receipt(job)["state"], rig.receipt(job)["reason"]) == ("stale", "stale")
    item = rig.h.store.get(job, None)
    assert (item.status, item.reason) == (Status.CANCELLED, "stale")
    assert rig.replies() == []


@pytest.mark.parametrize("change", ["agent_disabled", "installation_stopped", "missing_route", "route_reassigned"])
def test_route_re_resolved_at_execution(rig: Rig, change: str) -> None:
    job = rig.dm("hello")
    if change == "agent_disabled":
        admin.set_agent(rig.ist, "helper", enabled=False)
    elif change == "installation_stopped":
        admin.set_installation_status(rig.ist, rig.inst["id"], "stopped")
    elif change == "missing_route":
        admin.set_route(rig.ist, rig.inst["id"], "*", None)
    else:
        admin.set_agent(rig.ist, "other", enabled=True)
        admin.set_route(rig.ist, rig.inst["id"], "*", "other")
    run(rig, job)
    item = rig.h.store.get(job, None)
    assert (item.status, item.reason) == (Status.FAILED, change) and change in (item.error or "")
    assert (rig.receipt(job)["state"], rig.receipt(job)["reason"]) == ("rejected", change)
    assert rig.replies() == []


@pytest.mark.parametrize(("per_agent", "per_install", "bound"), [(1, 16, 1), (4, 2, 2)])
def test_capacity_bounds(tmp_path: Path, per_agent: int, per_install: int, bound: int) -> None:
    h = sqlite_harness(tmp_path, mesh_max_turns_per_agent=per_agent, mesh_max_turns=per_install)
    active, peak, lock = [0], [0], threading.Lock()

    def busy(ctx: Context) -> str:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.4)
        with lock:
            active[0] -= 1
        return "done"

    with recording_server() as rec:
        rig = make_rig(h, rec, tmp_path)
        jobs = [rig.dm(f"q{i}", conversation=f"D{i}") for i in range(5)]
        run(rig, *jobs, threads=4, respond=busy)
        assert peak[0] == bound
        assert len(rig.replies()) == 5
    h.close()


def test_scrub_keeps_the_identity_and_catches_a_late_duplicate(rig: Rig) -> None:
    job = rig.dm("remember me")
    run(rig, job)
    with rig.sql() as c:
        c.execute("UPDATE intake_receipts SET received_at = received_at - 8 * 86400 WHERE id = ?", (job,))
    assert rig.ist.scrub(7 * 86400.0) == 1
    row = rig.receipt(job)
    assert row["envelope"] is None and row["raw"] is None and row["source_id"] and row["state"] == "replied"
    late = Incoming("slack", row["source_id"], b"late copy", ok(), rig.inst, state="accepted")
    admit(rig.ist, rig.h.dispatcher(), late, abandoned=threading.Event())
    assert len(rig.h.store.list_jobs(tenant=None, status=None, limit=100, offset=0)) == 1
    assert rig.receipt(job)["mismatches"] == 1


def test_a_redelivered_turn_never_replies_twice(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    real, failed = proc.record_reply, []

    def flaky(*a: object, **kw: object) -> None:
        if not failed:
            failed.append(1)
            raise RuntimeError("crash after the reply went out")
        real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(proc, "record_reply", flaky)
    job = rig.dm("once please")
    run(rig, job)
    item = rig.h.store.get(job, None)
    assert item.status is Status.SUCCEEDED and item.attempt == 2
    assert len(rig.replies()) == 1


def test_reacquisitions_per_phase_are_bounded(rig: Rig) -> None:
    job = rig.dm("again and again")
    with rig.sql() as c:
        c.execute("UPDATE intake_receipts SET intake_attempts = 4 WHERE id = ?", (job,))
    run(rig, job)
    assert rig.receipt(job)["reason"] == "intake_reacquisitions_exhausted"
    assert rig.h.store.get(job, None).status is Status.FAILED
