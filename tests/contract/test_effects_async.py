"""Contract: ``guard.side_effect_async`` keeps the same at-most-once ledger
as ``side_effect`` (replay after a crash, unknown when interrupted, verify,
the fence), on every store."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentdispatch import NOT_HAPPENED, EffectUnknown, LeaseGuard, LeaseLost, Submission
from agentdispatch.errors import TaskQueueUnavailable
from agentdispatch.lease import Fence
from agentdispatch.runtime.ledger import Ledger
from agentdispatch.stores.base import ClaimKind, LedgerOp


def _attempt(harness, job_id: str) -> LeaseGuard:
    claim = harness.store.claim(job_id, "t", owner="w:1", ttl_s=30)
    assert claim.kind is ClaimKind.CLAIMED and claim.lease is not None
    return LeaseGuard(harness.store, claim.lease, ttl_s=30, renew_interval_s=10)


def _crash(harness, guard: LeaseGuard) -> None:
    """The attempt's process died: its lease is given up (as if it expired)."""
    harness.store.renew_many([guard.lease], 0)


def _ledger(harness, job_id: str) -> list[tuple[str, str]]:
    return [(e["key"], e["state"]) for e in harness.store.history(job_id, "t")["side_effects"]]


def test_a_recorded_effect_is_replayed_not_rerun_after_a_crash(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    runs: list[Fence] = []

    async def send(fence: Fence) -> dict[str, int]:
        runs.append(fence)
        return {"msg": 7}

    first = _attempt(harness, job.job_id)
    assert asyncio.run(first.side_effect_async("send", send)) == {"msg": 7}
    assert runs == [Fence(job.job_id, first.lease.epoch, first.lease.token)]
    _crash(harness, first)
    second = _attempt(harness, job.job_id)
    assert asyncio.run(second.side_effect_async("send", send)) == {"msg": 7}
    assert len(runs) == 1 and _ledger(harness, job.job_id) == [("send", "committed")]


def test_an_effect_cancelled_mid_await_is_unknown_and_verify_settles_it(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    first = _attempt(harness, job.job_id)

    async def cancelled_during_send() -> None:
        async def send() -> None:
            await asyncio.sleep(3600)

        task = asyncio.create_task(first.side_effect_async("send", send))
        while _ledger(harness, job.job_id) != [("send", "intended")]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_during_send())
    assert _ledger(harness, job.job_id) == [("send", "unknown")]
    _crash(harness, first)
    second = _attempt(harness, job.job_id)

    async def never() -> str:
        raise AssertionError("must not run")

    with pytest.raises(EffectUnknown):
        asyncio.run(second.side_effect_async("send", never))

    async def not_there() -> object:
        return NOT_HAPPENED

    async def send_again() -> str:
        return "sent"

    assert asyncio.run(second.side_effect_async("send", send_again, verify=not_there)) == "sent"
    assert _ledger(harness, job.job_id) == [("send", "committed")]


def test_no_effect_starts_once_the_guard_is_revoked_or_fenced(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    guard = _attempt(harness, job.job_id)
    ran: list[int] = []

    async def send() -> None:
        ran.append(1)

    guard.revoke("the worker is stopping")
    with pytest.raises(LeaseLost):
        asyncio.run(guard.side_effect_async("a", send))
    harness.store.cancel(job.job_id, "t")
    fresh = LeaseGuard(harness.store, guard.lease, ttl_s=30, renew_interval_s=10)
    with pytest.raises(LeaseLost):
        asyncio.run(fresh.side_effect_async("b", send))
    assert ran == [] and _ledger(harness, job.job_id) == []


class _CutCommit:
    """The store, but the first ledger batch holding an op of ``state`` (None:
    a begin) loses its COMMIT's answer, as in a database restart: the batch
    landed or not (``landed``), and the caller hears that the outcome is unknown."""

    def __init__(self, store: object, state: str | None, landed: bool) -> None:
        self.store, self.state, self.landed, self.cut = store, state, landed, False

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def ledger_many(self, ops: list[LedgerOp]) -> list[object]:
        if not self.cut and any(op.state == self.state for op in ops):
            self.cut = True
            if self.landed:
                self.store.ledger_many(ops)  # type: ignore[attr-defined]
            raise TaskQueueUnavailable("PostgreSQL connection lost during COMMIT; the outcome is unknown")
        return self.store.ledger_many(ops)  # type: ignore[attr-defined,no-any-return]


def _send_with_cut(harness, state: str | None, landed: bool):
    """A first attempt, an effect that notes each run, and a coroutine that
    runs it once through a ledger whose first batch holding ``state`` is cut."""
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    guard = _attempt(harness, job.job_id)
    ran: list[int] = []

    async def send() -> str:
        ran.append(1)
        return "sent"

    async def run() -> str:
        with ThreadPoolExecutor(1) as pool:
            guard.ledger = Ledger(_CutCommit(harness.store, state, landed), pool).submit  # type: ignore[arg-type]
            return await guard.side_effect_async("send", send)

    return job, guard, ran, send, run


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "lost"])
def test_a_settlement_whose_commit_was_cut_is_written_again(harness, landed):
    job, _guard, ran, _send, run = _send_with_cut(harness, "committed", landed)
    # The effect happened and the worker saw it: a lost answer to the record
    # must not leave it "intended" (the next attempt would dead-letter the turn).
    assert asyncio.run(run()) == "sent"
    assert ran == [1] and _ledger(harness, job.job_id) == [("send", "committed")]


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "lost"])
def test_a_begin_whose_commit_was_cut_leaves_no_doubt(harness, landed):
    job, guard, ran, send, run = _send_with_cut(harness, None, landed)
    with pytest.raises(TaskQueueUnavailable):
        asyncio.run(run())
    # fn never ran: its mark, if it landed, says so, and the next attempt runs it.
    assert ran == [] and _ledger(harness, job.job_id) == ([("send", "failed")] if landed else [])
    _crash(harness, guard)
    second = _attempt(harness, job.job_id)
    assert asyncio.run(second.side_effect_async("send", send)) == "sent"
    assert ran == [1] and _ledger(harness, job.job_id) == [("send", "committed")]
