"""JSON errors with a stable ``error`` code, and the handlers that map the
library's exceptions onto HTTP statuses."""

from __future__ import annotations

import logging
import sqlite3
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (
    AgentDispatchError,
    IdempotencyConflict,
    InvalidInput,
    InvalidTransition,
    JobNotFound,
    PayloadTooLarge,
    QueueFull,
    TaskQueueUnavailable,
)
from ..schedules import ScheduleExists, ScheduleNotFound

log = logging.getLogger(__name__)

#: Seconds a client should wait before retrying after a 429/503.
RETRY_AFTER_S = 2
#: Seconds between two log lines about 503s answered for a store outage.
OUTAGE_LOG_EVERY_S = 10.0


class ApiError(Exception):
    """An error answer: HTTP status, stable code, human message."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """The one error shape: ``{"status": "error", "error": code, "message": ...}``."""
    return {"status": "error", "error": code, "message": message, **extra}


def is_outage(exc: BaseException) -> bool:
    """Whether an unexpected exception is the database going away (not a bug)."""
    # OSError: the SQLite file or its directory cannot be reached at all.
    if isinstance(exc, (TaskQueueUnavailable, sqlite3.OperationalError, sqlite3.DatabaseError, OSError)):
        return True
    # psycopg is optional: match its operational errors by module, not import.
    mod = type(exc).__module__
    return mod.startswith("psycopg") and type(exc).__name__ in {"OperationalError", "InterfaceError", "PoolTimeout"}


class _OutageLog:
    """One warning per burst of outage answers, with the cause: the caller is
    told only "unavailable", so without it an operator saw 503s in clients
    and nothing in the gateway's log (a full disk, a database gone)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last = -OUTAGE_LOG_EVERY_S
        self.unreported = 0

    def note(self, exc: BaseException) -> None:
        with self.lock:
            self.unreported += 1
            now = time.monotonic()
            if now - self.last < OUTAGE_LOG_EVERY_S:
                return
            count, self.unreported, self.last = self.unreported, 0, now
        # Our own and SQLite's messages name no path; an OSError's or a
        # driver's might (hosts, credentials): their type only.
        ours = isinstance(exc, (TaskQueueUnavailable, sqlite3.Error))
        log.warning(
            "the queue store is unavailable: answered 503 (%d time(s) since the last report): %s",
            count,
            str(exc) if ours else type(exc).__name__,
        )


_outages = _OutageLog()


def error_payload(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(http_status, body, headers)`` for a library exception (HTTP and MCP share it)."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(exc.code, exc.message), exc.headers
    if isinstance(exc, (JobNotFound, ScheduleNotFound)):
        return 404, {"status": "not_found", "error": str(exc)}, {}
    if isinstance(exc, ScheduleExists):
        return 409, error_body("schedule_exists", str(exc)), {}
    if isinstance(exc, PayloadTooLarge):
        return 413, error_body("payload_too_large", str(exc)), {}
    if isinstance(exc, IdempotencyConflict):
        return 409, error_body("idempotency_conflict", str(exc), job_id=exc.job_id), {}
    if isinstance(exc, InvalidInput):
        return 400, error_body("invalid_input", str(exc)), {}
    if isinstance(exc, QueueFull):
        return 429, error_body("queue_full", str(exc)), {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, InvalidTransition):
        return 409, error_body("invalid_transition", str(exc)), {}
    if is_outage(exc):
        _outages.note(exc)
        # Never echo driver messages: they may carry paths or credentials.
        body = error_body("unavailable", "the queue store is unavailable; retry later")
        return 503, body, {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, AgentDispatchError):
        return 400, error_body("rejected", str(exc)), {}
    log.error("unhandled gateway error", exc_info=exc)
    return 500, error_body("internal", "internal error"), {}


def map_exception(exc: BaseException) -> JSONResponse:
    """The HTTP answer for a library exception."""
    status, body, headers = error_payload(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI, authenticate: Callable[[Request], Awaitable[None]] | None = None) -> None:
    """Register the exception handlers on ``app``. ``authenticate`` (raising
    :class:`ApiError` 401) runs before a 422 is answered, so a caller without
    a valid token learns nothing about what a valid body looks like."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return map_exception(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        if authenticate is not None:
            try:
                await authenticate(request)
            except Exception as denied:  # 401, or the store could not tell (503)
                return map_exception(denied)
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        return JSONResponse(error_body("invalid_request", f"{where}: {first.get('msg', 'invalid')}"), status_code=422)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        code = {404: "no_route", 405: "method_not_allowed"}.get(status, "http_error")
        detail = exc.detail if isinstance(exc, StarletteHTTPException) else "error"
        return JSONResponse(error_body(code, str(detail)), status_code=status)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Known classes are handled by the exception middleware (the request ends
    # there); only true bugs reach the catch-all, which also logs them.
    for cls in (ApiError, AgentDispatchError, sqlite3.Error, OSError, *_driver_errors()):
        app.add_exception_handler(cls, on_error)
    app.add_exception_handler(Exception, on_error)


def _driver_errors() -> tuple[type[Exception], ...]:
    # Only a PostgreSQL store or transport raises these, and opening one has
    # imported psycopg already: a SQLite gateway does not load the driver at
    # start-up just to name its errors.
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:
        return ()
    return (psycopg.OperationalError, psycopg.InterfaceError)
