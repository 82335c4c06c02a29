"""What the dashboard reads and does beyond the jobs API: depth per tenant and
kind, an activity series for its chart, and bulk replay / purge of the DLQ.

Every route takes the caller's tenant like the others (an operator without a
tenant sees all); a bulk action checks every id before it changes anything.
"""

# No `from __future__ import annotations`: FastAPI must evaluate the route
# signatures, which use aliases local to the router factory.
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..stores.base import Activity
from ..workitem import Status
from . import fields as f
from .auth import Caller
from .errors import ApiError
from .services import Services

#: The most buckets one activity answer holds (a day by the minute).
MAX_BUCKETS = 1440
#: The statuses a finished item ends in, as the chart draws them.
FINISHED = ("succeeded", "failed", "cancelled", "dead_letter")


class BulkRequest(BaseModel):
    """Dead-lettered jobs to act on together."""

    model_config = ConfigDict(extra="forbid")
    job_ids: list[f.Ident] = Field(min_length=1, max_length=500, description="1-500 ids of dead-lettered jobs.")


def activity_series(act: Activity, buckets: int) -> list[dict[str, Any]]:
    """One row per bucket: its start, the items accepted and finished in it
    (by status), and the open items (accepted, not finished) at its end."""
    rows: list[dict[str, Any]] = []
    depth = act.open_at_start
    for i in range(buckets):
        done = act.finished.get(i, {})
        accepted = act.created.get(i, 0)
        depth += accepted - sum(done.values())
        row: dict[str, Any] = {"t": act.since + i * act.bucket_s, "accepted": accepted}
        row.update({s: done.get(s, 0) for s in FINISHED})
        row["finished"] = sum(done.values())
        row["open"] = max(0, depth)
        rows.append(row)
    return rows


def _checked_dead_letters(services: Services, job_ids: list[str], tenant: str | None) -> list[str]:
    """The ids, de-duplicated, once each is a dead letter the caller may see;
    raises 404 / 409 (nothing changed) otherwise."""
    ids = list(dict.fromkeys(job_ids))
    for job_id in ids:
        item = services.store.get(job_id, tenant)  # JobNotFound: 404, like every read
        if item.status is not Status.DEAD_LETTER:
            raise ApiError(
                409, "not_dead_letter", f"job {job_id} is {item.status.value}, not dead_letter; nothing was changed"
            )
    return ids


def build_router(services: Services, caller_dep: Any) -> APIRouter:
    """Depth, activity and bulk DLQ routes."""
    router = APIRouter()
    CallerDep = Annotated[Caller, Depends(caller_dep)]
    store, d = services.store, services.dispatcher

    @router.get("/api/depth", tags=["ops"], summary="Waiting and running turns per tenant and kind")
    def depth(caller: CallerDep) -> Response:
        """Non-terminal jobs of the caller's tenant (an operator: every tenant)
        as rows of tenant, kind, status and count, with totals per tenant and kind."""
        rows = store.depth_breakdown(caller.tenant)
        by_tenant: dict[str, int] = {}
        by_kind: dict[str, int] = {}
        for tenant, kind, _status, n in rows:
            by_tenant[tenant] = by_tenant.get(tenant, 0) + n
            by_kind[kind] = by_kind.get(kind, 0) + n
        body = {
            "tenant": caller.tenant,
            "rows": [{"tenant": t, "kind": k, "status": s, "count": n} for t, k, s, n in rows],
            "by_tenant": by_tenant,
            "by_kind": by_kind,
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @router.get("/api/activity", tags=["ops"], summary="Throughput and depth over time")
    def activity(
        caller: CallerDep,
        window_s: Annotated[int, Query(ge=60, le=86400, description="How far back, in seconds.")] = 3600,
        bucket_s: Annotated[int, Query(ge=5, le=3600, description="Seconds per point.")] = 60,
    ) -> Response:
        """Per bucket: jobs accepted, jobs finished by final status, and jobs
        open (accepted, not yet finished) at the bucket's end; read from the
        store, so every gateway answers the same and the past is there at once."""
        if window_s % bucket_s or window_s // bucket_s > MAX_BUCKETS:
            raise ApiError(
                422,
                "invalid_request",
                f"window_s must be a multiple of bucket_s and at most {MAX_BUCKETS} buckets long",
            )
        buckets = window_s // bucket_s
        # The last bucket ends at the next whole bucket, so points stay put between refreshes.
        end = (int(time.time()) // bucket_s + 1) * bucket_s
        act = store.activity(caller.tenant, since=float(end - window_s), bucket_s=float(bucket_s))
        body = {
            "tenant": caller.tenant,
            "since": act.since,
            "bucket_s": bucket_s,
            "points": activity_series(act, buckets),
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @router.post("/v1/dlq/replay", tags=["jobs"], summary="Replay dead-lettered jobs")
    def replay_many(body: BulkRequest, caller: CallerDep) -> Response:
        """Every id must name a dead letter of the caller's tenant (else 404 or
        409 and nothing is replayed); each goes back to ready as a new attempt."""
        ids = _checked_dead_letters(services, body.job_ids, caller.tenant)
        return JSONResponse({"jobs": [d.replay(job_id, caller.tenant) for job_id in ids]})

    @router.post("/v1/dlq/purge", tags=["jobs"], summary="Delete dead-lettered jobs")
    def purge_many(body: BulkRequest, caller: CallerDep) -> Response:
        """Delete dead letters of the caller's tenant for good (their history
        too; the side-effect ledger stays). Every id must name a dead letter
        (else 404 or 409 and nothing is deleted)."""
        ids = _checked_dead_letters(services, body.job_ids, caller.tenant)
        return JSONResponse({"purged": store.purge_dead(ids, caller.tenant)})

    return router
