"""The jobs API: ``POST /api/graph/jobs`` (dispatch / status / cancel) and
its REST twins under ``/v1/jobs``."""

# No `from __future__ import annotations`: FastAPI must evaluate the route
# signatures, which use aliases local to the router factory.
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..dispatch import Submission
from ..stores.base import JobFilter
from ..waiting import MAX_WAIT_S, await_view
from ..workitem import Status
from . import dashboard_api
from . import fields as f
from .auth import Caller
from .errors import ApiError
from .services import Services


class JobSpec(BaseModel):
    """A submission: what to run, for whom, and in which serial scope."""

    model_config = ConfigDict(extra="forbid")

    kind: f.Kind = "orchestrator_task"
    payload: f.Payload = None
    task: f.Task = None
    tenant: f.Tenant = None
    session_id: f.SessionId = None
    priority: f.Priority = 0
    deadline_unix: f.Deadline = None
    dependencies: f.Dependencies = None
    job_id: f.JobId = None
    idempotency_key: f.IdempotencyKey = None
    agent_name: f.AgentName = ""
    not_before: f.NotBefore = None
    delay_s: f.DelayS = None
    timeout_s: f.TimeoutS = None


class GraphRequest(JobSpec):
    """``{"action": "dispatch" | "status" | "cancel", ...}``."""

    action: Literal["dispatch", "status", "cancel"]
    reason: f.Reason = None


class CancelRequest(BaseModel):
    """Optional body of a cancel."""

    model_config = ConfigDict(extra="forbid")
    reason: f.Reason = None


class JobHandleOut(BaseModel):
    """The job handle a submit returns (SPEC section 8)."""

    job_id: str
    session_id: str
    kind: str
    dispatch: str
    status: str
    status_url: str
    status_request: dict[str, Any]


class BatchRequest(BaseModel):
    """Many submissions, accepted all or nothing."""

    model_config = ConfigDict(extra="forbid")
    jobs: list[JobSpec] = Field(min_length=1, max_length=500)


class BatchOut(BaseModel):
    """The handles of a batch, in submission order."""

    jobs: list[JobHandleOut]


class JobView(BaseModel):
    """The WorkItem view: everything but lease secrets."""

    model_config = ConfigDict(extra="allow")
    job_id: str
    kind: str
    status: str
    payload_ref: str
    result_ref: str | None
    attempt: int


class JobPage(BaseModel):
    """A page of jobs, newest first."""

    jobs: list[JobView]
    page: dict[str, Any]


class NotFound(BaseModel):
    """``{"status": "not_found", "error": "Job <id> not found"}``."""

    status: Literal["not_found"]
    error: str


class ErrorOut(BaseModel):
    """Every other error: a stable code and a human message."""

    status: Literal["error"]
    error: str
    message: str


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut},
    401: {"model": ErrorOut},
    403: {"model": ErrorOut},
    404: {"model": NotFound},
    409: {"model": ErrorOut},
    413: {"model": ErrorOut},
    422: {"model": ErrorOut},
    429: {"model": ErrorOut},
    503: {"model": ErrorOut},
}


def _submission(spec: JobSpec, caller: Caller, idempotency_key: str | None) -> Submission:
    data = spec.model_dump(exclude_unset=True, exclude={"action", "reason", "tenant"})
    if "task" in data and data["task"] is None:
        del data["task"]
    if idempotency_key is not None and "idempotency_key" not in data and "job_id" not in data:
        data["idempotency_key"] = idempotency_key
    return Submission.from_mapping(data, tenant=caller.submit_tenant(spec.tenant))


def _ok(data: Any, status: int = 200) -> Response:
    # A ready Response skips FastAPI's re-validation of the return value, which
    # it would run in a second thread-pool hop; the models above still document it.
    return JSONResponse(data, status_code=status)


