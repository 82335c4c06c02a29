"""Operator views: fleet topology, Prometheus metrics, the dashboard overview,
liveness (``/healthz``) and readiness (``/readyz``)."""

# No `from __future__ import annotations`: FastAPI must evaluate the route
# signatures, which use aliases local to the router factory.
import asyncio
import hmac
import weakref
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import AgentDispatchError
from ..fleet import topology
from ..metrics import GATEWAY_SERIES, Exposition, FleetCollector
from ..probe import Probe
from ..workitem import HELD, Status
from .auth import Caller, authenticate
from .errors import RETRY_AFTER_S, error_body, is_outage
from .services import Services

#: Fleet views change by the second: no cache may answer for the gateway.
NO_STORE = {"Cache-Control": "no-store"}

#: How many held items are read to find a tenant's active sessions.
SESSION_SCAN = 1000

#: Seconds ``/readyz`` waits for the store and the transport (together): a
#: readiness probe gives up long before a pool stops waiting for a server
#: that is down, and a check that has not answered by then counts as down.
READY_TIMEOUT_S = 3.0


class Readiness:
    """The store and transport pings of ``/readyz``, run at the same time on
    threads of their own (not the request threads, which an outage may all
    hold; see :class:`~agentdispatch.probe.Probe`)."""

    def __init__(self, checks: dict[str, Callable[[], Callable[[], None]]]) -> None:
        self.checks = checks
        self._probes: dict[str, Probe[None]] = {name: Probe(name) for name in checks}

    async def states(self) -> dict[str, str]:
        """Each check's state: ok, or unreachable (failed, or no answer in time)."""
        futs = {name: asyncio.wrap_future(self._probes[name].start(ping())) for name, ping in self.checks.items()}
        await asyncio.wait(futs.values(), timeout=READY_TIMEOUT_S)
        states = {}
        for name, fut in futs.items():
            if not fut.done():
                # Its late answer is read by nobody: mark it read, or asyncio logs it.
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                states[name] = "unreachable"
                continue
            exc = fut.exception()
            if exc is not None and not (is_outage(exc) or isinstance(exc, AgentDispatchError)):
                raise exc
            states[name] = "ok" if exc is None else "unreachable"
        return states


def tenant_sessions(services: Services, tenant: str | None) -> set[str] | None:
    """Sessions the tenant has on workers right now (None: show all)."""
    if tenant is None:
        return None
    sessions: set[str] = set()
    for status in HELD:
        items = services.store.list_jobs(tenant=tenant, status=status, limit=SESSION_SCAN, offset=0)
        sessions.update(i.session_id for i in items)
    return sessions


def metrics_scope(services: Services, header: str | None) -> str | None:
    """The tenant a ``/metrics`` scrape sees: every tenant (None) for the
    operator's metrics token or with auth off, else the bearer token's tenant."""
    secret = services.settings.metrics_token
    if secret is not None and header is not None:
        scheme, _, given = header.partition(" ")
        expected = secret.get_secret_value().encode()
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected):
            return None
    return authenticate(services, header).tenant


#: The depth read of each transport, shared by the scrapes of this process:
#: during a broker outage a scrape waits on the read still running.
_DEPTHS: "weakref.WeakKeyDictionary[Any, Probe[int]]" = weakref.WeakKeyDictionary()


def scrape(services: Services, tenant: str | None) -> bytes:
    """The gateway's exposition: fleet gauges read now, plus its own series.
    The fleet's turn counters are the operator's only: they are not per tenant,
    and a tenant would read every other tenant's traffic from them."""
    depth = _DEPTHS.setdefault(services.transport, Probe("depth"))
    fleet = FleetCollector(
        lambda: (services.store, services.transport), tenant=tenant, counters=tenant is None, depth=depth
    )
    return Exposition(services.metrics.registry, fleet, only=GATEWAY_SERIES).render()


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
            headers = {"Retry-After": str(RETRY_AFTER_S), **NO_STORE}
            return JSONResponse(body, status_code=503, headers=headers)
        doc["backend"] = services.transport.name
        doc["partial"] = False
        return JSONResponse(doc, headers=NO_STORE)

    @router.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=Response)
    def metrics(request: Request) -> Response:
        """Fleet gauges read from the store at scrape time. A tenant's token
        sees its own tenant; the operator's `AGENT_DISPATCH_METRICS_TOKEN`
        sees every tenant. Turn counters are served by each worker."""
        tenant = metrics_scope(services, request.headers.get("authorization"))
        return Response(scrape(services, tenant), media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)

    @router.get("/api/overview", tags=["ops"], summary="Dashboard summary")
    def overview(caller: CallerDep) -> JSONResponse:
        """Depth per backend, jobs per status for the caller's tenant, fleet totals."""
        counts = services.store.counts(caller.tenant)
        workers = services.store.workers()
        active = sum(counts.get(s.value, 0) for s in (Status.SUBMITTED, Status.READY))
        body = {
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
        return JSONResponse(body, headers=NO_STORE)

    @router.get("/healthz", tags=["ops"], summary="Liveness: the process answers")
    async def healthz() -> Any:
        """200 while the process serves requests; it reads nothing (use
        `/readyz` for the store and transport)."""
        # On the event loop, not a worker thread: during a database outage
        # every thread may be waiting for a connection, and a liveness probe
        # that queued behind them would restart a gateway that is fine.
        return JSONResponse({"status": "ok"}, headers=NO_STORE)

    readiness = Readiness({"store": lambda: services.store.ping, "transport": lambda: services.transport.ping})

    @router.get("/readyz", tags=["ops"], summary="Readiness: store and transport reachable")
    async def readyz() -> Any:
        """200 when the store and the transport answer; 503 otherwise (no details)."""
        checks = await readiness.states()
        if any(v != "ok" for v in checks.values()):
            body = error_body("unavailable", "store or transport unreachable")
            body["checks"] = checks
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S), **NO_STORE})
        return JSONResponse({"status": "ok", "checks": checks}, headers=NO_STORE)

    return router
