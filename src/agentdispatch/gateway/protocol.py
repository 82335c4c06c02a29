"""The gateway's HTTP/1.1 connections: uvicorn's h11 protocol plus a deadline
for the request head and a lingering close.

The head deadline: uvicorn has none, so a client that connected and sent
nothing, or trickled its headers, held its connection (a file descriptor)
for as long as it liked, and enough of them locked everyone else out.

The lingering close: an answer given before the request body was read (413
for a declared 50 MB, 408 for a stalled body) ends the connection while the
client is still sending. Closing a socket with unread data in it makes the
kernel send a reset, and a client still busy sending often lost the answer
it had not read yet (Slack its X-Slack-No-Retry with it). So, as web servers
do, such a connection first only shuts its write side (the client reads the
answer, then end of stream) and reads and drops what still arrives, for at
most :data:`LINGER_S` and :data:`LINGER_BYTES`, before it closes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: How long a connection answered before its request body was read goes on
#: reading (and dropping) the body after the answer, before it closes.
LINGER_S = 2.0
#: How much of it the connection reads at most in that time: past that it
#: stops reading (the client's sends then block) and waits out LINGER_S.
LINGER_BYTES = 4 * 1024 * 1024


class _CloseAsked(asyncio.Transport):
    """The socket transport as uvicorn's protocol sees it: the real one,
    except that ``close()`` goes through :meth:`LingeringClose.close_asked`.
    uvicorn closes a must-close connection from inside its request cycle,
    which no protocol hook reaches; everything else passes straight through."""

    def __init__(self, inner: asyncio.Transport, owner: LingeringClose) -> None:
        super().__init__()
        self._inner = inner
        self._owner = owner

    def close(self) -> None:
        self._owner.close_asked()

    def is_closing(self) -> bool:
        # A lingering connection is closing as far as uvicorn is concerned: no
        # keep-alive timer, no next request.
        return self._owner.lingering or self._inner.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        self._inner.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview[Any]]) -> None:
        self._inner.writelines(list_of_data)

    def write_eof(self) -> None:
        self._inner.write_eof()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def abort(self) -> None:
        self._inner.abort()


class LingeringClose(H11Protocol):
    """uvicorn's h11 protocol, lingering before it closes a connection whose
    answer is complete but whose request body was not read to its end."""

    lingering = False
    _socket: asyncio.Transport
    _lost = False
    _linger_left = 0
    _linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport
        super().connection_made(_CloseAsked(transport, self))

    def close_asked(self) -> None:
        """uvicorn (or this class) wants the connection closed: linger first
        when the answer is out and the client may still be sending its body."""
        answered = self.conn.our_state in (h11.MUST_CLOSE, h11.CLOSED)
        body_unread = answered and self.conn.their_state is h11.SEND_BODY
        if self.lingering or self._lost or self._socket.is_closing() or not body_unread:
            self._socket.close()
            return
        self.lingering = True
        self._linger_left = LINGER_BYTES
        if self.cycle is not None:
            self.cycle.body = bytearray()  # body read ahead that nobody will take
        # uvicorn pauses reading while the application does not take the body.
        self._socket.resume_reading()
        if self._socket.can_write_eof():
            self._socket.write_eof()  # after the answer still buffered, if any
        self._linger_timer = self.loop.call_later(LINGER_S, self._socket.close)

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)
            return
        # The rest of the unread body: dropped unparsed, and only so much of it.
        self._linger_left -= len(data)
        if self._linger_left <= 0:
            self._socket.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)


def with_head_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a lingering close, closing a connection
    whose request head is not complete within ``timeout_s`` of the
    connection or of the last answer."""

    class HeadDeadline(LingeringClose):
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
