"""The gateway's HTTP/1.1 connections: uvicorn's h11 protocol plus a deadline
for the request head. uvicorn has none: a client that connects and sends
nothing, or trickles its headers, held its connection (a file descriptor)
for as long as it liked, so enough of them locked everyone else out."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_head_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not
    complete within ``timeout_s`` of the connection or of the last answer."""

    class HeadDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _head_late(self) -> None:
            # IDLE: the head of the next request has not been parsed yet (a
            # request being read or answered is past IDLE and left alone).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline
