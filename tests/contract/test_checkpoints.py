"""Contract: checkpoints on every store/transport (issue 19, item 9).

``guard.checkpoint(state)`` saves a turn's progress durably under the fence;
the next attempt of the turn finds it as ``turn.checkpoint``; a stale attempt
cannot overwrite it; bad state is refused and changes nothing."""

from __future__ import annotations

import pytest

from agentdispatch import InvalidInput, LeaseLost, Status, Submission
from agentdispatch.handlers import Registry, Turn
from agentdispatch.lease import MAX_CHECKPOINT_BYTES, LeaseGuard
from agentdispatch.stores.base import ClaimKind
from agentdispatch.workitem import Lease, Outcome

from .helpers import wait_until


def _claim(h, job_id: str, owner: str, ttl_s: float = 30.0) -> tuple[Lease, object]:
    got = []

    def once() -> bool:
        got.append(h.store.claim(job_id, "t", owner=owner, ttl_s=ttl_s))
        return got[-1].kind is ClaimKind.CLAIMED

    wait_until(once)
    assert got[-1].lease is not None
    return got[-1].lease, got[-1].item


def _lapse(h, lease: Lease) -> None:
    """The attempt holding ``lease`` dies: its lease lapses and the sweep gives the turn back."""
    wait_until(lambda: h.store.sweep(redeliver_after_s=h.transport.redeliver_after_s).reclaimed >= 1)
    assert h.store.get(lease.job_id, "t").lease_epoch == lease.epoch  # nobody claimed it meanwhile


def _guard(h, lease: Lease) -> LeaseGuard:
    return LeaseGuard(h.store, lease, ttl_s=30, renew_interval_s=10)


def test_a_redelivered_turn_resumes_from_its_checkpoint(harness):
    job = harness.dispatcher().submit(Submission(kind="resume", tenant="t"))
    first, item = _claim(harness, job.job_id, "w:1", ttl_s=0.5)
    assert item.checkpoint is None  # a first attempt starts afresh
    plan = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "héllo"}], "step": 2}
    _guard(harness, first).checkpoint({"step": 1})
    _guard(harness, first).checkpoint(plan)  # the last one saved wins
    _lapse(harness, first)

    seen: list[tuple[int, object]] = []
    reg = Registry()

    @reg.register("resume")
    def resume(turn: Turn, guard: LeaseGuard) -> object:
        seen.append((turn.attempt, turn.checkpoint))
        state = dict(turn.checkpoint or {"step": 0})
        state["step"] += 1
        guard.checkpoint(state)
        return state["step"]

    worker = harness.worker(reg, threads=1)
    worker.start()
    try:
        wait_until(lambda: harness.store.get(job.job_id, "t").status.terminal, timeout=60)
    finally:
        worker.stop(grace_s=5)
    done = harness.store.get(job.job_id, "t")
    assert seen == [(2, plan)]
    assert (done.status, done.result) == (Status.SUCCEEDED, 3)
    assert done.checkpoint == {**plan, "step": 3}


def test_a_stale_attempt_cannot_overwrite_the_checkpoint(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    stale, _ = _claim(harness, job.job_id, "w:1", ttl_s=0.5)
    _guard(harness, stale).checkpoint({"by": 1})
    _lapse(harness, stale)
    live, item = _claim(harness, job.job_id, "w:2")
    assert item.checkpoint == {"by": 1}
    _guard(harness, live).checkpoint({"by": 2})
    zombie = _guard(harness, stale)
    with pytest.raises(LeaseLost):
        zombie.checkpoint({"by": "zombie"})
    assert zombie.lost
    assert harness.store.get(job.job_id, "t").checkpoint == {"by": 2}
    # Past its commit the live attempt is fenced too.
    harness.store.commit(live, Outcome(ok=True, result="ok"))
    with pytest.raises(LeaseLost):
        harness.store.checkpoint(live, '{"by": "late"}')
    assert harness.store.get(job.job_id, "t").checkpoint == {"by": 2}


def test_a_cancelled_turn_cannot_checkpoint(harness):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    lease, _ = _claim(harness, job.job_id, "w:1")
    harness.store.cancel(job.job_id, "t")
    with pytest.raises(LeaseLost):
        _guard(harness, lease).checkpoint({"step": 1})
    assert harness.store.get(job.job_id, "t").checkpoint is None


@pytest.mark.parametrize(
    "state",
    [{"s": {1, 2}}, {"x": float("nan")}, object(), "x" * (MAX_CHECKPOINT_BYTES + 1)],
    ids=["set", "nan", "object", "too-large"],
)
def test_a_bad_checkpoint_is_refused_and_changes_nothing(harness, state):
    job = harness.dispatcher().submit(Submission(kind="echo", tenant="t"))
    lease, _ = _claim(harness, job.job_id, "w:1")
    guard = _guard(harness, lease)
    guard.checkpoint({"good": True})
    with pytest.raises(InvalidInput, match="checkpoint state"):
        guard.checkpoint(state)
    assert not guard.lost
    assert harness.store.get(job.job_id, "t").checkpoint == {"good": True}
    # The largest allowed state is saved whole.
    big = "y" * (MAX_CHECKPOINT_BYTES - 2)
    guard.checkpoint(big)
    assert harness.store.get(job.job_id, "t").checkpoint == big
