"""The envelope (references only, frozen, JSON round-trip) and the job handle."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from agentdispatch.envelope import MAX_PAYLOAD_BYTES, Envelope, JobHandle, new_job_id
from agentdispatch.errors import InvalidEnvelope, InvalidInput

FIELDS = {
    "job_id",
    "session_id",
    "kind",
    "payload_ref",
    "agent_name",
    "tenant",
    "priority",
    "deadline_unix",
    "attempt",
    "enqueued_at",
}


def env(**kw: object) -> Envelope:
    base: dict[str, object] = {
        "job_id": "dispatch-" + "0" * 32,
        "session_id": "sess-1",
        "kind": "echo",
        "payload_ref": "dispatch-" + "0" * 32,
        "agent_name": "bot",
        "tenant": "acme",
        "priority": 3,
        "deadline_unix": 1_900_000_000.5,
        "attempt": 2,
        "enqueued_at": 1_800_000_000.25,
    }
    base.update(kw)
    return Envelope(**base)  # type: ignore[arg-type]


def test_envelope_carries_exactly_the_spec_fields() -> None:
    # Plus the optional W3C trace context, on the wire only when traced.
    assert set(Envelope.model_fields) == FIELDS | {"traceparent"}
    assert set(json.loads(env().to_json())) == FIELDS
    traced = env().model_copy(update={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert set(json.loads(traced.to_json())) == FIELDS | {"traceparent"}
    assert Envelope.from_json(traced.to_json()) == traced


@pytest.mark.parametrize("deadline", [1_900_000_000.5, None])
def test_json_round_trip(deadline: float | None) -> None:
    original = env(deadline_unix=deadline)
    raw = original.to_json()
    assert Envelope.from_json(raw) == original
    assert Envelope.from_json(raw.encode()) == original
    assert Envelope.from_json(raw).to_json() == raw


def test_envelope_is_frozen() -> None:
    e = env()
    with pytest.raises(ValidationError):
        e.kind = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("", id="empty"),
        pytest.param("{", id="truncated"),
        pytest.param("not json", id="garbage"),
        pytest.param("[]", id="array"),
        pytest.param("null", id="null"),
        pytest.param('{"job_id": "x"}', id="missing-fields"),
        pytest.param(b"\xff\xfe", id="bad-utf8"),
    ],
)
def test_malformed_json_is_an_invalid_envelope(raw: str | bytes) -> None:
    with pytest.raises(InvalidEnvelope, match="invalid envelope"):
        Envelope.from_json(raw)


def _mutate(**changes: object) -> str:
    data = json.loads(env().to_json())
    for k, v in changes.items():
        if v is ...:
            data.pop(k)
        else:
            data[k] = v
    return json.dumps(data)


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (_mutate(job_id=""), "job_id"),
        (_mutate(tenant=...), "tenant"),
        (_mutate(kind="k" * 101), "kind"),
        (_mutate(attempt=-1), "attempt"),
        (_mutate(priority="high"), "priority"),
        (_mutate(enqueued_at="yesterday"), "enqueued_at"),
        (_mutate(body="the payload must not travel"), "body"),
    ],
)
def test_invalid_fields_are_named(raw: str, where: str) -> None:
    with pytest.raises(InvalidEnvelope, match=where) as info:
        Envelope.from_json(raw)
    assert isinstance(info.value, InvalidInput)
    assert info.value.__cause__ is None  # no pydantic chain leaks to callers


def test_new_job_id_shape() -> None:
    ids = {new_job_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"dispatch-[0-9a-f]{32}", i) for i in ids)


def test_job_handle_shape_is_exactly_spec_section_8() -> None:
    h = JobHandle.for_job("dispatch-" + "1" * 32, "sess-9", "goal_loop")
    assert h.model_dump() == {
        "job_id": "dispatch-" + "1" * 32,
        "session_id": "sess-9",
        "kind": "goal_loop",
        "dispatch": "queued",
        "status": "pending",
        "status_url": "/api/graph/jobs",
        "status_request": {"action": "status", "job_id": "dispatch-" + "1" * 32},
    }
    assert JobHandle.model_validate_json(h.model_dump_json()) == h


def test_payload_limit_is_one_mebibyte() -> None:
    assert MAX_PAYLOAD_BYTES == 1024 * 1024