def build_router(services: Services, caller_dep: Any) -> APIRouter:
    """The jobs routes over ``services.dispatcher``."""
    router = APIRouter(responses=ERRORS)
    d = services.dispatcher
    CallerDep = Annotated[Caller, Depends(caller_dep)]
    IdemKey = Annotated[
        str | None, Header(alias="Idempotency-Key", pattern=f.IDENT, description="A repeat returns the same job.")
    ]

    @router.post(
        "/api/graph/jobs",
        response_model=JobHandleOut | JobView,
        tags=["graph"],
        summary="Dispatch, read or cancel a job",
    )
    def graph_jobs(body: GraphRequest, caller: CallerDep, idempotency_key: IdemKey = None) -> Response:
        """One endpoint, three actions; the shapes are those of SPEC section 8."""
        if body.action == "dispatch":
            return _ok(d.submit(_submission(body, caller, idempotency_key)).model_dump())
        if body.job_id is None:
            raise ApiError(422, "invalid_request", f"job_id is required for action {body.action!r}")
        if body.action == "status":
            return _ok(d.status(body.job_id, caller.tenant))
        return _ok(d.cancel(body.job_id, caller.tenant, body.reason or "cancelled"))

    @router.post("/v1/jobs", status_code=202, response_model=JobHandleOut, tags=["jobs"], summary="Submit a job")
    def create_job(body: JobSpec, caller: CallerDep, idempotency_key: IdemKey = None) -> Response:
        """Accept one turn; answers once it is durable."""
        return _ok(d.submit(_submission(body, caller, idempotency_key)).model_dump(), 202)

    @router.post(
        "/v1/jobs/batch", status_code=202, response_model=BatchOut, tags=["jobs"], summary="Submit jobs together"
    )
    def create_jobs(body: BatchRequest, caller: CallerDep) -> Response:
        """Accept many turns in one transaction (all or nothing); a job's
        ``idempotency_key`` or ``job_id`` makes a retried batch return the same jobs."""
        subs = [_submission(spec, caller, None) for spec in body.jobs]
        return _ok({"jobs": [h.model_dump() for h in d.submit_many(subs)]}, 202)

    @router.get("/v1/jobs", response_model=JobPage, tags=["jobs"], summary="List and search jobs")
    def list_jobs(
        caller: CallerDep,
        status: Annotated[Status | None, Query(description="Only jobs in this status.")] = None,
        kind: Annotated[str | None, Query(min_length=1, max_length=100, description="Only this kind.")] = None,
        session_id: Annotated[str | None, Query(min_length=1, max_length=200, description="Only this session.")] = None,
        agent_name: Annotated[str | None, Query(min_length=1, max_length=200, description="Only this agent.")] = None,
        created_after: Annotated[float | None, Query(description="Created at or after this unix time.")] = None,
        created_before: Annotated[float | None, Query(description="Created before this unix time.")] = None,
        q: Annotated[str | None, Query(min_length=1, max_length=200, description="Text in the job id.")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    ) -> Response:
        """Jobs newest first; every filter is applied by the store, so a page
        holds only matching jobs and ``more`` says whether another page may."""
        filters = JobFilter(
            kind=kind,
            session_id=session_id,
            agent_name=agent_name,
            created_from=created_after,
            created_to=created_before,
            id_contains=q,
        )
        items = d.jobs(caller.tenant, status, limit=limit, offset=offset, filters=filters)
        page = {"limit": limit, "offset": offset, "returned": len(items), "more": len(items) == limit}
        return _ok({"jobs": [i.view() for i in items], "page": page})

    @router.get("/v1/jobs/{job_id}", response_model=JobView, tags=["jobs"], summary="Read a job")
    async def get_job(
        job_id: str,
        caller: CallerDep,
        wait: Annotated[
            float,
            Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for the job to end (long-poll)."),
        ] = 0,
    ) -> Response:
        """The WorkItem view of one job; with ``wait``, answered once the job is
        terminal or the wait is over (whatever its status then)."""

        async def read() -> dict[str, Any]:
            # The token lookup (first use of caller.tenant) runs in the thread too.
            return await run_in_threadpool(lambda: d.status(job_id, caller.tenant))

        if wait <= 0:
            return _ok(await read())
        return _ok(await await_view(read, wait))

    @router.get("/v1/jobs/{job_id}/history", tags=["jobs"], summary="A job's history")
    def job_history(job_id: str, caller: CallerDep) -> Response:
        """Events (attempts, leases, outcomes) and the side-effect ledger."""
        return _ok(d.history(job_id, caller.tenant))

    @router.post("/v1/jobs/{job_id}/cancel", response_model=JobView, tags=["jobs"], summary="Cancel a job")
    def cancel_job(job_id: str, caller: CallerDep, body: CancelRequest | None = None) -> Response:
        """Cancel a non-terminal job (a running worker is fenced out)."""
        return _ok(d.cancel(job_id, caller.tenant, (body.reason if body else None) or "cancelled"))

    @router.post("/v1/jobs/{job_id}/replay", tags=["jobs"], summary="Replay a dead-lettered job")
    def replay_job(job_id: str, caller: CallerDep) -> Response:
        """Back to ready as a new attempt; answers with the side-effect ledger."""
        view = d.replay(job_id, caller.tenant)
        return _ok({"job": view, "side_effects": d.history(job_id, caller.tenant)["side_effects"]})

    # The dashboard's own reads and bulk actions, beside the routes they extend.
    router.include_router(dashboard_api.build_router(services, caller_dep))
    return router
