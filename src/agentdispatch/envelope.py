"""The envelope that travels on a transport, and the job handle a caller gets."""

from __future__ import annotations

import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import InvalidEnvelope

#: Bodies above this size are refused (SPEC section 9: 1 MiB).
MAX_PAYLOAD_BYTES = 1024 * 1024


def new_job_id() -> str:
    """A fresh job id: ``dispatch-`` + 32 lowercase hex characters.

    The first 12 are the milliseconds since the epoch and the other 20 are random
    (80 bits), as in a UUIDv7: ids made close in time sort close together, so
    every index keyed by job id is written near its right-hand edge instead of
    on a random leaf page per turn (fewer pages per commit)."""
    return f"dispatch-{time.time_ns() // 1_000_000 & 0xFFFFFFFFFFFF:012x}{secrets.token_hex(10)}"


class Envelope(BaseModel):
    """References to a WorkItem, never its body. Frozen; JSON round-trips."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(min_length=1, max_length=200)
    session_id: str = Field(min_length=1, max_length=200)
    kind: str = Field(min_length=1, max_length=100)
    payload_ref: str = Field(min_length=1, max_length=200)
    agent_name: str = ""
    tenant: str = Field(min_length=1, max_length=200)
    priority: int = 0
    deadline_unix: float | None = None
    attempt: int = Field(default=0, ge=0)
    enqueued_at: float
    #: The W3C trace context of the submission (tracing.py); absent without one.
    traceparent: str | None = Field(default=None, max_length=512)

    def to_json(self) -> str:
        """Serialise for the wire (an untraced envelope has no ``traceparent``)."""
        return self.model_dump_json(exclude={"traceparent"} if self.traceparent is None else None)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Envelope:
        """Parse from the wire; anything malformed raises :class:`InvalidEnvelope`."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "envelope"
            raise InvalidEnvelope(f"invalid envelope: {where}: {first.get('msg')}") from None


class JobHandle(BaseModel):
    """What a submit returns at once (SPEC section 8)."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    session_id: str
    kind: str
    dispatch: str = "queued"
    status: str = "pending"
    status_url: str = "/api/graph/jobs"
    status_request: dict[str, Any]

    @classmethod
    def for_job(cls, job_id: str, session_id: str, kind: str) -> JobHandle:
        """The handle of one submitted job."""
        return cls(
            job_id=job_id,
            session_id=session_id,
            kind=kind,
            status_request={"action": "status", "job_id": job_id},
        )
