"""The request path through the intake seam and the Dispatcher, on each
database and with a Kafka queue: the receipt and its WorkItem commit
together or not at all, a duplicate creates nothing, and on Kafka the turn
is on the topic when the delivery is answered (not left to a relay)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentdispatch.dispatch import Submission
from agentdispatch.errors import QueueFull
from agentdispatch.intake.admit import Incoming, admit, job_id_of
from agentdispatch.intake.answers import Answer, ok
from agentdispatch.intake.base import Abandoned, IntakeStore
from agentdispatch.intake.envelope import IntakeEnvelope
from backends import BUILDERS, Harness, kafka_harness
from intake.kit import install_telegram_bot


@pytest.fixture(params=["sqlite", "postgres"])
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    harness = BUILDERS[str(request.param)](tmp_path, max_depth=3)
    try:
        yield harness
    finally:
        harness.close()


def _installed(h: Harness, tmp_path: Path) -> tuple[IntakeStore, dict[str, Any]]:
    return install_telegram_bot(h.store, tmp_path)


def _update(inst: dict[str, Any], n: int, body: bytes | None = None, answer: Answer | None = None) -> Incoming:
    env = IntakeEnvelope(connector="telegram", installation=inst["id"], source_id=f"7:{n}", conversation="42",
                         sender="9", text=f"m{n}", channel="42", message_key=f"42:{n}", is_dm=True)  # fmt: skip
    raw = body if body is not None else env.to_json().encode()
    return Incoming("telegram", env.source_id, raw, answer or ok(), inst, envelope=env)


def test_receipt_and_item_commit_together(h: Harness, tmp_path: Path) -> None:
    ist, inst = _installed(h, tmp_path)
    d = h.dispatcher()
    assert admit(ist, d, _update(inst, 1), abandoned=threading.Event()).status == 200
    job = job_id_of("telegram", "7:1")
    item = h.store.get(job, None)
    assert (item.kind, item.agent_name, item.tenant) == ("intake_turn", "helper", "acme")
    receipt = ist.receipt(job)
    assert receipt is not None and receipt["job_id"] == job and receipt["agent"] == "helper"

    # A copy with other bytes answers like the original and creates nothing.
    copy = _update(inst, 1, body=b"other bytes", answer=Answer(500))
    assert admit(ist, d, copy, abandoned=threading.Event()).status == 200
    assert len(h.store.list_jobs(tenant=None, status=None, limit=10, offset=0)) == 1
    receipt = ist.receipt(job)
    assert receipt is not None and receipt["mismatches"] == 1


def test_a_refused_item_leaves_no_receipt(h: Harness, tmp_path: Path) -> None:
    ist, inst = _installed(h, tmp_path)
    d = h.dispatcher()
    d.submit_many([Submission("noop", session_id=f"fill{i}") for i in range(3)])  # max_depth=3: full
    with pytest.raises(QueueFull):
        admit(ist, d, _update(inst, 2), abandoned=threading.Event())
    assert ist.receipt_by_source("telegram", "7:2") is None
    assert len(h.store.list_jobs(tenant=None, status=None, limit=10, offset=0)) == 3


def test_an_abandoned_request_writes_nothing(h: Harness, tmp_path: Path) -> None:
    ist, inst = _installed(h, tmp_path)
    gone = threading.Event()
    gone.set()
    with pytest.raises(Abandoned):
        admit(ist, h.dispatcher(), _update(inst, 3), abandoned=gone)
    assert ist.receipt_by_source("telegram", "7:3") is None
    assert h.store.list_jobs(tenant=None, status=None, limit=10, offset=0) == []


@pytest.mark.parametrize("pg", [False, True], ids=["sqlite-store", "postgres-store"])
def test_on_kafka_the_turn_is_published_before_the_answer(tmp_path: Path, pg: bool) -> None:
    h = kafka_harness(tmp_path, pg=pg)
    try:
        ist, inst = _installed(h, tmp_path)
        assert admit(ist, h.dispatcher(), _update(inst, 4), abandoned=threading.Event()).status == 200
        assert h.store.outbox_take(10) == []  # published by the submission, not left to a relay
        got = h.transport.get("reader", visibility_s=30.0, wait_s=20.0)
        assert got is not None and job_id_of("telegram", "7:4") in got.raw
    finally:
        h.close()


def test_on_kafka_a_delivery_is_recorded_while_the_broker_is_down(tmp_path: Path) -> None:
    # The provider retries a 503 only a few times: with the store up, intake
    # records the delivery and leaves its publish to the reconciler.
    h = kafka_harness(tmp_path)
    try:
        ist, inst = _installed(h, tmp_path)
        h.cleanup[0]()  # the broker, killed
        assert admit(ist, h.dispatcher(), _update(inst, 5), abandoned=threading.Event()).status == 200
        job = job_id_of("telegram", "7:5")
        assert h.store.get(job, None).kind == "intake_turn"
        assert [r.envelope.job_id for r in h.store.outbox_take(10)] == [job]
    finally:
        h.close()
