"""One trace per turn: submit (Python or gateway) -> turn -> claim, handler,
side effect, commit, across the envelope; collected with the SDK's
InMemorySpanExporter from a real worker on a real SQLite store."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentdispatch import Registry, Submission
from agentdispatch.envelope import Envelope
from agentdispatch.gateway import Services, create_app
from agentdispatch.runtime import AsyncWorker, RuntimeOptions
from backends import sqlite_harness

EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def provider() -> None:
    # The global provider can be set once per process: keep this module's.
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(tp)


@pytest.fixture()
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER


def _run_one(harness, job_id: str) -> None:
    reg = Registry()
    done = threading.Event()

    @reg.register("agent")
    def agent(turn, guard):
        guard.side_effect(f"send:{turn.job_id}", lambda: "sent")
        done.set()
        return {"ok": True}

    opts = RuntimeOptions(get_wait_s=0.05, heartbeat_s=1.0, grace_s=5.0)
    worker = AsyncWorker(harness.settings, harness.store, harness.transport, reg, options=opts)
    thread = threading.Thread(target=worker.run_forever, daemon=True)
    thread.start()
    try:
        assert harness.dispatcher().wait(job_id, "default", 30)["status"] == "succeeded"
    finally:
        worker.request_stop()
        thread.join(timeout=60)
    assert done.is_set()


def _check_one_trace(spans: InMemorySpanExporter, job_id: str) -> None:
    got = {s.name: s for s in spans.get_finished_spans()}
    names = {"submit", "turn", "claim", "handler", "side_effect", "commit"}
    assert {f"agentdispatch.{n}" for n in names} <= set(got)
    by = {n: got[f"agentdispatch.{n}"] for n in names}
    assert len({s.context.trace_id for s in by.values()}) == 1
    assert by["turn"].parent.span_id == by["submit"].context.span_id
    for child in ("claim", "handler", "side_effect", "commit"):
        assert by[child].parent.span_id == by["turn"].context.span_id, child
    assert by["turn"].attributes["agentdispatch.job_id"] == job_id
    assert by["turn"].attributes["agentdispatch.outcome"] == "completed"
    assert by["side_effect"].attributes["agentdispatch.key"] == f"send:{job_id}"


def test_a_python_submission_is_one_trace_through_the_worker(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    harness = sqlite_harness(tmp_path)
    try:
        job_id = harness.dispatcher().submit(Submission(kind="agent", payload={})).job_id
        _run_one(harness, job_id)
        _check_one_trace(spans, job_id)
    finally:
        harness.close()


def test_a_gateway_submission_is_one_trace_through_the_worker(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    harness = sqlite_harness(tmp_path)
    try:
        services = Services.of(harness.settings, harness.store, harness.transport, auth=False)
        with TestClient(create_app(services)) as c:
            job_id = c.post("/v1/jobs", json={"kind": "agent"}).json()["job_id"]
        _run_one(harness, job_id)
        _check_one_trace(spans, job_id)
    finally:
        harness.close()


def test_an_untraced_envelope_is_byte_for_byte_the_old_one() -> None:
    env = Envelope(job_id="j", session_id="s", kind="k", payload_ref="p", tenant="t", enqueued_at=1.0)
    assert "traceparent" not in env.to_json()
    assert Envelope.from_json(env.to_json()) == env
