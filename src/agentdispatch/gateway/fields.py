"""The fields of a submission as annotated types, with their constraints and
descriptions: the HTTP API's models and the MCP tools' schemas both use these,
so a caller sees the same rules whichever door it comes through."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ..dispatch import MAX_DELAY_S, MAX_TIMEOUT_S
from ..envelope import MAX_PAYLOAD_BYTES

IDENT = r"^[A-Za-z0-9_.:@/+=-]{1,200}$"
KIND = r"^[A-Za-z0-9_.:-]{1,100}$"

Ident = Annotated[str, Field(pattern=IDENT, max_length=200)]

Kind = Annotated[
    str,
    Field(pattern=KIND, max_length=100, description="The handler that runs the turn: 1-100 of A-Z a-z 0-9 _.:-"),
]
Payload = Annotated[
    Any,
    Field(description=f"Any JSON value handed to the handler; at most {MAX_PAYLOAD_BYTES} bytes once encoded."),
]
Task = Annotated[Any, Field(description="Shorthand for payload {'task': ...}.")]
Tenant = Annotated[Ident | None, Field(description="Defaults to the token's tenant.")]
SessionId = Annotated[
    Ident | None,
    Field(description="Serial scope: turns of one session run one at a time, in order (default: the job id)."),
]
Priority = Annotated[int, Field(ge=-100, le=100, description="-100 to 100; higher runs first.")]
Deadline = Annotated[float | None, Field(gt=0, description="Unix time; cancelled as expired after it.")]
Dependencies = Annotated[
    list[Ident] | None, Field(max_length=100, description="Up to 100 job ids that must succeed before this one runs.")
]
JobId = Annotated[Ident | None, Field(description="Caller-chosen id; a repeat returns the same job.")]
IdempotencyKey = Annotated[Ident | None, Field(description="Derives the job id; a repeat is a no-op.")]
AgentName = Annotated[str, Field(max_length=200, description="The agent the turn is for (free text).")]
NotBefore = Annotated[float | None, Field(gt=0, description="Start no earlier than this unix time.")]
DelayS = Annotated[
    float | None,
    Field(ge=0, le=MAX_DELAY_S, description=f"Start this many seconds after acceptance (0 to {MAX_DELAY_S:g})."),
]
TimeoutS = Annotated[
    float | None,
    Field(gt=0, le=MAX_TIMEOUT_S, description="Cancel and retry an attempt running longer than this many seconds."),
]
Reason = Annotated[str | None, Field(max_length=200, description="Why the job is cancelled (shown as its reason).")]
