"""Operator views: fleet topology, Prometheus metrics, the dashboard overview
and a health probe."""

# No `from __future__ import annotations`: FastAPI must evaluate the route
# signatures, which use aliases local to the router factory.
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import AgentDispatchError
from ..fleet import topology
from ..workitem import HELD, Status
from .auth import Caller
from .errors import RETRY_AFTER_S, error_body, is_outage
from .services import Services

#: How many held items are read to find a tenant's active sessions.
SESSION_SCAN = 1000


def tenant_sessions(services: Services, tenant: str | None) -> set[str] | None:
    """Sessions the tenant has on workers right now (None: show all)."""
    if tenant is None:
        return None
    sessions: set[str] = set()
    for status in HELD:
        items = services.store.list_jobs(tenant=tenant, status=status, limit=SESSION_SCAN, offset=0)
        sessions.update(i.session_id for i in items)
    return sessions


def refresh_metrics(services: Services, tenant: str | None) -> None:
    """Set the gauges from the store and transport (scrape time is read time)."""
    m, store = services.metrics, services.store
    m.queue_depth.labels(backend=services.transport.name).set(services.transport.depth())
    m.workers.set(len(store.workers()))
    dead = store.counts(tenant).get(Status.DEAD_LETTER.value, 0)
    m.dead_letters.set(dead)
    oldest = 0.0
    if dead:
        # list_jobs is newest first, so the last row is the oldest dead letter.
        rows = store.list_jobs(tenant=tenant, status=Status.DEAD_LETTER, limit=1, offset=dead - 1)
        if rows:
            stamp = rows[0].completed_at or rows[0].updated_at
            oldest = max(0.0, time.time() - stamp)
    m.dead_letter_oldest.set(oldest)


def build_router(services: Services, caller_dep: Any) -> APIRouter:
    """Topology, metrics, overview and health routes."""
    router = APIRouter()
    CallerDep = Annotated[Caller, Depends(caller_dep)]

    @router.get("/api/fleet/topology", tags=["fleet"], summary="Live workers and their sessions")
    def fleet_topology(
        caller: CallerDep,
        limit: Annotated[int, Query(ge=1, le=1000)] = 200,
        offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    ) -> Any:
        """Heartbeat rows newer than 90 s; sessions are limited to the caller's tenant."""
        try:
            sessions = tenant_sessions(services, caller.tenant)
            doc = topology(services.store, tenant_sessions=sessions, limit=limit, offset=offset)
        except Exception as exc:
            if not (is_outage(exc) or isinstance(exc, AgentDispatchError)):
                raise
            body = error_body("unavailable", "the worker registry cannot be read; retry later", partial=True)
            body.update(dispatch_workers=[], totals=None, page={"limit": limit, "offset": offset, "returned": 0})
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        doc["backend"] = services.transport.name
        doc["partial"] = False
        return doc

    @router.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response)
    def metrics(caller: CallerDep) -> Response:
        """The dispatch series; gauges are read from the store at scrape time."""
        with services.metrics_lock:
            refresh_metrics(services, caller.tenant)
            body = services.metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @router.get("/api/overview", tags=["ops"], summary="Dashboard summary")
    def overview(caller: CallerDep) -> dict[str, Any]:
        """Depth per backend, jobs per status for the caller's tenant, fleet totals."""
        counts = services.store.counts(caller.tenant)
        workers = services.store.workers()
        active = sum(counts.get(s.value, 0) for s in (Status.SUBMITTED, Status.READY))
        return {
            "tenant": caller.tenant,
            "backend": services.transport.name,
            "depth": {
                "backend": services.transport.depth(),
                "tenant": active,
                "max_depth": services.settings.max_depth,
            },
            "counts": {s.value: counts.get(s.value, 0) for s in Status},
            "workers": {"live": len(workers), "capacity": sum(w.capacity for w in workers)},
            "auth": services.auth,
        }

    @router.get("/healthz", tags=["ops"], summary="Liveness and store reachability")
    def healthz() -> Any:
        """200 when the store and transport answer; 503 otherwise (no details)."""
        try:
            services.store.ping()
            services.transport.ping()
        except Exception as exc:
            if not (is_outage(exc) or isinstance(exc, AgentDispatchError)):
                raise
            return JSONResponse(
                error_body("unavailable", "store or transport unreachable"),
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return {"status": "ok"}

    return router
