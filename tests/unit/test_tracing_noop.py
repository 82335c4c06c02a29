"""Without an OpenTelemetry SDK a turn's spans cost nothing unless they carry
a remote parent's context onward."""

from __future__ import annotations

import pytest

from agentdispatch import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_no_span_is_made_when_it_would_carry_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    if tracing._otel() is None:
        pytest.skip("opentelemetry-api is not installed")
    monkeypatch.setattr(tracing, "_configured", lambda trace: False)
    assert tracing.start("turn", job_id="j") is None
    assert tracing.start("claim", parent=None) is None
    # A remote parent's context is still carried on, and so is a child's.
    turn = tracing.start("turn", traceparent=PARENT, job_id="j")
    assert turn is not None and format(turn.get_span_context().trace_id, "032x") == PARENT.split("-")[1]
    child = tracing.start("commit", parent=turn)
    assert child is not None and child.get_span_context().trace_id == turn.get_span_context().trace_id
    tracing.end(child)
    tracing.end(turn)
