"""Submission validation: bad input raises and changes nothing."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentdispatch.dispatch import Dispatcher, Submission, validate
from agentdispatch.envelope import MAX_PAYLOAD_BYTES
from agentdispatch.errors import InvalidInput, JobNotFound, PayloadTooLarge, QueueFull
from agentdispatch.factory import open_backends
from agentdispatch.settings import load_settings

KINDS = frozenset({"echo", "sleep"})


def ok(**kw: Any) -> Any:
    return validate(Submission(**{"kind": "echo", **kw}), max_attempts=5, known_kinds=None)


def bad(exc: type[Exception] = InvalidInput, **kw: Any) -> str:
    with pytest.raises(exc) as info:
        ok(**kw)
    return str(info.value)


# -- pure validation -------------------------------------------------------------


def test_defaults_generate_an_id_and_use_it_as_session() -> None:
    job = ok(payload={"q": 1})
    assert re.fullmatch(r"dispatch-[0-9a-f]{32}", job.job_id)
    assert job.session_id == job.job_id
    assert (job.tenant, job.priority, job.dependencies, job.max_attempts) == ("default", 0, (), 5)


def test_payload_at_the_limit_is_accepted_one_byte_more_is_not() -> None:
    # json.dumps of a string adds two quotes
    assert ok(payload="x" * (MAX_PAYLOAD_BYTES - 2)).payload
    msg = bad(PayloadTooLarge, payload="x" * (MAX_PAYLOAD_BYTES - 1))
    assert str(MAX_PAYLOAD_BYTES) in msg
    assert issubclass(PayloadTooLarge, InvalidInput)


def test_payload_size_counts_utf8_bytes() -> None:
    bad(PayloadTooLarge, payload="é" * (MAX_PAYLOAD_BYTES // 2))  # ascii-escaped: 6 bytes per char anyway
    bad(PayloadTooLarge, payload={"blob": ["a" * 1000] * 1100})


@pytest.mark.parametrize("payload", [math.nan, math.inf, {"x": object()}, {1, 2}, b"bytes"])
def test_payload_must_be_json(payload: Any) -> None:
    assert "payload" in bad(payload=payload)


@pytest.mark.parametrize("kind", ["", "has space", "k" * 101, "semi;colon", "slash/kind", None, 5])
def test_bad_kind(kind: Any) -> None:
    assert "kind" in bad(kind=kind)


def test_unknown_kind_with_known_kinds() -> None:
    with pytest.raises(InvalidInput, match=r"unknown kind 'nope'.*echo, sleep"):
        validate(Submission(kind="nope"), max_attempts=5, known_kinds=KINDS)
    assert validate(Submission(kind="sleep"), max_attempts=5, known_kinds=KINDS).kind == "sleep"
    # without a registry to check against any well-formed kind is accepted
    assert ok(kind="goal_loop").kind == "goal_loop"


@pytest.mark.parametrize("tenant", ["", "a b", "t" * 201, "tab\t", None, 3, "ünïcode"])
def test_bad_tenant(tenant: Any) -> None:
    assert "tenant" in bad(tenant=tenant)


@pytest.mark.parametrize("priority", [101, -101, 1.5, "1", True, None])
def test_bad_priority(priority: Any) -> None:
    assert "priority" in bad(priority=priority)


@pytest.mark.parametrize("priority", [-100, 0, 100])
def test_priority_bounds(priority: int) -> None:
    assert ok(priority=priority).priority == priority


@pytest.mark.parametrize("deadline", [0, -1, math.nan, math.inf, "tomorrow", True])
def test_bad_deadline(deadline: Any) -> None:
    assert "deadline_unix" in bad(deadline_unix=deadline)


def test_deadline_is_a_float() -> None:
    job = ok(deadline_unix=1_900_000_000)
    assert job.deadline_unix == 1_900_000_000.0 and isinstance(job.deadline_unix, float)


@pytest.mark.parametrize("deps", [("",), ("has space",), (7,), tuple(f"d{i}" for i in range(101))])
def test_bad_dependencies(deps: tuple[Any, ...]) -> None:
    assert "depend" in bad(dependencies=deps)


@pytest.mark.parametrize("deps", ["dispatch-abc", b"dispatch-abc", 7, None])
def test_dependencies_that_are_not_a_list_are_refused(deps: Any) -> None:
    # A bare id must not be read as one dependency per character.
    assert bad(dependencies=deps) == "dependencies must be a list of job ids"


def _nested(depth: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top


def test_a_payload_nested_too_deeply_is_invalid_input() -> None:
    assert "nests too deeply" in bad(payload=_nested(5000))
    assert ok(payload=_nested(100)).payload


def test_a_job_cannot_depend_on_itself() -> None:
    assert "itself" in bad(job_id="j1", dependencies=("j1",))


@pytest.mark.parametrize(("field", "value"), [("job_id", "bad id"), ("session_id", "x" * 201)])
def test_bad_ids(field: str, value: str) -> None:
    assert field in bad(**{field: value})


def test_agent_name_length() -> None:
    assert "agent_name" in bad(agent_name="a" * 201)


def test_idempotency_key_gives_a_deterministic_job_id_per_tenant() -> None:
    a = ok(idempotency_key="order-42", tenant="acme").job_id
    assert a == ok(idempotency_key="order-42", tenant="acme").job_id
    assert re.fullmatch(r"dispatch-[0-9a-f]{32}", a)
    assert a != ok(idempotency_key="order-43", tenant="acme").job_id
    assert a != ok(idempotency_key="order-42", tenant="other").job_id
    assert "order-42" not in a


def test_explicit_job_id_wins_over_idempotency_key() -> None:
    assert ok(job_id="my-job", idempotency_key="k").job_id == "my-job"


def test_from_mapping() -> None:
    sub = Submission.from_mapping({"action": "dispatch", "task": "summarise", "dependencies": '["a", "b"]'})
    assert (sub.kind, sub.payload, sub.dependencies) == ("orchestrator_task", {"task": "summarise"}, ("a", "b"))
    assert Submission.from_mapping({"kind": "echo"}, tenant="forced").tenant == "forced"
    with pytest.raises(InvalidInput, match="unknown field"):
        Submission.from_mapping({"kind": "echo", "surprise": 1})
    with pytest.raises(InvalidInput, match="JSON object"):
        Submission.from_mapping(["kind"])  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="dependencies"):
        Submission.from_mapping({"dependencies": "[not json"})
    with pytest.raises(InvalidInput, match="dependencies"):
        Submission.from_mapping({"dependencies": 5})


# -- through a real Dispatcher: nothing changes on rejection ---------------------------


@pytest.fixture
def dispatcher(tmp_path: Path) -> Iterator[Dispatcher]:
    settings = load_settings(
        AGENT_DISPATCH_DATA_DIR=str(tmp_path / "data"), TASK_QUEUE_BACKEND="sqlite", AGENT_DISPATCH_MAX_DEPTH=5
    )
    store, transport = open_backends(settings)
    try:
        yield Dispatcher(store, transport, settings, known_kinds=KINDS)
    finally:
        transport.close()
        store.close()


def _count(d: Dispatcher) -> int:
    return sum(d.store.counts(None).values())


@pytest.mark.parametrize(
    ("sub", "exc"),
    [
        (Submission(kind="echo", payload="x" * MAX_PAYLOAD_BYTES), PayloadTooLarge),
        (Submission(kind="unknown_kind"), InvalidInput),
        (Submission(kind="echo", tenant="bad tenant"), InvalidInput),
        (Submission(kind="echo", dependencies=("dispatch-missing",)), InvalidInput),
        (Submission(kind="echo", payload=_nested(5000)), InvalidInput),
    ],
    ids=["oversized", "unknown-kind", "bad-tenant", "missing-dependency", "too-deep"],
)
def test_rejected_batch_changes_nothing(dispatcher: Dispatcher, sub: Submission, exc: type[Exception]) -> None:
    dispatcher.submit(Submission(kind="echo", payload=1))
    before = (_count(dispatcher), dispatcher.transport.depth())
    with pytest.raises(exc):
        dispatcher.submit_many([Submission(kind="echo", payload=2), sub])
    assert (_count(dispatcher), dispatcher.transport.depth()) == before


def test_idempotent_resubmission_returns_the_same_job(dispatcher: Dispatcher) -> None:
    h1 = dispatcher.submit(Submission(kind="echo", payload=1, idempotency_key="k1", tenant="acme"))
    h2 = dispatcher.submit(Submission(kind="echo", payload=1, idempotency_key="k1", tenant="acme"))
    assert h1 == h2
    assert _count(dispatcher) == 1
    assert dispatcher.transport.depth() == 1
    h3 = dispatcher.submit(Submission(kind="echo", payload=1, idempotency_key="k1", tenant="other"))
    assert h3.job_id != h1.job_id


def test_job_id_of_another_tenant_is_not_available(dispatcher: Dispatcher) -> None:
    dispatcher.submit(Submission(kind="echo", job_id="shared-id", tenant="acme"))
    with pytest.raises(InvalidInput, match="not available"):
        dispatcher.submit(Submission(kind="echo", job_id="shared-id", tenant="evil"))
    assert dispatcher.status("shared-id", "acme")["tenant"] == "acme"


def test_wrong_tenant_reads_as_not_found(dispatcher: Dispatcher) -> None:
    h = dispatcher.submit(Submission(kind="echo", tenant="acme"))
    with pytest.raises(JobNotFound, match=f"Job {h.job_id} not found"):
        dispatcher.status(h.job_id, "other")
    with pytest.raises(JobNotFound):
        dispatcher.cancel(h.job_id, "other")
    assert dispatcher.status(h.job_id, "acme")["status"] == "ready"


def test_admission_bound_rejects_the_whole_batch(dispatcher: Dispatcher) -> None:
    dispatcher.submit_many([Submission(kind="echo", payload=i) for i in range(4)])
    with pytest.raises(QueueFull, match="AGENT_DISPATCH_MAX_DEPTH=5"):
        dispatcher.submit_many([Submission(kind="echo", payload=i) for i in range(2)])
    assert _count(dispatcher) == 4
    dispatcher.submit(Submission(kind="echo"))
    assert _count(dispatcher) == 5


def test_empty_batch_is_a_noop(dispatcher: Dispatcher) -> None:
    assert dispatcher.submit_many([]) == []
    assert _count(dispatcher) == 0


@pytest.mark.parametrize("timeout", [0, -1, math.inf, math.nan, True, "30", 7 * 24 * 3600 + 1])
def test_bad_timeout(timeout: Any) -> None:
    assert "timeout_s" in bad(timeout_s=timeout)


def test_timeout_is_kept_as_seconds() -> None:
    assert ok(timeout_s=90).timeout_s == 90.0
    assert ok().timeout_s is None
