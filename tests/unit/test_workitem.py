"""The pure WorkItem state machine, driven by a fake clock (``now`` values)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentdispatch import workitem as wi
from agentdispatch.errors import InvalidTransition, LeaseLost, OutcomeConflict
from agentdispatch.workitem import ACTIVE, HELD, TERMINAL, Lease, Outcome, Status, WorkItem

T0 = 1_000_000.0
TTL = 60.0


def make(*, deps: tuple[str, ...] = (), max_attempts: int = 3, deadline: float | None = None) -> WorkItem:
    return wi.new_item(
        job_id="dispatch-" + "a" * 32,
        tenant="acme",
        session_id="s1",
        kind="echo",
        payload={"n": 1},
        now=T0,
        max_attempts=max_attempts,
        dependencies=deps,
        deadline_unix=deadline,
    )


def claimed(item: WorkItem | None = None, *, now: float = T0, token: str = "tok-1") -> tuple[WorkItem, Lease]:
    item = item or make()
    item = wi.claim(item, owner="w1:0", token=token, now=now, ttl_s=TTL)
    return item, wi.lease_of(item)


def running(item: WorkItem | None = None, *, now: float = T0, token: str = "tok-1") -> tuple[WorkItem, Lease]:
    item, lease = claimed(item, now=now, token=token)
    return wi.start(item, lease, now + 1), lease


def in_status(status: Status) -> WorkItem:
    """An item that reached ``status`` through legal transitions."""
    if status is Status.SUBMITTED:
        return make(deps=("dispatch-" + "b" * 32,))
    if status is Status.READY:
        return make()
    if status is Status.LEASED:
        return claimed()[0]
    if status is Status.RUNNING:
        return running()[0]
    item, lease = running()
    if status is Status.SUCCEEDED:
        return wi.commit(item, lease, Outcome(ok=True, result=1), T0 + 2, 0)
    if status is Status.FAILED:
        return wi.commit(item, lease, Outcome(ok=False, error="x", retryable=False), T0 + 2, 0)
    if status is Status.CANCELLED:
        return wi.cancel(item, T0 + 2)
    return wi.commit(item, lease, Outcome(ok=False, error="x", dead_letter_reason="manual"), T0 + 2, 0)


# -- status sets ------------------------------------------------------------


def test_status_sets_partition_the_lifecycle() -> None:
    assert set(Status) == ACTIVE | TERMINAL
    assert not ACTIVE & TERMINAL
    assert {Status.LEASED, Status.RUNNING} == HELD
    assert [s for s in Status if s.terminal] == [Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.DEAD_LETTER]


@pytest.mark.parametrize("status", list(Status))
def test_in_status_helper_reaches_every_status(status: Status) -> None:
    assert in_status(status).status is status


# -- creation, release, dependencies ------------------------------------------


def test_new_item_is_ready_without_dependencies() -> None:
    item = make()
    assert item.status is Status.READY
    assert (item.attempt, item.lease_epoch, item.created_at, item.ready_at) == (0, 0, T0, T0)
    assert item.payload_ref == item.id
    assert item.result_ref is None


def test_new_item_with_dependencies_is_submitted_then_released() -> None:
    item = make(deps=("dispatch-" + "b" * 32,))
    assert item.status is Status.SUBMITTED
    released = wi.release(item, T0 + 5)
    assert released.status is Status.READY
    assert released.ready_at == T0 + 5
    assert item.status is Status.SUBMITTED  # pure: the input is not mutated


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.SUBMITTED])
def test_release_only_from_submitted(status: Status) -> None:
    with pytest.raises(InvalidTransition):
        wi.release(in_status(status), T0 + 10)


@pytest.mark.parametrize(
    ("deps", "decision"),
    [
        ([], "release"),
        ([Status.SUCCEEDED], "release"),
        ([Status.SUCCEEDED, Status.SUCCEEDED], "release"),
        ([Status.SUCCEEDED, Status.READY], "wait"),
        ([Status.SUBMITTED], "wait"),
        ([Status.RUNNING, Status.LEASED], "wait"),
        ([Status.SUCCEEDED, Status.FAILED], "cancel"),
        ([Status.CANCELLED], "cancel"),
        ([Status.DEAD_LETTER, Status.READY], "cancel"),
        ([Status.SUCCEEDED, None], "cancel"),
    ],
)
def test_dependency_decision(deps: list[Status | None], decision: str) -> None:
    assert wi.dependency_decision(deps) == decision


# -- claim and start ----------------------------------------------------------


def test_claim_bumps_epoch_and_attempt_and_mints_lease() -> None:
    item, lease = claimed()
    assert item.status is Status.LEASED
    assert (item.attempt, item.lease_epoch) == (1, 1)
    assert lease == Lease(item.id, "acme", "w1:0", 1, "tok-1", T0 + TTL)
    assert wi.lease_is_live(item, T0 + TTL - 0.001)
    assert not wi.lease_is_live(item, T0 + TTL)


def test_claim_before_ready_at_is_refused() -> None:
    item = replace(make(), ready_at=T0 + 10)
    with pytest.raises(InvalidTransition, match="not ready"):
        wi.claim(item, owner="w", token="t", now=T0 + 9.9, ttl_s=TTL)
    assert wi.claim(item, owner="w", token="t", now=T0 + 10, ttl_s=TTL).status is Status.LEASED


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.READY])
def test_claim_only_from_ready(status: Status) -> None:
    with pytest.raises(InvalidTransition):
        wi.claim(in_status(status), owner="w2", token="t2", now=T0 + 100, ttl_s=TTL)


def test_start_moves_leased_to_running_and_is_idempotent() -> None:
    item, lease = claimed()
    run = wi.start(item, lease, T0 + 1)
    assert run.status is Status.RUNNING
    assert wi.start(run, lease, T0 + 2) is run


@pytest.mark.parametrize("status", [Status.SUBMITTED, Status.READY, *sorted(TERMINAL)])
def test_lease_of_requires_a_held_item(status: Status) -> None:
    with pytest.raises(InvalidTransition):
        wi.lease_of(in_status(status))


# -- fencing ------------------------------------------------------------------


def test_check_fence_accepts_the_live_lease() -> None:
    item, lease = running()
    wi.check_fence(item, lease, T0 + TTL - 1)  # no exception


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param({"epoch": 0}, id="stale-epoch"),
        pytest.param({"epoch": 2}, id="future-epoch"),
        pytest.param({"token": "forged"}, id="wrong-token"),
        pytest.param({"owner": "other"}, id="wrong-owner"),
        pytest.param({"tenant": "evil"}, id="wrong-tenant"),
    ],
)
def test_check_fence_rejects_a_foreign_lease(tamper: dict[str, object]) -> None:
    item, lease = running()
    with pytest.raises(LeaseLost):
        wi.check_fence(item, replace(lease, **tamper), T0 + 1)  # type: ignore[arg-type]


def test_check_fence_rejects_an_expired_lease_by_the_given_clock() -> None:
    item, lease = running()
    with pytest.raises(LeaseLost, match="expired"):
        wi.check_fence(item, lease, T0 + TTL)
    # the lease object's own expiry is not trusted: only the item's
    with pytest.raises(LeaseLost):
        wi.check_fence(item, replace(lease, expires_at=T0 + 10 * TTL), T0 + TTL + 1)


def test_check_fence_rejects_after_cancel() -> None:
    item, lease = running()
    with pytest.raises(LeaseLost, match="cancelled"):
        wi.check_fence(wi.cancel(item, T0 + 2), lease, T0 + 3)


def test_reclaim_after_expiry_fences_the_old_holder() -> None:
    item, old = running()
    item = wi.expire_lease(item, T0 + TTL + 1)
    item, new = claimed(item, now=T0 + TTL + 2, token="tok-2")
    assert (new.epoch, item.attempt) == (2, 2)
    for fn in (
        lambda: wi.check_fence(item, old, T0 + TTL + 3),
        lambda: wi.renew(item, old, T0 + TTL + 3, TTL),
        lambda: wi.start(item, old, T0 + TTL + 3),
        lambda: wi.commit(item, old, Outcome(ok=True), T0 + TTL + 3, 0),
    ):
        with pytest.raises(LeaseLost):
            fn()
    wi.check_fence(item, new, T0 + TTL + 3)


def test_renew_extends_from_now() -> None:
    item, lease = running()
    renewed = wi.renew(item, lease, T0 + 50, TTL)
    assert renewed.lease_expires_at == T0 + 50 + TTL
    assert wi.lease_of(renewed).token == lease.token
    with pytest.raises(LeaseLost):
        wi.renew(item, lease, T0 + TTL, TTL)  # too late: expired at exactly now


# -- commit ---------------------------------------------------------------------


def test_commit_success() -> None:
    item, lease = running()
    done = wi.commit(item, lease, Outcome(ok=True, result={"a": 1}), T0 + 5, 0)
    assert done.status is Status.SUCCEEDED
    assert (done.result, done.error, done.completed_at, done.lease_expires_at) == ({"a": 1}, None, T0 + 5, None)
    assert done.result_ref == f"outcome:{done.id}:1"


def test_commit_same_outcome_by_same_lease_is_a_noop() -> None:
    item, lease = running()
    done = wi.commit(item, lease, Outcome(ok=True, result={"b": 2, "a": 1}), T0 + 5, 0)
    again = wi.commit(done, lease, Outcome(ok=True, result={"a": 1, "b": 2}), T0 + 500, 0)
    assert again is done


def test_commit_same_failure_by_same_lease_is_a_noop() -> None:
    item, lease = running()
    failed = wi.commit(item, lease, Outcome(ok=False, error="boom", retryable=False), T0 + 5, 0)
    assert wi.commit(failed, lease, Outcome(ok=False, error="boom", retryable=False), T0 + 6, 0) is failed


@pytest.mark.parametrize(
    "second",
    [Outcome(ok=True, result={"a": 2}), Outcome(ok=False, error="boom")],
    ids=["different-result", "failure-after-success"],
)
def test_commit_different_outcome_is_a_conflict(second: Outcome) -> None:
    item, lease = running()
    done = wi.commit(item, lease, Outcome(ok=True, result={"a": 1}), T0 + 5, 0)
    with pytest.raises(OutcomeConflict):
        wi.commit(done, lease, second, T0 + 6, 0)
    assert issubclass(OutcomeConflict, InvalidTransition)


def test_commit_on_terminal_item_by_another_lease_is_fenced() -> None:
    item, lease = running()
    done = wi.commit(item, lease, Outcome(ok=True, result=1), T0 + 5, 0)
    with pytest.raises(LeaseLost):
        wi.commit(done, replace(lease, epoch=7, token="x"), Outcome(ok=True, result=1), T0 + 6, 0)


def test_commit_after_cancel_is_fenced_even_by_the_same_lease() -> None:
    item, lease = running()
    cancelled = wi.cancel(item, T0 + 3)
    with pytest.raises(LeaseLost):
        wi.commit(cancelled, lease, Outcome(ok=True, result=1), T0 + 4, 0)


def test_commit_with_expired_lease_is_fenced() -> None:
    item, lease = running()
    with pytest.raises(LeaseLost):
        wi.commit(item, lease, Outcome(ok=True), T0 + TTL + 1, 0)


def test_retryable_failure_returns_to_ready_after_backoff() -> None:
    item, lease = running()
    back = wi.commit(item, lease, Outcome(ok=False, error="flaky"), T0 + 5, 7.5)
    assert back.status is Status.READY
    assert (back.reason, back.error, back.ready_at, back.completed_at) == ("retry", "flaky", T0 + 12.5, None)
    with pytest.raises(InvalidTransition):
        wi.claim(back, owner="w", token="t2", now=T0 + 12.4, ttl_s=TTL)
    again, lease2 = claimed(back, now=T0 + 12.5, token="t2")
    assert (again.attempt, lease2.epoch) == (2, 2)


def test_retries_exhaust_into_dead_letter() -> None:
    item = make(max_attempts=3)
    now = T0
    for attempt in (1, 2, 3):
        item, lease = running(item, now=now, token=f"t{attempt}")
        assert item.attempt == attempt
        item = wi.commit(item, lease, Outcome(ok=False, error=f"e{attempt}"), now + 2, 1.0)
        now += 10
    assert item.status is Status.DEAD_LETTER
    assert (item.reason, item.error, item.attempt) == ("max_attempts", "e3", 3)
    assert item.completed_at is not None


def test_non_retryable_failure_is_failed_at_once() -> None:
    item, lease = running(make(max_attempts=5))
    done = wi.commit(item, lease, Outcome(ok=False, error="bad input", retryable=False), T0 + 2, 1.0)
    assert done.status is Status.FAILED
    assert (done.reason, done.attempt) == ("non_retryable", 1)


def test_a_failure_keeps_its_precise_reason_and_a_retirement_cancels() -> None:
    item, lease = running(make(max_attempts=5))
    done = wi.commit(item, lease, Outcome(ok=False, error="x", retryable=False, reason="agent_disabled"), T0 + 2, 1)
    assert (done.status, done.reason) == (Status.FAILED, "agent_disabled")
    item, lease = running(make(max_attempts=5))
    stale = Outcome(ok=False, error="too old", retryable=False, reason="stale", retired=True)
    done = wi.commit(item, lease, stale, T0 + 2, 1)
    assert (done.status, done.reason, done.error) == (Status.CANCELLED, "stale", "too old")
    assert wi.commit(done, lease, stale, T0 + 3, 1) is done  # the same commit again changes nothing
    other, other_lease = running(make())
    with pytest.raises(LeaseLost):  # an operator's cancel still fences the worker out
        wi.commit(wi.cancel(other, T0 + 2), other_lease, stale, T0 + 3, 1)


def test_dead_letter_reason_short_circuits() -> None:
    item, lease = running(make(max_attempts=5))
    done = wi.commit(item, lease, Outcome(ok=False, error="?", dead_letter_reason="effect_unknown"), T0 + 2, 0)
    assert (done.status, done.reason) == (Status.DEAD_LETTER, "effect_unknown")


# -- lease expiry -------------------------------------------------------------------


def test_expire_lease_returns_to_ready() -> None:
    item, _ = running()
    back = wi.expire_lease(item, T0 + TTL)
    assert (back.status, back.reason, back.lease_expires_at) == (Status.READY, "lease_expired", None)
    assert back.lease_epoch == 1  # the next claim bumps it


def test_expire_lease_of_a_live_lease_is_refused() -> None:
    item, _ = claimed()
    with pytest.raises(InvalidTransition, match="live"):
        wi.expire_lease(item, T0 + TTL - 1)


def test_expire_lease_dead_letters_when_attempts_are_exhausted() -> None:
    item = make(max_attempts=1)
    item, _ = running(item)
    done = wi.expire_lease(item, T0 + TTL + 1)
    assert (done.status, done.reason, done.completed_at) == (Status.DEAD_LETTER, "lease_exhausted", T0 + TTL + 1)


@pytest.mark.parametrize("status", [Status.SUBMITTED, Status.READY, *sorted(TERMINAL)])
def test_expire_lease_only_from_held(status: Status) -> None:
    with pytest.raises(InvalidTransition):
        wi.expire_lease(in_status(status), T0 + 10 * TTL)


# -- cancel, deadlines ------------------------------------------------------------


@pytest.mark.parametrize("status", sorted(ACTIVE))
def test_cancel_from_every_non_terminal_state(status: Status) -> None:
    item = in_status(status)
    done = wi.cancel(item, T0 + 3, "operator")
    assert (done.status, done.reason, done.completed_at, done.lease_expires_at) == (
        Status.CANCELLED,
        "operator",
        T0 + 3,
        None,
    )


@pytest.mark.parametrize("status", sorted(TERMINAL))
def test_terminal_states_never_change(status: Status) -> None:
    item = in_status(status)
    for fn in (
        lambda: wi.cancel(item, T0 + 9),
        lambda: wi.release(item, T0 + 9),
        lambda: wi.claim(item, owner="w", token="t", now=T0 + 9, ttl_s=TTL),
        lambda: wi.expire_lease(item, T0 + 10 * TTL),
    ):
        with pytest.raises(InvalidTransition):
            fn()


def test_deadline_expiry() -> None:
    item = make(deadline=T0 + 30)
    assert not wi.is_expired(item, T0 + 29.9)
    assert wi.is_expired(item, T0 + 30)
    assert not wi.is_expired(make(), T0 + 10**9)
    done = wi.cancel(item, T0 + 30, "expired")
    assert (done.status, done.reason) == (Status.CANCELLED, "expired")


# -- replay -------------------------------------------------------------------------


def test_replay_from_dead_letter_is_a_new_attempt() -> None:
    item = make(max_attempts=1)
    item, lease = running(item)
    dead = wi.commit(item, lease, Outcome(ok=False, error="e"), T0 + 2, 0)
    assert dead.status is Status.DEAD_LETTER
    again = wi.replay(dead, T0 + 100, extra_attempts=2)
    assert (again.status, again.reason, again.ready_at, again.completed_at) == (
        Status.READY,
        "replayed",
        T0 + 100,
        None,
    )
    assert again.max_attempts == 3  # attempt 1 + 2 more
    item2, lease2 = claimed(again, now=T0 + 101, token="t2")
    assert (item2.attempt, lease2.epoch) == (2, 2)


def test_replay_grants_at_least_one_attempt() -> None:
    dead = in_status(Status.DEAD_LETTER)
    assert wi.replay(dead, T0 + 5, extra_attempts=0).max_attempts == dead.attempt + 1


@pytest.mark.parametrize("status", [s for s in Status if s is not Status.DEAD_LETTER])
def test_replay_only_from_dead_letter(status: Status) -> None:
    with pytest.raises(InvalidTransition):
        wi.replay(in_status(status), T0 + 5, extra_attempts=1)


# -- the caller view ----------------------------------------------------------------


def test_view_hides_lease_secrets() -> None:
    item, lease = running()
    view = item.view()
    text = repr(view)
    assert lease.token not in text
    assert lease.owner not in text
    assert not any(k.startswith("lease") for k in view)
    assert view["status"] == "running"
    assert view["payload_ref"] == item.id


def test_commit_same_retry_outcome_by_same_lease_is_a_noop() -> None:
    item, lease = running()
    back = wi.commit(item, lease, Outcome(ok=False, error="flaky"), T0 + 5, 1.0)
    assert back.status is Status.READY
    assert wi.commit(back, lease, Outcome(ok=False, error="flaky"), T0 + 5.5, 1.0) is back


def test_evolve_matches_dataclasses_replace_and_rejects_unknown_fields():
    item = wi.new_item(job_id="j", tenant="t", session_id="s", kind="k", payload={"a": 1}, now=1.0, max_attempts=3)
    changes = {"status": Status.RUNNING, "lease_epoch": 4, "seq": 9, "reason": "x"}
    evolved = wi.evolve(item, **changes)
    assert evolved == replace(item, **changes) and evolved is not item
    assert item.status is Status.READY and item.seq == 0  # the original is untouched
    with pytest.raises(TypeError, match="no field"):
        wi.evolve(item, stauts=Status.RUNNING)


# -- suspects: a poison turn is isolated before its last attempt ----------------


def test_a_suspect_is_capped_only_near_its_last_attempts() -> None:
    assert wi.suspect_cap(1, 5, "lease_expired") is None  # one lost lease: most crashes
    assert wi.suspect_cap(4, 5, "retry") is None  # failed normally: its own error
    assert [wi.suspect_cap(n, 5, "lease_expired") for n in (2, 3, 4)] == [16, 4, 1]
    assert wi.suspect_cap(2, 10, "lease_expired") is None  # attempts to spare


def test_a_group_of_suspects_stays_within_every_members_cap() -> None:
    assert wi.may_join(1, [])
    assert not wi.may_join(1, [16])  # the last attempt runs alone
    assert not wi.may_join(16, [1])  # and nobody joins it
    assert wi.may_join(4, [4, 4, 16])
    assert wi.may_join(4, [4, 4, 4])  # the cap counts the newcomer too
    assert not wi.may_join(4, [4, 4, 4, 4])
