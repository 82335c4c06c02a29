"""Read a webhook body from the ASGI stream: capped and under a deadline,
never trusting Content-Length alone and never buffering past the cap."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

MAX_BODY = 1024 * 1024


class BodyRejected(Exception):
    """The body is too large (413), too slow (408) or gone (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_capped(request: Request, *, limit: int = MAX_BODY, timeout_s: float) -> bytes:
    """The raw body; raises :class:`BodyRejected` past ``limit`` or ``timeout_s``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRejected(413, "body larger than 1 MiB")
    buf = bytearray()
    # One timer for the whole read: a wait_for per chunk cost a task each, on
    # the event loop every webhook shares.
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise BodyRejected(413, "body larger than 1 MiB")
    except TimeoutError:
        raise BodyRejected(408, "body not received in time") from None
    except ClientDisconnect:
        raise BodyRejected(400, "client went away") from None
    return bytes(buf)
