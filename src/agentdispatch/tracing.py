"""OpenTelemetry spans for a turn (the ``otel`` extra), and nothing without it.

One trace follows a turn: ``agentdispatch.submit`` (in the submitting
process) is the parent of ``agentdispatch.turn`` in the worker, whose children
are ``claim``, ``handler``, one ``side_effect`` per ledger key and ``commit``.
The link across processes is the W3C ``traceparent`` carried in the envelope.

Without ``opentelemetry-api`` installed every function here returns at once;
with the API but no SDK configured, OpenTelemetry's own no-op spans are used.
The application configures the SDK (a TracerProvider and an exporter) itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

NAME = "agentdispatch"


@functools.cache
def _otel() -> ModuleType | None:
    """The ``opentelemetry.trace`` module, or None when the extra is absent."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


def _configured(trace: ModuleType) -> bool:
    """Whether an SDK provider is set: without one a span records nothing, and
    the hot path (a span per claim, effect and commit) should not pay for it."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def enabled() -> bool:
    """Whether OpenTelemetry is importable (spans may still be no-ops)."""
    return _otel() is not None


def _attrs(values: Mapping[str, Any]) -> dict[str, Any]:
    return {f"agentdispatch.{k}": v for k, v in values.items() if v is not None}


@contextlib.contextmanager
def span(name: str, *, parent: Any = None, **attributes: Any) -> Iterator[Any]:
    """A span made current for the block (``parent``: a span to hang it
    under instead of the current one). Yields the span, or None (also when
    no SDK is configured; the turn's own span from :func:`start` still
    carries a remote parent's context onward)."""
    trace = _otel()
    if trace is None or not _configured(trace):
        yield None
        return
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    tracer = trace.get_tracer(NAME)
    with tracer.start_as_current_span(f"{NAME}.{name}", context=ctx, attributes=_attrs(attributes)) as s:
        yield s


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, for an envelope; None
    when there is no recording span (or no OpenTelemetry)."""
    trace = _otel()
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return None
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")


def start(name: str, *, traceparent: str | None = None, parent: Any = None, **attributes: Any) -> Any:
    """Start a span that is not made current (its end is another call's):
    under ``parent``, else under the remote ``traceparent``. None without
    OpenTelemetry, and without an SDK when there is neither to carry on."""
    trace = _otel()
    if trace is None:
        return None
    if parent is None and not traceparent and not _configured(trace):
        # It would be a no-op span with no context to carry: the hot path
        # (a few spans per turn) should not pay for it.
        return None
    if parent is not None:
        ctx = trace.set_span_in_context(parent)
    elif traceparent:
        from opentelemetry.propagate import extract

        ctx = extract({"traceparent": traceparent})
    else:
        ctx = None
    return trace.get_tracer(NAME).start_span(f"{NAME}.{name}", context=ctx, attributes=_attrs(attributes))


def end(s: Any, *, error: BaseException | None = None, **attributes: Any) -> None:
    """End a span from :func:`start` (None is fine), setting final attributes."""
    if s is None:
        return
    if attributes:
        s.set_attributes(_attrs(attributes))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        s.record_exception(error)
        s.set_status(Status(StatusCode.ERROR, type(error).__name__))
    s.end()
