"""A TCP proxy between worker processes and a PostgreSQL cluster of a test's
own, that breaks the link on demand: cut every connection (the server's host
went away with a reset), blackhole connections (the sockets stay open and
every byte is held: a half-open link, a silent middlebox), and resume.

Blackholed here, the worker's kernel still sees a live peer (this process's
kernel acknowledges its bytes and keepalive probes): what it observes is a
server that stopped answering, which only an answer timeout of its own
detects. Each connection is known by the port its upstream side has, which
is what ``pg_stat_activity.client_port`` shows for its backend.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Link:
    """One proxied connection."""

    client: socket.socket
    server: socket.socket
    #: Held: nothing is read from either side, so nothing is forwarded.
    held: bool = False
    #: Only the server's bytes are held: requests arrive, answers do not.
    answers_held: bool = False
    #: To be closed with a reset by the proxy's thread.
    cut: bool = False
    closed: bool = False
    #: Set once both sockets are closed.
    gone: threading.Event = field(default_factory=threading.Event)
    #: Bytes forwarded client to server, and server to client.
    sent: list[int] = field(default_factory=lambda: [0, 0])

    @property
    def upstream_port(self) -> int:
        """The local port of the server side (the backend's ``client_port``)."""
        return int(self.server.getsockname()[1])


class FaultProxy:
    """Listens on a free loopback port and forwards to ``127.0.0.1:target``."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listen.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self.links: list[Link] = []
        #: New connections are held at once (a blackhole of the whole route).
        self.hold_new = False
        #: New connections get their answers held at once.
        self.hold_new_answers = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    def uri(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> FaultProxy:
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        self._poke()
        self._thread.join(timeout=10)
        for link in self.live():
            self._drop(link)
        self._listen.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- faults ------------------------------------------------------------------
    def cut_all(self) -> int:
        """Close every connection now (with a reset); how many."""
        live = self.live()
        for link in live:
            link.cut = True
        self._poke()
        for link in live:
            link.gone.wait(10)
        return len(live)

    def blackhole(self, ports: set[int] | None = None, *, new: bool = True, answers_only: bool = False) -> int:
        """Hold the connections whose upstream port is in ``ports`` (None:
        every one, and with ``new`` every later one too); how many. With
        ``answers_only`` the server still gets every request and runs it,
        and only its answers are held."""
        if ports is None and answers_only:
            self.hold_new_answers = new
        elif ports is None:
            self.hold_new = new
        n = 0
        for link in self.live():
            if ports is None or link.upstream_port in ports:
                if answers_only:
                    link.answers_held = True
                else:
                    link.held = True
                n += 1
        self._poke()
        return n

    def resume(self) -> None:
        """Forward everything again, the bytes held meanwhile first."""
        self.hold_new = self.hold_new_answers = False
        for link in self.live():
            link.held = link.answers_held = False
        self._poke()

    def live(self) -> list[Link]:
        with self._lock:
            return [lk for lk in self.links if not lk.closed]

    # -- the loop ------------------------------------------------------------------
    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stop:
            self._arm()
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    link, inbound = key.data
                    self._pump(link, inbound)

    def _arm(self) -> None:
        """Watch the sockets of every link not held (a held link's bytes wait
        in the kernel's buffers: nothing is read, nothing is lost)."""
        for link in self.live():
            if link.cut:
                self._drop(link, reset=True)
                continue
            for sock, inbound in ((link.client, True), (link.server, False)):
                want = not link.held and not link.closed and (inbound or not link.answers_held)
                registered = sock in self._sel.get_map() if sock.fileno() >= 0 else False
                if want and not registered:
                    self._sel.register(sock, selectors.EVENT_READ, (link, inbound))
                elif not want and registered:
                    self._sel.unregister(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listen.accept()
        except OSError:
            return
        try:
            server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        for s in (client, server):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = Link(client, server, held=self.hold_new, answers_held=self.hold_new_answers)
        with self._lock:
            self.links.append(link)

    def _pump(self, link: Link, inbound: bool) -> None:
        src, dst = (link.client, link.server) if inbound else (link.server, link.client)
        try:
            data = src.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(link)
            return
        try:
            dst.setblocking(True)
            dst.sendall(data)
            dst.setblocking(False)
        except OSError:
            self._drop(link)
            return
        link.sent[0 if inbound else 1] += len(data)

    def _drop(self, link: Link, reset: bool = False) -> None:
        with self._lock:
            if link.closed:
                return
            link.closed = True
        for sock in (link.client, link.server):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)
            if reset:
                # SO_LINGER 0: close sends a reset, as a host that lost the connection would.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            with contextlib.suppress(OSError):
                sock.close()
        link.gone.set()


@contextlib.contextmanager
def fault_proxy(target: int) -> Iterator[FaultProxy]:
    """A started :class:`FaultProxy` to ``target``, closed afterwards."""
    proxy = FaultProxy(target).start()
    try:
        yield proxy
    finally:
        proxy.close()
