"""What a worker reports about each turn beside running it: the per-kind
metrics, the turn's trace (see :mod:`.tracing`) and the log context (see
:mod:`.logs`). The runtime calls it at four points: claimed, handler, commit
and ended; everything else stays out of the runtime's way."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import tracing
from .envelope import Envelope
from .logs import turn_context
from .metrics import Metrics
from .workitem import Outcome, WorkItem


@dataclass
class Run:
    """What the handler block learns: set :attr:`outcome` before it ends."""

    outcome: Outcome | None = None
    lost: bool = False


@dataclass
class TurnObserver:
    """Per-turn observation for one worker."""

    metrics: Metrics
    #: The open ``agentdispatch.turn`` span of each turn in flight, by job id.
    spans: dict[str, Any] = field(default_factory=dict)

    def claimed(self, env: Envelope, item: WorkItem, guard: Any) -> None:
        """A turn was claimed: open its trace under the submitter's."""
        if not tracing.enabled():
            return
        turn = tracing.start(
            "turn",
            traceparent=env.traceparent,
            job_id=item.id,
            kind=item.kind,
            session_id=item.session_id,
            tenant=item.tenant,
            attempt=item.attempt,
            epoch=guard.lease.epoch,
        )
        claim = tracing.start("claim", parent=turn, queued_s=max(0.0, time.time() - env.enqueued_at))
        tracing.end(claim)
        self.spans[item.id] = turn
        guard.trace = turn  # side effects hang their spans under the turn

    @contextlib.contextmanager
    def handler(self, item: WorkItem, epoch: int) -> Iterator[Run]:
        """The handler's block: its duration and result by kind, its span,
        and the turn's fields on every log record inside."""
        run = Run()
        began = time.perf_counter()
        fields = {"job_id": item.id, "session_id": item.session_id, "tenant": item.tenant}
        with (
            turn_context(**fields, attempt=item.attempt, epoch=epoch),
            tracing.span("handler", parent=self.spans.get(item.id), kind=item.kind) as s,
        ):
            try:
                yield run
            finally:
                seconds = time.perf_counter() - began
                result = _result(run)
                self.metrics.run_seconds.labels(kind=item.kind).observe(seconds)
                self.metrics.runs.labels(kind=item.kind, result=result).inc()
                if s is not None:
                    s.set_attribute("agentdispatch.result", result)

    @contextlib.contextmanager
    def commit(self, job_ids: Sequence[str]) -> Iterator[None]:
        """One commit of finished turns: a ``commit`` span in each one's trace."""
        if not tracing.enabled():
            yield
            return
        spans = [tracing.start("commit", parent=self.spans.get(j), batch=len(job_ids)) for j in job_ids]
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            for s in spans:
                tracing.end(s, error=error)

    def ended(self, job_id: str, end: str) -> None:
        """The turn is settled (committed, fenced or given back): close its trace."""
        tracing.end(self.spans.pop(job_id, None), outcome=end)


def _result(run: Run) -> str:
    if run.lost or run.outcome is None:
        return "lost"
    if run.outcome.ok:
        return "ok"
    return "timeout" if run.outcome.reason == "timeout" else "error"
