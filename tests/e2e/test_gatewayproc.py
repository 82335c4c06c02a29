"""The gateway harness: a port taken by another server between
``free_port()`` and the gateway's bind is not mistaken for the gateway."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from e2e import gatewayproc


class _Healthy(BaseHTTPRequestHandler):
    """Another test's server: 200 to any GET, /healthz included."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_stranger_on_the_named_port_is_not_taken_for_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stranger = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    taken = int(stranger.server_address[1])
    named = iter([taken])
    free = gatewayproc.free_port
    # The first port named is the stranger's, as if it had bound it in between.
    monkeypatch.setattr(gatewayproc, "free_port", lambda: next(named, None) or free())
    try:
        gw = gatewayproc.start_gateway(tmp_path / "data")
        try:
            assert gw.port != taken and gw.proc.poll() is None
            assert gatewayproc.listens(gw.proc.pid, gw.port)
            with gw.client() as c:
                assert c.get("/openapi.json").json()["info"]["title"] == "agentdispatch gateway"
        finally:
            gw.stop()
    finally:
        stranger.shutdown()
        stranger.server_close()
