"""The schedules API under ``/v1/schedules``: periodic jobs of a tenant."""

# No `from __future__ import annotations`: FastAPI must evaluate the route
# signatures, which use aliases local to the router factory.
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..schedules import Schedules
from .api import ERRORS
from .auth import Caller
from .fields import IDENT
from .services import Services

NAME = r"^[A-Za-z0-9_.:-]{1,100}$"


class ScheduleSpec(BaseModel):
    """A periodic schedule: one job of ``kind`` per tick of ``cron`` in ``tz``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME, max_length=100)
    cron: str = Field(max_length=200, description="5 fields (minute first), or 6 with seconds last.")
    tz: str = Field(default="UTC", max_length=100, description="An IANA time zone.")
    kind: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,100}$", max_length=100)
    payload: Any = None
    session_id: str | None = Field(default=None, pattern=IDENT, max_length=200, description="Serialise the ticks.")
    priority: int = Field(default=0, ge=-100, le=100)
    agent_name: str = Field(default="", max_length=200)
    paused: bool = False


class ScheduleView(BaseModel):
    """A schedule as stored; ``next_at`` is the next tick (unix time), null while paused."""

    model_config = ConfigDict(extra="allow")
    name: str
    cron: str
    tz: str
    kind: str
    paused: bool
    next_at: float | None


class SchedulePage(BaseModel):
    """The tenant's schedules by name."""

    schedules: list[ScheduleView]


def _tenant(caller: Caller) -> str:
    return caller.tenant or "default"


def build_router(services: Services, caller_dep: Any) -> APIRouter:
    """The schedules routes over ``services.dispatcher``."""
    router = APIRouter(responses=ERRORS, tags=["schedules"])
    sched = Schedules(services.dispatcher)
    CallerDep = Annotated[Caller, Depends(caller_dep)]

    @router.post("/v1/schedules", status_code=201, response_model=ScheduleView, summary="Add a schedule")
    def add_schedule(body: ScheduleSpec, caller: CallerDep) -> Response:
        """Store a schedule; it fires from its first tick after now."""
        fields = body.model_dump(exclude={"name"})
        return JSONResponse(sched.add(_tenant(caller), body.name, **fields), status_code=201)

    @router.get("/v1/schedules", response_model=SchedulePage, summary="List schedules")
    def list_schedules(caller: CallerDep) -> Response:
        """The tenant's schedules by name."""
        return JSONResponse({"schedules": sched.entries(_tenant(caller))})

    @router.get("/v1/schedules/{name}", response_model=ScheduleView, summary="Read a schedule")
    def get_schedule(name: str, caller: CallerDep) -> Response:
        """One schedule, with its next tick and the job its last tick fired."""
        return JSONResponse(sched.get(_tenant(caller), name))

    @router.post("/v1/schedules/{name}/pause", response_model=ScheduleView, summary="Pause a schedule")
    def pause_schedule(name: str, caller: CallerDep) -> Response:
        """Stop firing until resumed."""
        return JSONResponse(sched.pause(_tenant(caller), name))

    @router.post("/v1/schedules/{name}/resume", response_model=ScheduleView, summary="Resume a schedule")
    def resume_schedule(name: str, caller: CallerDep) -> Response:
        """Fire again from the first tick after now (ticks while paused do not fire)."""
        return JSONResponse(sched.resume(_tenant(caller), name))

    @router.delete("/v1/schedules/{name}", response_model=ScheduleView, summary="Delete a schedule")
    def delete_schedule(name: str, caller: CallerDep) -> Response:
        """Delete a schedule; the jobs it fired stay."""
        return JSONResponse(sched.delete(_tenant(caller), name))

    return router
